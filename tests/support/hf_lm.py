"""The hf_lm task's tests in small: a tiny GPT-2 config, JSONL documents of a small repetitive
language a model learns in a few dozen steps, the ``corpus`` fixture that writes a train and an
eval file of them (module-scoped: written once per test module that uses it), and a local-mode
run config of the task over such text."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

TINY_GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64}
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def write_corpus(path: Path, docs: int, seed: int, sentence: str) -> Path:
    """JSONL documents of a small repetitive language (a model learns it in a few dozen steps)."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for d in range(docs):
            words = [WORDS[(d + i) % len(WORDS)] for i in range(int(rng.integers(5, 40)))]
            f.write(json.dumps({"body": f"{sentence} {d}: " + " ".join(words) + ". é ü"}) + "\n")
    return path


def hf_lm_config(tmp_path: Path, name: str, **params) -> dict:
    """A local-mode run ``name`` of the task with ``params``: 60 steps, evaluations and checkpoints
    every 30, its data and run directories under ``tmp_path``."""
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
        "train": [str(write_corpus(root / "train" / "a.jsonl", 300, 0, "the list"))],
        "eval": [str(write_corpus(root / "eval.jsonl", 40, 1, "the list"))],
    }
