"""hf_lm at its edges, in process: weights in pytorch_model.bin read as weights only (code in them
refused), training bits per byte over the update's bytes, rows cut between characters, JSONL and
Parquet text that is malformed or empty, a vocabulary too large refused before anything is built,
no process-wide hub setting changed, the prefetch thread ended with its epoch, and batches cut into
micro-batches (``accum.micro_batch=auto``) that make the update of the whole."""

from __future__ import annotations

import copy
import gc
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raytrain_loops import fit
from raytrain_loops.config import ConfigError
from tests.support import fakes
from tests.support.hf_lm import TINY_GPT2, corpus, hf_lm_config  # noqa: F401  (the module's text fixture)

ROOT = Path(__file__).resolve().parents[2]


def _task(corpus: dict, data_dir: Path, **params):  # noqa: F811
    from raytrain_loops.tasks.hf_lm import HFLMTask

    params = {"model": TINY_GPT2, "tokenizer": {"train": {"vocab_size": 400}}, "max_len": 32, **params}
    task = HFLMTask(text=corpus, text_key="body", **params)
    task.prepare(data_dir)
    return task


def _saved(task, out: Path, safe: bool) -> dict[str, torch.Tensor]:
    """``task``'s model saved to ``out`` with its tokenizer: by transformers (safetensors), or as
    an older directory holds it (``config.json`` and ``torch.save``'s ``pytorch_model.bin``, the
    tied embeddings sharing their storage); the saved weights."""
    torch.manual_seed(7)
    model = task.build_model()
    if safe:
        model.save_pretrained(str(out))
    else:
        model.config.save_pretrained(str(out))
        torch.save(model.state_dict(), out / "pytorch_model.bin")
    task._tokenizer().save_pretrained(str(out))
    return model.state_dict()


# ---------------------------------------------------------------------------- pytorch_model.bin


def test_pytorch_model_bin_weights_are_loaded_as_weights_only_and_anything_else_is_refused(tmp_path, corpus):  # noqa: F811
    from raytrain_loops.tasks.hf_lm import HFLMTask

    model_dir = tmp_path / "bin"
    saved = _saved(_task(corpus, tmp_path / "scratch"), model_dir, safe=False)
    assert (model_dir / "pytorch_model.bin").exists() and not list(model_dir.glob("*.safetensors"))
    task = HFLMTask(model=str(model_dir), text=corpus, text_key="body", max_len=32)
    task.prepare(tmp_path / "data")
    built = task.build_model().state_dict()
    assert built.keys() == saved.keys() and all(torch.equal(built[k], saved[k]) for k in saved)
    # The weights travel as safetensors: the workers' copy never unpickles anything.
    assert set(task._weights) == {"model.safetensors"}

    # Shards named by pytorch_model.bin.index.json, as transformers wrote large models.
    from raytrain_loops.tasks.hf_text import CONFIG_FILES, model_from, read_files, weight_files

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    keys = list(saved)
    shards = {"pytorch_model-00001-of-00002.bin": keys[::2], "pytorch_model-00002-of-00002.bin": keys[1::2]}
    for name, names in shards.items():
        torch.save({k: saved[k] for k in names}, sharded / name)
    weight_map = {k: name for name, names in shards.items() for k in names}
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    rebuilt = model_from(read_files(str(sharded), CONFIG_FILES), weight_files(str(sharded))).state_dict()
    assert all(torch.equal(rebuilt[k], saved[k]) for k in saved)

    # A new BPE for these trained weights is refused, as for safetensors.
    with pytest.raises(ConfigError, match="task.params.tokenizer: a new tokenizer's ids mean nothing"):
        HFLMTask(model=str(model_dir), tokenizer={"train": {"vocab_size": 400}})

    # A .bin that holds code: refused naming the parameter and the file, the code never run.
    marker = tmp_path / "ran"
    evil = tmp_path / "evil"
    evil.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (evil / name).write_bytes((model_dir / name).read_bytes())
    torch.save({"x": _Runs(str(marker))}, evil / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"task.params.model: .*pytorch_model.bin.* weights_only"):
        HFLMTask(model=str(evil), text=corpus, text_key="body", max_len=32).prepare(tmp_path / "data")
    assert not marker.exists()

    # Weights in a format not read here: refused, never a model trained from random weights.
    other = tmp_path / "other"
    other.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (other / name).write_bytes((model_dir / name).read_bytes())
    (other / "tf_model.h5").write_bytes(b"\x89HDF")
    with pytest.raises(ConfigError, match=r"task.params.model: .*tf_model.h5.*safetensors or pytorch_model.bin"):
        HFLMTask(model=str(other), text=corpus, text_key="body", max_len=32)


