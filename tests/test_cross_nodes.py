"""The recipes that preprocess on Ray Data (``hf_lm``, ``images_cls``) across two Ray nodes that
share no disk (tests/multinode.py): one training worker per node, data and run directory on the
S3 server, streamed by the workers (``data.materialize=never``), a preprocessing slot left on each
node. Each run's checkpoint records where it trained (every worker's node) and where its rows
were preprocessed (each worker's rows per node, ``preprocessed_on``): both nodes did both."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest

from raytrain_loops import storage
from raytrain_loops.engine import checkpoint as ckpt
from tests.test_hf_lm import _corpus

TINY_GPT2 = '{"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64}'

# One training worker of 1 CPU on each node (the head 3 CPUs, the second node 2): 2 CPUs for Ray
# Data on the head and 1 on the second node; preprocessing tasks of 1 CPU, spread over both.
ACROSS = [
    "scaling.num_workers=2",
    "scaling.cpus_per_worker=1",
    "scaling.threads_per_worker=1",
    "scaling.placement_strategy=STRICT_SPREAD",
    "data.materialize=never",
    "data.preprocess.num_cpus=1",
    "data.preprocess.batch_rows=32",
    "data.shuffle_buffer=64",  # windows of 64 rows: a preprocessing task each, several per worker
    "loop.max_steps=16",
    "eval.every_steps=16",
    "checkpoint.every_steps=16",
    "logging.every_steps=8",
    "run.report_every_steps=8",
    "run.progress=false",
]


def _train(cluster, recipe: str, name: str, *overrides: str) -> tuple[subprocess.CompletedProcess, str]:
    """``raytrain-loops train`` from the head's machine into the cluster; the run directory's URI."""
    storage_path = cluster.s3.uri(f"runs-{name}")
    args = [recipe, *ACROSS, f"run.name={name}", f"run.storage_path={storage_path}"]
    args += [f"data.dir={cluster.s3.uri(f'data-{name}')}", *overrides]
    return cluster.cli("train", *args), storage.join(storage_path, name)


def _where(run_dir: str) -> tuple[set[str], set[str]]:
    """The nodes the final checkpoint's workers trained on, and the nodes that preprocessed rows
    for them."""
    final = storage.join(run_dir, "checkpoint_00000016")
    local = storage.download_dir(final, tempfile.mkdtemp(prefix="rtl-final-"))
    trained, preprocessed = set(), set()
    for rank in (0, 1):
        record = ckpt.read_file(local, ckpt.rank_file(rank))
        trained.add(record["node_id"])
        preprocessed.update(node for node, rows in record["preprocessed_on"].items() if rows > 0)
    return trained, preprocessed


@pytest.mark.ray
def test_hf_lm_and_images_cls_train_and_preprocess_on_both_nodes_from_the_bucket(cluster, tmp_path):
    text = _corpus(tmp_path / "text" / "a.jsonl", 200, 0, "the list")
    cluster.ensure_second()
    nodes = {n["node_id"] for n in cluster.nodes()}
    assert len(nodes) == 2 and not cluster.second_sees(text)

    hf, hf_dir = _train(
        cluster,
        "hf_lm",
        "hf",
        f"task.params.model={TINY_GPT2}",
        "task.params.tokenizer={train: {vocab_size: 300}}",
        f"task.params.text={{train: [{text}]}}",
        "task.params.text_key=body",
        "task.params.max_len=32",
        "data.batch_size=4",
        "precision.dtype=fp32",
    )
    assert hf.returncode == 0, hf.stdout[-3000:] + hf.stderr[-3000:]
    images, images_dir = _train(
        cluster,
        "images_cls",
        "images",
        "task.params.train_images=1024",
        "task.params.eval_images=128",
        "task.params.size=32",
        "task.params.width=8",
        "data.batch_size=16",
        "data.eval_batch_size=64",
    )
    assert images.returncode == 0, images.stdout[-3000:] + images.stderr[-3000:]

    for run_dir, metric in ((hf_dir, "eval_bpb"), (images_dir, "eval_accuracy")):
        summary = json.loads(storage.read_text(storage.join(run_dir, "summary.json")))
        assert summary["metrics"]["step"] == 16 and metric in summary["metrics"], summary
        trained, preprocessed = _where(run_dir)
        assert trained == nodes, (run_dir, trained, nodes)
        assert preprocessed == nodes, (run_dir, preprocessed, nodes)
    # Nothing of either run was written on the head's disk: the run directories are in the bucket.
    assert not list(Path.cwd().glob("s3:*"))
