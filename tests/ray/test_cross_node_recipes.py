"""Recipes that preprocess in Ray tasks (``hf_lm``, and ``seamseg`` on a converted COCO
directory) across two Ray nodes that share no disk (tests/support/multinode.py): one training worker per
node, data and run directory on the S3 server, streamed by the workers
(``data.materialize=never``), a preprocessing slot left on each node. Each run's checkpoints
record where it trained (every worker's node) and where its rows were preprocessed (each
worker's rows per node, ``preprocessed_on``): both nodes did both. Between the two runs,
``raytrain-loops convert`` turns a COCO directory in the bucket (a train and a val split) into
the plan's Parquet in the bucket, on the cluster; ``seamseg`` trains on it there.

The ``hf_lm`` run's data is prepared in the driver's staging directory and uploaded to
``data.dir``. The ``seamseg`` run is also the run in a bucket that survives a killed worker: its
log holding each step once, its best checkpoints by ``eval_miou`` in ``best/``, and a rerun of
the finished run that trains and writes nothing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from raytrain_loops import storage
from raytrain_loops.checkpoint import files as ckpt
from raytrain_loops.data.formats import identity
from tests.support.hf_lm import write_corpus
from tests.support.vision_data import write_coco

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
    "logging.every_steps=4",
    "run.report_every_steps=4",
    "run.progress=false",
]


def _train(cluster, home: Path, recipe: str, name: str, *overrides: str) -> tuple[subprocess.CompletedProcess, str]:
    """``raytrain-loops train`` from the head's machine into the cluster (``home``: the driver's
    home, where its staging directories go); the run directory's URI."""
    args = [recipe, *ACROSS, f"run.name={name}", f"run.storage_path={cluster.s3.uri(f'runs-{name}')}"]
    args += [f"data.dir={cluster.s3.uri(f'data-{name}')}", *overrides]
    return cluster.cli("train", *args, home=home), storage.join(cluster.s3.uri(f"runs-{name}"), name)


def _files(uri: str) -> dict[str, int]:
    """Every object under ``uri``: path relative to it -> size."""
    fs, root = pafs.FileSystem.from_uri(uri)
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    return {i.path[len(root) + 1 :]: i.size for i in infos if i.type == pafs.FileType.File}


def _where(run_dir: str) -> tuple[set[str], set[str]]:
    """The nodes the run's checkpoints' workers trained on, and the nodes that preprocessed rows
    for them; every worker's rows were preprocessed on its own node (preferred where it has room,
    as each node does here), some or all of them."""
    trained, preprocessed = set(), set()
    for name in sorted({n.split("/")[0] for n in _files(run_dir) if n.startswith("checkpoint_0")}):
        local = storage.download_dir(storage.join(run_dir, name), tempfile.mkdtemp(prefix="rtl-ckpt-"))
        for rank in (0, 1):
            record = ckpt.read_file(local, ckpt.rank_file(rank))
            trained.add(record["node_id"])
            own = {node for node, rows in record["preprocessed_on"].items() if rows > 0}
            assert record["node_id"] in own, (name, rank, record["node_id"], record["preprocessed_on"])
            preprocessed |= own
    return trained, preprocessed