class _Runs:
    """An object whose unpickling runs code (a file touched): what weights_only refuses."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


# ---------------------------------------------------------------------------- train_bpb


def test_train_bpb_is_the_updates_nll_over_all_its_bytes_not_a_mean_weighted_by_tokens(tmp_path, corpus):  # noqa: F811
    from raytrain_loops.engine import Engine
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    task = _task(corpus, tmp_path, model={**TINY_GPT2, **no_dropout})
    # Two micro-batches of one update, with unlike bytes per token: plain words, and two-byte letters.
    texts = [["the list 1: alpha beta gamma delta epsilon zeta eta theta"] * 2, ["é ü é ü é ü é ü é ü é ü é ü"] * 3]
    batches = [task.collate(task.preprocess({"text": np.array(t, dtype=object)}, train=True)) for t in texts]
    assert len({round(sum(b[3]) / sum(b[2]), 2) for b in batches}) == 2, [(b[2], b[3]) for b in batches]
    model = task.build_model()
    before = copy.deepcopy(model)
    nll, nbytes = 0.0, 0
    with torch.no_grad():
        for inputs, targets, _, covered in batches:
            logits = before(input_ids=inputs).logits
            nll += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
            nbytes += sum(covered)
    engine = Engine(model, task.criterion, fakes.config("loss.reduction=sum").engine, total_steps=1)
    engine.train_step(batches)
    assert engine.reduce_metrics()["bpb"] == pytest.approx(nll / (nbytes * math.log(2)), rel=1e-5)


# ---------------------------------------------------------------------------- packing


def test_packing_cuts_rows_between_characters_never_inside_one(tmp_path):
    """Four-byte characters that a small byte-level BPE splits into several tokens: every
    character lands in exactly one row, and no row tokenizes to more than max_len + 1 tokens."""
    from raytrain_loops.tasks.hf_text import EOS, read_documents

    rng = np.random.default_rng(0)
    letters = [chr(c) for c in range(0x1D400, 0x1D6A0)] + [chr(c) for c in range(0x1F600, 0x1F650)] + ["a", " "]
    path = tmp_path / "text.jsonl"
    with path.open("w") as f:
        for _ in range(60):
            f.write(json.dumps({"body": "".join(rng.choice(letters, size=int(rng.integers(10, 60))))}) + "\n")
    text = {"train": [str(path)], "eval": [str(path)]}
    task = _task(text, tmp_path / "data", tokenizer={"train": {"vocab_size": 300}}, max_len=7)
    tok = task._tokenizer()
    rows = pq.read_table(task.splits(tmp_path / "data")["train"].path).column("text").to_pylist()
    docs = read_documents(text["train"], "body", "train")
    assert "".join(rows).split(EOS)[:-1] == docs  # nothing duplicated, nothing lost
    lengths = [len(tok(r, add_special_tokens=False)["input_ids"]) for r in rows]
    assert max(lengths) <= 8 and np.mean(lengths) > 6, lengths


# ---------------------------------------------------------------------------- JSONL and Parquet text


@pytest.mark.parametrize(
    "line,error",
    [
        ('{"text": 12}', r"line 2: 'text' is int, not a string"),
        ('{"text": ["a"]}', r"line 2: 'text' is list, not a string"),
        ('"some text"', r"line 2: not a JSON object \(a str\)"),
        ('"hello"', r"line 2: not a JSON object \(a str\)"),
        ("5", r"line 2: not a JSON object \(a int\)"),
        ("null", r"line 2: not a JSON object \(a NoneType\)"),
        ('{"text": "a"', r"line 2: not valid JSON"),
        ('{"other": "a"}', r"line 2 has no key 'text'"),
    ],
)
def test_a_malformed_jsonl_line_is_an_error_naming_the_file_and_line(tmp_path, line, error):
    from raytrain_loops.tasks.hf_text import read_documents

    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    key = "task.params.text_key" if "no key" in error else "task.params.text.train"
    with pytest.raises(ConfigError, match=rf"{key}: '{path}' {error}"):
        read_documents([str(path)], "text", "task.params.text.train")


def test_jsonl_and_parquet_skip_the_same_empty_documents_and_name_a_column_that_is_not_text(tmp_path):
    from raytrain_loops.tasks.hf_text import read_documents

    values = ["one", None, "", "two", " "]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": v}) + "\n" for v in values) + "\n")
    pq.write_table(pa.table({"text": values}), tmp_path / "b.parquet")
    jsonl = read_documents([str(tmp_path / "a.jsonl")], "text", "task.params.text.train")
    parquet = read_documents([str(tmp_path / "b.parquet")], "text", "task.params.text.train")
    assert jsonl == parquet == ["one", "two", " "]
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "c.parquet")
    with pytest.raises(ConfigError, match=r"task.params.text.train: '.*c.parquet' column 'text' is int64, not text"):
        read_documents([str(tmp_path / "c.parquet")], "text", "task.params.text.train")
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "\xff"}\n')
    with pytest.raises(ConfigError, match=r"task.params.text.train: '.*d.jsonl' is not UTF-8"):
        read_documents([str(tmp_path / "d.jsonl")], "text", "task.params.text.train")


# ---------------------------------------------------------------------------- vocabulary, before anything


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_before_a_bpe_is_trained_or_a_run_starts(
    tmp_path,
    corpus,  # noqa: F811
):
    from raytrain_loops.tasks.hf_lm import HFLMTask

    small = tmp_path / "small"  # a model directory with a config only (trained from scratch)
    small.mkdir()
    (small / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 350, "n_embd": 32}))
    with pytest.raises(ConfigError, match=r"task.params.tokenizer: has 400 tokens, more than the 350 of the model"):
        HFLMTask(model=str(small), tokenizer={"train": {"vocab_size": 400}}, text=corpus, text_key="body")
    tokenizer_dir = tmp_path / "tok"
    _task(corpus, tmp_path / "scratch")._tokenizer().save_pretrained(str(tokenizer_dir))
    with pytest.raises(ConfigError, match=r"task.params.tokenizer: has 400 tokens, more than the 350 of the model"):
        HFLMTask(model=str(small), tokenizer=str(tokenizer_dir), text=corpus, text_key="body")
    config = hf_lm_config(tmp_path, "small", model=str(small), tokenizer={"train": {"vocab_size": 400}}, text=corpus)
    with pytest.raises(ConfigError, match="task.params.tokenizer: has 400 tokens"):
        fit(config)
    assert not (tmp_path / "runs").exists() and not list((tmp_path / "data").glob("hf_lm/bpe-*"))
    # A BPE that fits is allowed with the same model directory.
    HFLMTask(model=str(small), tokenizer={"train": {"vocab_size": 350}}, text=corpus, text_key="body")


# ---------------------------------------------------------------------------- process-wide effects


def test_building_the_task_leaves_the_hub_settings_of_the_process_as_they_were(tmp_path, corpus):  # noqa: F811
    code = (
        "import json, os, sys\n"
        "from pathlib import Path\n"
        "from raytrain_loops.tasks.hf_lm import HFLMTask\n"
        "task = HFLMTask(model=json.loads(sys.argv[1]), tokenizer={'train': {'vocab_size': 400}},\n"
        "                text=json.loads(sys.argv[2]), text_key='body', max_len=32)\n"
        "task.prepare(Path(sys.argv[3]))\n"
        "import huggingface_hub.constants as c\n"
        "print(json.dumps([c.HF_HUB_OFFLINE, os.environ.get('HF_HUB_OFFLINE'), os.environ.get('TRANSFORMERS_OFFLINE')]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(TINY_GPT2), json.dumps(corpus), str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [False, None, None]


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "parquet-prefetch" and t.is_alive()]


def test_the_prefetch_thread_ends_with_its_epoch_when_a_step_fails_while_the_traceback_is_held(tmp_path, corpus):  # noqa: F811
    config = hf_lm_config(tmp_path, "failing", model=TINY_GPT2, text=corpus)
    config["fault"] = {"plan": [{"step": 12, "kind": "raise"}]}
    config["data"]["preprocess"] = {"batch_rows": 8}  # many parts an epoch: the thread waits on a full queue
    assert not _prefetch_threads()
    gc.disable()  # only an explicit close ends the thread, not the collector
    try:
        with pytest.raises(RuntimeError, match=r"fault\.plan\[0\] after step 12") as failed:
            fit(config)
        for t in _prefetch_threads():
            t.join(5)
        assert failed.value.__traceback__ is not None and not _prefetch_threads()
    finally:
        gc.enable()


def test_auto_micro_batching_after_an_oom_gives_the_weights_of_a_run_at_the_smaller_micro_batch(tmp_path, corpus):  # noqa: F811
    """accum.micro_batch=auto on hf_lm (in local mode): an out-of-memory error in the first update
    halves its 8-row batches, each half counting its own target tokens and bytes, and the run
    ends with the weights of a run of 4-row micro-batches, two per update, from the start (the
    same rows in each update; GPT-2's dropout draws the same masks)."""
    from raytrain_loops.checkpoint import files as ckpt

    def run(name: str, **sections) -> tuple:
        config = hf_lm_config(tmp_path, name, text=corpus, model=TINY_GPT2)
        config.update(loop={"max_steps": 3, "seed": 0}, checkpoint={"every_steps": 3}, eval={"every_steps": 3})
        config["data"] = {**config["data"], "batch_size": sections.pop("batch_size", 8)}
        result = fit({**config, **sections})
        return result, ckpt.read_file(result.checkpoint, ckpt.STATE)

    oom = [{"step": 1, "kind": "oom", "micro_batch": 4}]
    auto, halved = run("auto", accum={"micro_batch": "auto"}, fault={"plan": oom})
    smaller, reference = run("smaller", batch_size=4, accum={"steps": 2})
    assert halved["counters"]["micro_batch_splits"] == 2 and auto.metrics["step"] == 3 and auto.metrics["oom"] == 1
    assert auto.metrics["bpb"] == smaller.metrics["bpb"]  # the halves' bytes: the run's bits per byte
    assert halved["model"].keys() == reference["model"].keys()
    for name, weight in halved["model"].items():
        assert torch.equal(weight, reference["model"][name]), name
