"""The hf_lm task: a transformers causal LM with a BPE trained on the driver, text packed once and
tokenized in ``Task.preprocess``, trained in local mode (the loop is the same on Ray), exported as
a directory transformers loads, and fine-tuned from it. Tiny configs; the recipe's figures are in
the README."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from raytrain_loops import fit
from raytrain_loops.config import ConfigError
from raytrain_loops.data.parquet import ROW_SEED

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64}
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def _corpus(path: Path, docs: int, seed: int, sentence: str) -> Path:
    """JSONL documents of a small repetitive language (a model learns it in a few dozen steps)."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for d in range(docs):
            words = [WORDS[(d + i) % len(WORDS)] for i in range(int(rng.integers(5, 40)))]
            f.write(json.dumps({"body": f"{sentence} {d}: " + " ".join(words) + ". é ü"}) + "\n")
    return path


def _config(tmp_path: Path, name: str, **params) -> dict:
    return {
        "task": {"name": "hf_lm", "params": {"max_len": 32, "text_key": "body", **params}},
        "loop": {"max_steps": 60, "seed": 0},
        "loss": {"reduction": "sum"},
        "data": {"dir": str(tmp_path / "data"), "batch_size": 8, "eval_batch_size": 16},
        "optim": {"name": "adamw"},
        "schedules": {"lr": {"kind": "cosine", "value": 1e-2, "end": 1e-4, "warmup_steps": 5}},
        "eval": {"every_steps": 30},
        "checkpoint": {"every_steps": 30},
        "scaling": {"num_workers": 0},
        "logging": {"every_steps": 10},
        "run": {"name": name, "storage_path": str(tmp_path / "runs"), "progress": False},
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("text")
    return {
        "train": [str(_corpus(root / "train" / "a.jsonl", 300, 0, "the list"))],
        "eval": [str(_corpus(root / "eval.jsonl", 40, 1, "the list"))],
    }


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
    inputs, targets, ntokens, covered = task.collate(part)
    assert ntokens == sum(n - 1 for n in lengths[-3:]) == int((targets != -100).sum())
    assert covered == sum(expected[-3:])
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

    result = fit(_config(tmp_path, "scratch", model=TINY_GPT2, text=corpus))
    evals = [json.loads(line) for line in (Path(result.run_dir) / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [30, 60]
    metrics = [json.loads(line) for line in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]
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
    from raytrain_loops.engine import checkpoint as ckpt
    from raytrain_loops.tasks.hf_lm import HFLMTask

    ours = HFLMTask(model=TINY_GPT2, text=corpus, text_key="body", max_len=32)
    ours.prepare(Path(tmp_path / "data"))
    mine = ours.build_model().eval()
    mine.load_state_dict(ckpt.read_file(result.checkpoint, ckpt.STATE)["model"])
    ids = torch.tensor([tokenizer("the list 3: alpha beta gamma")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, mine(input_ids=ids).logits)

    # Fine-tuning from the exported directory, on other text: its first steps start where the
    # exported model ended, far below a fresh model's loss.
    other = {"train": [str(_corpus(tmp_path / "other.jsonl", 200, 5, "the list"))]}
    tuned = fit(_config(tmp_path, "tuned", model=str(out), tokenizer=str(out), text=other))
    first = json.loads((Path(tuned.run_dir) / "metrics.jsonl").read_text().splitlines()[0])
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
        HFLMTask(text={"train": [str(_corpus(tmp_path / "a.jsonl", 3, 0, "x"))]}, text_key="nope").prepare(tmp_path)
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
    from tests import fakes

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
    from tests.gloo import run_gloo

    outcomes = run_gloo(2, _hf_updates, [TINY_GPT2, TINY_LLAMA], timeout=300)
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
    from raytrain_loops.engine import checkpoint as ckpt

    whole = fit(_config(tmp_path, "whole", model=TINY_LLAMA, text=corpus))
    cut = _config(tmp_path, "cut", model=TINY_LLAMA, text=corpus)
    cut["fault"] = {"plan": [{"step": 30, "kind": "raise"}]}  # mid-epoch, just checkpointed
    with pytest.raises(RuntimeError, match=r"fault\.plan\[0\] after step 30"):
        fit(cut)
    resumed = fit(cut)
    assert resumed.metrics["step"] == whole.metrics["step"] == 60
    a, b = (ckpt.read_file(r.checkpoint, ckpt.STATE)["model"] for r in (whole, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
