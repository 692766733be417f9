"""N steps equal k steps + save + load + (N - k) steps, bit for bit, on CPU."""

from __future__ import annotations

import pytest
import torch

from raytrain_loops.config import load_config
from raytrain_loops.engine import Engine
from tests.support import fakes

N, K = 8, 3
OVERRIDES = [
    "optim.name=adamw",
    "schedules.lr.kind=cosine",
    "schedules.lr.value=0.01",
    "schedules.lr.warmup_steps=2",
    "schedules.weight_decay.value=0.05",
    "ema.enabled=true",
    "schedules.ema_momentum.value=0.9",
    "accum.steps=2",
    "clip.mode=global",
]


def _engine(precision: str, seed: int) -> Engine:
    cfg = load_config(None, OVERRIDES + [f"precision.dtype={precision}", "precision.init_scale=256"])
    return Engine(fakes.make_model(seed=seed, dropout=0.3), fakes.mean_loss, cfg.engine, total_steps=N)


def _run(engine: Engine, steps: range):
    x, y = fakes.regression_data(n=16 * N)
    for s in steps:
        noise = torch.randn(16, x.shape[1]) * 0.01  # data augmentation drawn from the global RNG
        xs = x[s * 16 : (s + 1) * 16] + noise
        engine.train_step(fakes.split(xs, y[s * 16 : (s + 1) * 16], [8, 8]))


def _flat(state, prefix=""):
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        return {k2: v2 for k, v in state.items() for k2, v2 in _flat(v, f"{prefix}.{k}").items()}
    if isinstance(state, (list, tuple)):
        return {k2: v2 for i, v in enumerate(state) for k2, v2 in _flat(v, f"{prefix}[{i}]").items()}
    return {prefix: state}


def _resumed(tmp_path, precision: str, keep_rng: bool):
    torch.manual_seed(0)
    first = _engine(precision, seed=0)
    _run(first, range(K))
    path = tmp_path / "state.pt"
    torch.save(first.state_dict(), path)
    torch.manual_seed(12345)  # whatever happened to the RNG in between must not matter
    second = _engine(precision, seed=7)  # different initial weights: loading must replace them
    state = torch.load(path, weights_only=True)
    if not keep_rng:
        state["rng"] = second.state_dict()["rng"]
    second.load_state_dict(state)
    _run(second, range(K, N))
    return second


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_resume_is_bit_exact(tmp_path, precision):
    torch.manual_seed(0)
    straight = _engine(precision, seed=0)
    _run(straight, range(N))
    resumed = _resumed(tmp_path, precision, keep_rng=True)
    a, b = _flat(straight.state_dict()), _flat(resumed.state_dict())
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key
    assert resumed.step == N


def test_resume_without_rng_state_diverges(tmp_path):
    # The bit-exact test above depends on the saved RNG: without it dropout and noise differ.
    torch.manual_seed(0)
    straight = _engine("fp32", seed=0)
    _run(straight, range(N))
    resumed = _resumed(tmp_path, "fp32", keep_rng=False)
    assert not torch.equal(straight.module.encoder.weight, resumed.module.encoder.weight)
