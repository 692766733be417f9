#!/usr/bin/env python
"""Median step time of the engine against a hand-written loop doing the same math.

Same model (a CPU MLP), same in-memory data, same work per update: autocast forward, backward
with the loss divided by K, global-norm clipping, AdamW, and a non-finite check of the loss (the
DINO seed's ``math.isfinite(loss.item())``). Blocks of steps alternate between the two so machine
noise hits both. Prints the median step time of each and the ratio engine/bare.

    .venv/bin/python scripts/bench_step.py [--steps 30] [--repeats 7]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from raytrain_loops.config import load_config
from raytrain_loops.engine import Engine, LossOutput
from raytrain_loops.engine.update.precision import DTYPES, hardware, resolve


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))


def criterion(model, batch, ctx):
    x, y = batch
    return LossOutput(F.cross_entropy(model(x), y), sample_size=len(y))


class Bare:
    """What one would write by hand for the same update."""

    def __init__(self, precision: str):
        self.model = mlp()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.0)
        self.dtype = DTYPES.get(precision)

    def step(self, micro):
        self.opt.zero_grad(set_to_none=True)
        for x, y in micro:
            if self.dtype is None:
                loss = F.cross_entropy(self.model(x), y)
            else:
                with torch.autocast("cpu", dtype=self.dtype):
                    loss = F.cross_entropy(self.model(x), y)
            (loss / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if not math.isfinite(loss.item()):
            raise FloatingPointError("non-finite loss")
        self.opt.step()


class EngineRunner:
    def __init__(self, precision: str, k: int):
        cfg = load_config(
            None,
            [
                f"precision.dtype={precision}",
                f"accum.steps={k}",
                "clip.mode=global",
                "optim.param_groups=single",
                "schedules.lr.value=1e-3",
            ],
        )
        self.engine = Engine(mlp(), criterion, cfg.engine, total_steps=10**6)

    def step(self, micro):
        self.engine.train_step(micro)


def timed(runner, batches, k: int, steps: int) -> list[float]:
    out = []
    for s in range(steps):
        micro = [batches[(s * k + i) % len(batches)] for i in range(k)]
        t = time.perf_counter()
        runner.step(micro)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="steps per block")
    ap.add_argument("--repeats", type=int, default=7, help="alternated blocks per runner")
    ap.add_argument("--batch", type=int, default=128, help="micro-batch size")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(args.batch, 256, generator=g), torch.randint(0, 10, (args.batch,), generator=g)) for _ in range(16)
    ]
    hw = hardware(torch.device("cpu"))
    print(
        f"{hw.name} ({'native' if hw.native_bf16 else 'no native'} bf16: precision.dtype=auto -> "
        f"{resolve('auto', hw)[0]}), torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"MLP 256-1024-1024-10, micro-batch {args.batch}"
    )
    print(f"{'precision':>9} {'K':>2} {'bare ms':>9} {'engine ms':>10} {'engine/bare':>12}")
    ratios = []
    for precision in ("fp32", "bf16"):
        for k in (1, 4):
            bare, eng = Bare(precision), EngineRunner(precision, k)
            timed(bare, batches, k, 5)  # warm-up
            timed(eng, batches, k, 5)
            tb, te = [], []
            for _ in range(args.repeats):
                tb += timed(bare, batches, k, args.steps)
                te += timed(eng, batches, k, args.steps)
            mb, me = statistics.median(tb), statistics.median(te)
            ratios.append(me / mb)
            print(f"{precision:>9} {k:>2} {mb * 1e3:>9.2f} {me * 1e3:>10.2f} {me / mb:>12.3f}")
    print(f"worst ratio {max(ratios):.3f} (target <= 1.03)")


if __name__ == "__main__":
    main()
