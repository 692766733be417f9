"""The hf_lm task: a transformers causal LM with a BPE trained on the driver, text packed once and
tokenized in ``Task.preprocess``, trained in local mode (the loop is the same on Ray), exported as
a directory transformers loads, and fine-tuned from it. Tiny configs; the recipe's figures are in
docs/hf.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from raytrain_loops import fit
from raytrain_loops.config import ConfigError
from raytrain_loops.data.parquet import ROW_SEED
from tests.support import hf_lm
from tests.support.hf_lm import TINY_GPT2, hf_lm_config, write_corpus
from tests.support.recording import restored
from tests.support.runfiles import records
from tests.support.s3 import s3_root, s3_server  # noqa: F401  (a real S3 API: moto's server)

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
corpus = hf_lm.corpus  # the text fixture (module-scoped)


def test_packed_rows_tokenize_to_one_sequence_each_and_count_the_bytes_their_targets_cover(tmp_path, corpus):
    from raytrain_loops.tasks.hf_lm import HFLMTask
    from raytrain_loops.tasks.hf_text import EOS, read_documents

    task = HFLMTask(model=TINY_GPT2, tokenizer={"train": {"vocab_size": 400}}, text=corpus, text_key="body", max_len=32)
    task.prepare(tmp_path)
    tok = task._tokenizer()
    assert len(tok) == 400 and tok.convert_ids_to_tokens(task.eos_id) == EOS
    texts = pq.read_table(task.splits(tmp_path)["train"].path).column("text").to_pylist()
    docs = read_documents(corpus["train"], "body", "train")
    # Every document once, in order, the end token after each; rows are whole sequences of 33 tokens.
    joined = "".join(texts)
    assert joined.split(EOS)[:-1] == docs
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert max(lengths) <= 33 and np.mean(lengths[:-1]) > 32.5, lengths[:20]
    # preprocess: one row per row, ids padded with the end token, n the real ones, and the bytes of
    # text the targets cover (all of the row's text but its first token's and the end tokens').
    rows = {"text": np.array(texts, dtype=object), ROW_SEED: np.zeros(len(texts))}
    out = task.preprocess(rows, train=True)
    assert out["ids"].shape == (len(texts), 33) and list(out["n"]) == lengths
    first = [len(tok.decode(tok(t, add_special_tokens=False)["input_ids"][:1]).encode()) for t in texts]
    text_bytes = [len(t.replace(EOS, "").encode()) for t in texts]
    starts_with_eos = [t.startswith(EOS) for t in texts]
    expected = [b - (0 if e else f) for b, f, e in zip(text_bytes, first, starts_with_eos, strict=True)]
    assert list(out["bytes"]) == expected
    part = {k: v[-3:] for k, v in out.items()}
    inputs, targets, ntokens, covered = task.collate(part)  # the counts per row
    assert ntokens == [n - 1 for n in lengths[-3:]] == (targets != -100).sum(1).tolist()
    assert covered == expected[-3:]
    real = targets[:, :-1] != -100
    assert torch.equal(inputs[:, 1:][real], targets[:, :-1][real])  # the targets are the inputs shifted by one


@pytest.mark.parametrize("config,block", [(TINY_GPT2, "GPT2Block"), (TINY_LLAMA, "LlamaDecoderLayer")])
def test_the_transformer_layers_are_the_blocks_found_from_the_model(config, block):
    from raytrain_loops.tasks.hf_lm import HFLMTask

    task = HFLMTask(model=config, tokenizer={"train": {"vocab_size": 400}})
    task.vocab_size, task.eos_id = 400, 0
    model = task.build_model()
    blocks = task.blocks(model)
    layers = config.get("n_layer", config.get("num_hidden_layers"))
    assert [type(b).__name__ for b in blocks] == [block] * layers
    assert model.config.vocab_size == 448  # the tokenizer's 400, rounded up to 64


def test_an_hf_lm_trains_locally_exports_a_model_transformers_loads_and_fine_tunes_from_it(tmp_path, corpus):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = fit(hf_lm_config(tmp_path, "scratch", model=TINY_GPT2, text=corpus))
    evals = records(Path(result.run_dir) / "eval.jsonl")
    assert [e["step"] for e in evals] == [30, 60]
    metrics = records(Path(result.run_dir) / "metrics.jsonl")
    assert metrics[-1]["loss"] < 0.5 * metrics[0]["loss"], [m["loss"] for m in metrics]
    assert evals[-1]["eval_bpb"] < evals[0]["eval_bpb"] and 0 < evals[-1]["eval_bpb"] < 4, evals

    out = tmp_path / "exported"
    cli = subprocess.run(
        [sys.executable, "-m", "raytrain_loops.cli", "export", result.checkpoint, str(out), "--format", "hf"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert cli.returncode == 0, cli.stderr
    assert "wrote" in cli.stdout and (out / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    from raytrain_loops.checkpoint import files as ckpt
    from raytrain_loops.tasks.hf_lm import HFLMTask

    ours = HFLMTask(model=TINY_GPT2, text=corpus, text_key="body", max_len=32)
    ours.prepare(Path(tmp_path / "data"))
    mine = ours.build_model().eval()
    mine.load_state_dict(ckpt.read_file(result.checkpoint, ckpt.STATE)["model"])
    ids = torch.tensor([tokenizer("the list 3: alpha beta gamma")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, mine(input_ids=ids).logits)

    # Fine-tuning from the exported directory, on other text, with examples/finetune_hf.yaml (at a
    # reduced size): its first steps start where the exported model ended, far below a fresh
    # model's loss.
    other = write_corpus(tmp_path / "other.jsonl", 200, 5, "the list")
    example = [f"task.params.model={out}", f"task.params.tokenizer={out}", f"task.params.text={{train: [{other}]}}"]
    example += ["task.params.text_key=body", "task.params.max_len=32", "data.batch_size=8", "loop.max_steps=10"]
    example += [f"data.dir={tmp_path / 'data'}", f"run.storage_path={tmp_path / 'runs'}", "run.name=tuned"]
    tuned = fit(ROOT / "examples" / "finetune_hf.yaml", overrides=[*example, "scaling.num_workers=0", "run.progress=false"])
    assert tuned.metrics["step"] == 10 and "eval_bpb" in tuned.metrics
    first = records(Path(tuned.run_dir) / "metrics.jsonl")[0]
    assert first["loss"] < 0.6 * metrics[0]["loss"], (first["loss"], metrics[0]["loss"])


def test_bad_params_and_a_missing_extra_are_named_before_anything_runs(monkeypatch, tmp_path):
    from raytrain_loops.tasks.hf_lm import HFLMTask

    with pytest.raises(ConfigError, match="task.params.model: an inline config needs model_type"):
        HFLMTask(model={"n_layer": 2})
    with pytest.raises(ConfigError, match="task.params.model: .* has no config.json"):
        HFLMTask(model=str(tmp_path))
    with pytest.raises(ConfigError, match="task.params.tokenizer: train needs vocab_size"):
        HFLMTask(tokenizer={"train": {}})
    with pytest.raises(ConfigError, match=r"task.params.text: takes train and eval .*; got \['eval'\]"):
        HFLMTask(text={"eval": ["x"]})
    with pytest.raises(ConfigError, match="task.params.text_key: .*a.jsonl' line 1 has no key 'nope'"):
        HFLMTask(text={"train": [str(write_corpus(tmp_path / "a.jsonl", 3, 0, "x"))]}, text_key="nope").prepare(tmp_path)
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "config.json").write_text("{}")
    (trained / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="task.params.tokenizer: a new tokenizer's ids mean nothing"):
        HFLMTask(model=str(trained), tokenizer={"train": {"vocab_size": 400}})
    monkeypatch.setitem(sys.modules, "transformers", None)  # as without the extra
    with pytest.raises(ConfigError, match=r"task.name: hf_lm needs transformers: .*raytrain-loops\[hf\]"):
        HFLMTask()


def test_the_base_install_does_not_import_transformers():
    code = (
        "import sys, raytrain_loops, raytrain_loops.cli, raytrain_loops.tasks, raytrain_loops.runtime.local; "
        "print(sorted(m for m in ('transformers', 'tokenizers', 'safetensors') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def _hf_updates(rank: int, world: int, configs: list[dict]) -> dict:
    """Each config's model after 3 updates under DDP and under FSDP2 with its found blocks sharded
    one by one and checkpointed (activation checkpointing), on this worker's own token batches."""
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raytrain_loops.engine import Engine
    from raytrain_loops.engine.distributed.sharding import prepare_model, shard
    from raytrain_loops.tasks.hf_lm import HFLMTask
    from tests.support import fakes

    engine_config = fakes.config("optim.name=adamw", "schedules.lr.value=0.01", "loss.reduction=sum").engine
    out = {}
    for config in configs:
        task = HFLMTask(model=config, tokenizer={"train": {"vocab_size": 400}})
        task.vocab_size, task.eos_id = 400, 0
        results = {}
        for strategy in ("ddp", "fsdp"):
            torch.manual_seed(0)
            model = task.build_model()
            if strategy == "ddp":
                model = DDP(model)
            else:
                blocks = task.blocks(model)
                prepare_model(model, blocks, checkpointing="full")
                shard(model, blocks, torch.device("cpu"), "fp32")
            engine = Engine(model, task.criterion, engine_config, total_steps=3)
            for step in range(3):
                g = torch.Generator().manual_seed(100 * step + rank)
                ids = torch.randint(1, 400, (4, 17), generator=g).numpy()
                batch = task.collate({"ids": ids, "n": np.full(4, 17 - rank), "bytes": np.full(4, 40)})
                assert engine.train_step([batch]).applied
            state = engine.module.state_dict()
            results[strategy] = {
                k.removeprefix("module."): (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                for k, v in state.items()
            }
        out[config["model_type"]] = results
    return out


def test_gpt2_and_llama_configs_train_alike_under_fsdp2_on_their_found_blocks_and_under_ddp():
    from tests.support.gloo import run_gloo

    outcomes = run_gloo(2, _hf_updates, [TINY_GPT2, TINY_LLAMA])
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message + outcomes[1].message
    for name in ("gpt2", "llama"):
        ddp, fsdp = outcomes[0].value[name]["ddp"], outcomes[1].value[name]["fsdp"]
        assert ddp.keys() == fsdp.keys() and len(ddp) > 10, name
        for key in ddp:
            torch.testing.assert_close(fsdp[key], ddp[key], atol=2e-5, rtol=1e-4, msg=f"{name} {key}")


def test_the_found_blocks_compile_regionally_with_the_same_names_loss_and_gradients():
    from torch._dynamo.utils import counters

    from raytrain_loops.config.engine import CompileConfig
    from raytrain_loops.engine.distributed.sharding import prepare_model
    from raytrain_loops.tasks.hf_lm import HFLMTask

    no_dropout = {**TINY_GPT2, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # no random draws to differ
    task = HFLMTask(model=no_dropout, tokenizer={"train": {"vocab_size": 400}})
    task.vocab_size, task.eos_id = 400, 0
    ids = torch.randint(1, 400, (2, 17), generator=torch.Generator().manual_seed(0)).numpy()
    batch = task.collate({"ids": ids, "n": np.array([17, 12]), "bytes": np.array([40, 30])})
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = task.build_model()
        names = list(model.state_dict())
        counters.clear()
        if compiled:
            prepare_model(model, task.blocks(model), compile_cfg=CompileConfig(enabled=True))
        out = task.criterion(model, batch, None)
        out.loss.backward()
        assert list(model.state_dict()) == names
        results.append((out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert counters["stats"]["unique_graphs"] >= 1, "the blocks were not compiled"
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_an_interrupted_hf_lm_run_resumes_to_the_uninterrupted_runs_weights(tmp_path, corpus):
    from raytrain_loops.checkpoint import files as ckpt

    whole = fit(hf_lm_config(tmp_path, "whole", model=TINY_LLAMA, text=corpus))
    cut = hf_lm_config(tmp_path, "cut", model=TINY_LLAMA, text=corpus)
    # A fault fires before its step's report: after step 31, the checkpoint at 30 (mid-epoch) is the last.
    cut["fault"] = {"plan": [{"step": 31, "kind": "raise"}]}
    with pytest.raises(RuntimeError, match=r"fault\.plan\[0\] after step 31"):
        fit(cut)
    resumed = fit(cut)
    assert Path(restored(resumed.run_dir)["checkpoint"]).name == "checkpoint_00000030"
    assert resumed.metrics["step"] == whole.metrics["step"] == 60
    a, b = (ckpt.read_file(r.checkpoint, ckpt.STATE)["model"] for r in (whole, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _model_dir(tmp_path: Path, corpus: dict) -> Path:
    """A model directory as a user has one: a tiny GPT-2's safetensors weights, its config and
    its tokenizer (the BPE of ``corpus``), written by transformers' save_pretrained."""
    from raytrain_loops.tasks.hf_lm import HFLMTask

    task = HFLMTask(model=TINY_GPT2, tokenizer={"train": {"vocab_size": 400}}, text=corpus, text_key="body", max_len=32)
    task.prepare(tmp_path / "scratch")
    out = tmp_path / "model"
    torch.manual_seed(3)
    task.build_model().save_pretrained(str(out), safe_serialization=True)
    task._tokenizer().save_pretrained(str(out))
    return out


def test_the_task_shipped_to_preprocessing_carries_the_tokenizer_by_content_and_no_weights_nor_driver_path(
    tmp_path, corpus
):
    """What the driver ships to every preprocessing task (Task.preprocessing_copy, as worker/preprocessing.py
    passes it) holds the tokenizer's files and works on a node that has none of the driver's
    directories; the training workers' copy holds the weights and builds the model without them."""
    import pickle

    from raytrain_loops.tasks import hf_text
    from raytrain_loops.tasks.hf_lm import HFLMTask

    model_dir = _model_dir(tmp_path, corpus)
    data_dir = tmp_path / "data"
    task = HFLMTask(model=str(model_dir), text=corpus, text_key="body", max_len=32)
    task.prepare(data_dir)
    rows = {"text": np.array(pq.read_table(task.splits(data_dir)["train"].path).column("text").to_pylist()[:20])}
    expected, weights = task.preprocess(rows, train=True), task.build_model().state_dict()
    shipped, trained = pickle.dumps(task.preprocessing_copy()), pickle.dumps(task)
    tokenizer_bytes = sum(len(b) for b in task.tokenizer_files.values())
    weight_bytes = (model_dir / "model.safetensors").stat().st_size
    assert len(shipped) < tokenizer_bytes + 4096 < weight_bytes < len(trained), (len(shipped), len(trained))
    for path in (str(tmp_path), str(model_dir), str(data_dir), *corpus["train"], *corpus["eval"]):
        assert path.encode() not in shipped, path
    # Another node: none of the driver's directories, no tokenizer loaded in the process yet.
    (tmp_path / "moved").mkdir()
    for d in (model_dir, data_dir, tmp_path / "scratch"):
        d.rename(tmp_path / "moved" / d.name)
    hf_text._TOKENIZERS.clear()
    out = pickle.loads(shipped).preprocess(rows, train=True)
    assert out.keys() == expected.keys() and all(np.array_equal(out[k], expected[k]) for k in out)
    rebuilt = pickle.loads(trained).build_model().state_dict()
    assert rebuilt.keys() == weights.keys() and all(torch.equal(rebuilt[k], weights[k]) for k in weights)
    # A directory that is not there is named by its parameter, before anything runs.
    with pytest.raises(ConfigError, match=r"task.params.model: '.*model': no such directory"):
        HFLMTask(model=str(model_dir))
    with pytest.raises(ConfigError, match=r"task.params.tokenizer: '.*model': no such directory"):
        HFLMTask(model=TINY_GPT2, tokenizer=str(model_dir))


class _Pinned:
    """A task that pins ``files`` and a data digest (only what the run directory reads of it)."""

    def __init__(self, files: dict[str, bytes], data: str | None):
        self.files, self.data = files, data

    def artefacts(self) -> dict[str, bytes]:
        return self.files

    def data_digest(self) -> str | None:
        return self.data


def test_artefacts_are_pinned_in_a_run_directory_on_a_bucket_and_a_changed_one_is_refused_once_trained(
    s3_root,  # noqa: F811  (the fixture imported above)
):
    from raytrain_loops import storage
    from raytrain_loops.checkpoint.files import CheckpointError
    from raytrain_loops.driver.run_checks import pin_artefacts, read_pinned

    run = storage.join(s3_root, "run")
    first = {"tokenizer/tokenizer.json": b"A", "model/config.json": b"{}"}
    assert pin_artefacts(run, _Pinned(first, "rows-1"), allowed=False) == {}
    assert read_pinned(run, "tokenizer/") == {"tokenizer.json": b"A"} and read_pinned(run, "model/") == {
        "config.json": b"{}"
    }
    # Nothing trained yet: a new tokenizer is pinned in place of the old one, without a word.
    second = {**first, "tokenizer/tokenizer.json": b"B"}
    assert pin_artefacts(run, _Pinned(second, "rows-1"), allowed=False) == {}
    assert read_pinned(run, "tokenizer/") == {"tokenizer.json": b"B"}
    storage.write_text(storage.join(run, "checkpoint_00000030", "manifest.rank0.json"), "{}")
    assert pin_artefacts(run, _Pinned(second, "rows-1"), allowed=False) == {}  # the same: a plain resume
    third = {"tokenizer/tokenizer.json": b"C"}  # another tokenizer, no model config, other rows
    with pytest.raises(ConfigError, match=r"^task: .*Changed: artefacts.model/config.json .*artefacts.tokenizer/"):
        pin_artefacts(run, _Pinned(third, "rows-2"), allowed=False)
    with pytest.raises(ConfigError, match=r"artefacts.data \('rows-1' -> 'rows-2'\).*run.allow_config_change=true"):
        pin_artefacts(run, _Pinned(second, "rows-2"), allowed=False)
    assert read_pinned(run, "tokenizer/") == {"tokenizer.json": b"B"}  # a refused resume changes nothing
    changes = pin_artefacts(run, _Pinned(third, "rows-2"), allowed=True)
    assert sorted(changes) == ["artefacts.data", "artefacts.model/config.json", "artefacts.tokenizer/tokenizer.json"]
    assert changes["artefacts.model/config.json"][1] == "<absent>"
    assert read_pinned(run, "tokenizer/") == {"tokenizer.json": b"C"} and read_pinned(run, "model/") == {}
    assert not storage.exists(storage.join(run, "artefacts", "model", "config.json"))
    storage.write_bytes(storage.join(run, "artefacts", "tokenizer", "tokenizer.json"), b"D")
    with pytest.raises(CheckpointError, match="artefacts/tokenizer/tokenizer.json is missing or differs"):
        read_pinned(run, "tokenizer/")


def test_a_resume_with_a_new_tokenizer_or_data_is_refused_unless_allowed_and_a_copied_run_dir_exports(
    tmp_path, corpus
):
    """The BPE and the packed rows are pinned at the run's first start. A touched text file (the
    same BPE made again) resumes; an edited one is refused, naming the tokenizer and the data,
    until run.allow_config_change=true. The run directory, copied elsewhere without the data,
    exports with its own copies, and the module its config.yaml names is never imported."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raytrain_loops.checkpoint import files as ckpt
    from raytrain_loops.tasks.hf_lm import HFLMTask

    text = tmp_path / "text" / "a.jsonl"
    text.parent.mkdir()
    original = Path(corpus["train"][0]).read_bytes()
    text.write_bytes(original)
    mine = {"train": [str(text)], "eval": corpus["eval"]}
    config = hf_lm_config(tmp_path, "pinned", model=TINY_GPT2, text=mine)
    config["fault"] = {"plan": [{"step": 30, "kind": "raise"}, {"step": 40, "kind": "raise"}]}
    with pytest.raises(RuntimeError, match=r"fault\.plan\[0\] after step 30"):
        fit(config)
    run_dir = tmp_path / "runs" / "pinned"
    pinned = json.loads((run_dir / "artefacts.json").read_text())
    (bpe,) = (tmp_path / "data" / "hf_lm").glob("bpe-*")
    assert (run_dir / "artefacts" / "tokenizer" / "tokenizer.json").read_bytes() == (bpe / "tokenizer.json").read_bytes()
    assert (run_dir / "artefacts" / "model" / "config.json").exists() and len(pinned["data"]) == 64

    text.write_bytes(original)  # touched: a new cache key, the same BPE and rows
    with pytest.raises(RuntimeError, match=r"fault\.plan\[1\] after step 40"):
        fit(config)
    assert len(list((tmp_path / "data" / "hf_lm").glob("bpe-*"))) == 2
    assert json.loads((run_dir / "artefacts.json").read_text()) == pinned

    text.write_bytes(original + b'{"body": "the list 999: omega omega omega"}\n')  # edited: another BPE
    with pytest.raises(ConfigError, match=r"Changed: artefacts.tokenizer/tokenizer.json .*artefacts.data "):
        fit(config)
    config["run"]["allow_config_change"] = True
    resumed = fit(config)
    assert resumed.metrics["step"] == 60
    changed = json.loads((run_dir / "config_changes.jsonl").read_text().splitlines()[-1])["changes"]
    assert {"artefacts.data", "artefacts.tokenizer/tokenizer.json"} <= set(changed)
    new_bpe = max((tmp_path / "data" / "hf_lm").glob("bpe-*"), key=lambda p: p.stat().st_mtime_ns)
    assert (run_dir / "artefacts" / "tokenizer" / "tokenizer.json").read_bytes() == (
        new_bpe / "tokenizer.json"
    ).read_bytes() != (bpe / "tokenizer.json").read_bytes()

    # Our model with the final weights, and the tokenizer they were trained with, before the data goes.
    task = HFLMTask(model=TINY_GPT2, text=mine, text_key="body", max_len=32)
    task.prepare(tmp_path / "data")
    ours = task.build_model().eval()
    ours.load_state_dict(ckpt.read_file(resumed.checkpoint, ckpt.STATE)["model"])
    ids = torch.tensor([task._tokenizer()("the list 3: alpha beta omega")["input_ids"]])
    copy = tmp_path / "elsewhere" / "pinned"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(tmp_path / "data")
    settings = yaml.safe_load((copy / "config.yaml").read_text())
    settings["task"]["name"] = "marker_task:Task"  # a module that leaves a file when imported
    (copy / "config.yaml").write_text(yaml.safe_dump(settings))
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "marker_task.py").write_text(
        "from pathlib import Path\nPath(__file__).with_name('imported').touch()\n"
        "from raytrain_loops.tasks.hf_lm import HFLMTask as Task\n"
    )
    out = tmp_path / "exported"
    checkpoint = copy / Path(resumed.checkpoint).name
    cli = subprocess.run(
        [sys.executable, "-m", "raytrain_loops.cli", "export", str(checkpoint), str(out), "--format", "hf"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{modules}"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert cli.returncode == 0, cli.stderr
    assert not (modules / "imported").exists()
    assert (out / "tokenizer.json").read_bytes() == (copy / "artefacts" / "tokenizer" / "tokenizer.json").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tokenizer("the list 3: alpha beta omega")["input_ids"] == ids[0].tolist()
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ours(input_ids=ids).logits)