@pytest.mark.ray
@pytest.mark.timeout(480)  # two 2-worker runs, a conversion and a rerun on the two-node bed
def test_hf_lm_and_seamseg_on_converted_coco_train_and_preprocess_on_both_nodes_from_the_bucket(cluster, tmp_path):
    text = write_corpus(tmp_path / "text" / "a.jsonl", 200, 0, "the list")
    cluster.ensure_second()
    nodes = {n["node_id"] for n in cluster.nodes()}
    assert len(nodes) == 2 and not cluster.second_sees(text)
    home = tmp_path / "home"  # the driver's staging directories, not the user's cache

    hf, hf_dir = _train(
        cluster,
        home,
        "hf_lm",
        "hf",
        f"task.params.model={TINY_GPT2}",
        "task.params.tokenizer={train: {vocab_size: 300}}",
        f"task.params.text={{train: [{text}]}}",
        "task.params.text_key=body",
        "task.params.max_len=32",
        "data.batch_size=4",
        "data.shuffle_buffer=16",  # a worker's 64 rows in 4 windows: 4 preprocessing tasks, spread over the nodes
        "precision.dtype=fp32",
        "loop.max_steps=16",
        "eval.every_steps=16",
        "checkpoint.every_steps=16",
    )
    assert hf.returncode == 0, hf.stdout[-3000:] + hf.stderr[-3000:]
    summary = json.loads(storage.read_text(storage.join(hf_dir, "summary.json")))
    assert summary["metrics"]["step"] == 16 and "eval_bpb" in summary["metrics"], summary
    assert _where(hf_dir) == (nodes, nodes)
    staged = _files(cluster.s3.uri("data-hf"))  # prepared in the driver's staging directory, uploaded
    rows = sorted(n.split("/")[-1] for n in staged if n.endswith(".parquet"))
    assert rows == ["train.parquet", "valid.parquet"], staged

    # raytrain-loops convert on the cluster, the source and the destination in the bucket: a COCO
    # directory's parts written by Ray Data tasks on either node, moved into place, meta.json last.
    # 256 training images: a worker's 128 in 4 windows of data.shuffle_buffer rows each epoch.
    coco = write_coco(tmp_path / "coco", images=256)
    write_coco(coco, images=32, seed=1, split="val")
    fs, base = pafs.FileSystem.from_uri(cluster.s3.uri("coco-src"))
    pafs.copy_files(str(coco), base, destination_filesystem=fs)
    src, dest = cluster.s3.uri("coco-src"), cluster.s3.uri("coco-dest")
    converted = cluster.cli("convert", "coco", src, dest, "--rows-per-file", "64", "--chunk-rows", "16", home=home)
    assert converted.returncode == 0, converted.stdout[-3000:] + converted.stderr[-3000:]
    assert "converted 288 images, 2 categories, " in converted.stdout and "into 5 files" in converted.stdout
    parts = {f"train/part-0000{k}.parquet": 64 for k in range(4)} | {"eval/part-00000.parquet": 32}
    assert identity.identity(dest)["rows"] == parts
    assert json.loads(storage.read_text(storage.join(dest, "meta.json")))["splits"] == {"train": 256, "eval": 32}

    # Rank 0 (it writes the run log) killed at step 6: Ray restarts the group on both nodes.
    seg = [
        "seamseg",
        "seg",
        "task.params.data=coco",
        f"task.params.source={dest}",
        "task.params.size=32",
        "data.batch_size=8",
        "data.eval_batch_size=16",
        "data.shuffle_buffer=32",
        "loop.max_steps=12",
        "eval.every_steps=4",
        "checkpoint.every_steps=4",
        "run.coalesce_reports=false",  # checkpoints 4, 8 and 12, however slowly Ray takes them
        "checkpoint.keep=2",
        "checkpoint.score_metric=eval_miou",
        "run.max_failures=1",
        "fault.plan=[{step: 6, rank: 0, kind: kill}]",
    ]
    out, run = _train(cluster, home, *seg)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(storage.read_text(storage.join(run, "summary.json")))
    assert summary["metrics"]["step"] == 12 and 0.0 <= summary["metrics"]["eval_miou"] <= 1.0, summary
    assert storage.name(summary["checkpoint"]) == "checkpoint_00000012"
    assert not list(Path.cwd().glob("s3:*"))  # nothing written to a local directory named after the URI
    files = _files(run)
    assert "faults/0.fired" in files  # the kill happened
    # The log is uploaded before each checkpoint is reported, and the checkpoint itself after it,
    # in the background. The kill at step 6 nearly always comes after checkpoint 4's upload, and the
    # second attempt continues from it; under load it can come first, and the run starts again.
    # Either way the log holds each step once: the lines the first attempt uploaded (1-4) stay
    # when the second resumes from checkpoint 4, and go when the run starts again.
    restored = json.loads(storage.read_text(storage.join(run, "init.json")) or "{}").get("checkpoint")
    assert restored is None or storage.name(restored) == "checkpoint_00000004"
    log = [json.loads(line) for line in storage.read_text(storage.join(run, "metrics.jsonl")).splitlines()]
    assert [s["step"] for s in log] == list(range(1, 13)) and all(math.isfinite(s["loss"]) for s in log), log
    best = json.loads(storage.read_text(storage.join(run, "best", "best.json")))
    assert len(best) == 2 and all(f"best/{e['checkpoint']}/state.pt" in files for e in best)
    # The newest and the one before (4 too, when the kill came before Ray had registered it).
    assert {n.split("/")[0] for n in files if n.startswith("checkpoint_0")} >= {
        "checkpoint_00000008",
        "checkpoint_00000012",
    }
    assert _where(run) == (nodes, nodes)

    again, _ = _train(cluster, home, *seg)  # finished: nothing trained, nothing written
    assert again.returncode == 0 and "already finished at step 12" in again.stdout + again.stderr, again.stderr
    assert _files(run) == files


def test_the_second_nodes_mounts_hide_the_heads_files_but_keep_the_checkout_and_its_venv_under_tmp(tmp_path):
    """The second node's mount namespace, around a small stand-in for the venv's ``ray`` in a
    checkout under ``tmp_path`` (``/tmp``, as a checkout there is): it runs, and reaches the
    checkout but not the head's files beside it nor the hidden home cache."""
    from tests.support.multinode import _outside_tmp, kept, private_mounts

    checkout = tmp_path / "checkout"
    (checkout / ".venv" / "bin").mkdir(parents=True)
    (checkout / "code.py").write_text("code")
    rows = tmp_path / "data" / "rows.parquet"  # the head's data
    rows.parent.mkdir()
    rows.write_text("rows")
    cache = tmp_path / "home" / ".cache"
    cache.mkdir(parents=True)
    (cache / "staged").write_text("staged")
    probes = [checkout / "code.py", rows, cache / "staged", "/tmp/ray-token"]
    ray = checkout / ".venv" / "bin" / "ray"
    ray.write_text("#!/bin/sh\n" + "".join(f'[ -e "{p}" ] && echo "sees {p}" || echo "not {p}"\n' for p in probes))
    ray.chmod(0o755)
    hidden = sorted({str(cache), *_outside_tmp(tempfile.gettempdir())})
    keep = kept([checkout, checkout / ".venv", "/usr"], hidden)
    assert keep == [str(checkout.resolve())]  # the outermost of what /tmp or a hidden directory covers
    env = {**os.environ, "RTL_TOKEN": "token"}
    out = subprocess.run([*private_mounts(keep, hidden), str(ray)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    said = ["sees", "not", "not", "sees"]
    assert out.stdout.splitlines() == [f"{w} {p}" for w, p in zip(said, probes, strict=True)], out.stdout
