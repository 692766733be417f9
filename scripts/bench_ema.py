#!/usr/bin/env python
"""Time per update of the EMA's two arithmetics on a 100M-parameter model (CPU, fp32).

The engine's :class:`~raytrain_loops.engine.optim.ema.EMA` with ``ema.arithmetic=weighted_sum``
(DINO's and cvnets' ``ema * m + (1 - m) * model``) against ``lerp`` (``torch._foreach_lerp_``),
both over the same model: 8 blocks of a 1024-wide transformer's shapes (attention and MLP weights,
biases, norms), about 100M parameters. Repeats alternate between the two so machine noise hits
both. Prints each one's median time per update and the ratio weighted_sum/lerp.

    .venv/bin/python scripts/bench_ema.py [--repeats 3] [--updates 3] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from raytrain_loops.engine.optim.ema import EMA


def model(blocks: int = 8, width: int = 1024) -> nn.Module:
    layers = []
    for _ in range(blocks):
        layers += [nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(width, width)]
        layers += [nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)]
    return nn.Sequential(*layers)


def per_update(ema: EMA, updates: int) -> float:
    start = time.perf_counter()
    for _ in range(updates):
        ema.update(0.996)
    return (time.perf_counter() - start) / updates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="alternated blocks per arithmetic (the median is taken)")
    ap.add_argument("--updates", type=int, default=3, help="EMA updates per block")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    net = model()
    n = sum(p.numel() for p in net.parameters())
    emas = {a: EMA(net, "copy", arithmetic=a) for a in ("lerp", "weighted_sum")}
    for ema in emas.values():
        ema.update(0.996)  # warm-up: first touch of every page
    times: dict[str, list[float]] = {a: [] for a in emas}
    for _ in range(args.repeats):
        for a, ema in emas.items():
            times[a].append(per_update(ema, args.updates))
    median = {a: statistics.median(t) for a, t in times.items()}
    print(f"{n / 1e6:.1f}M parameters, fp32, {torch.get_num_threads()} threads, median of {args.repeats} x {args.updates}")
    for a, t in median.items():
        print(f"  {a:13s} {t * 1e3:8.1f} ms per update   (blocks: {', '.join(f'{x * 1e3:.1f}' for x in times[a])})")
    print(f"  weighted_sum / lerp: {median['weighted_sum'] / median['lerp']:.2f}")


if __name__ == "__main__":
    main()
