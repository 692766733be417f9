#!/usr/bin/env python
"""Sweep wall time against the ideal, in one invocation on one local Ray instance.

The trial time T is measured first, as a sweep of a single trial (the same Tune, Train and data
start-up every trial pays). Then N trials run as one sweep with C at a time; the ideal is
T x N / C, and the script prints the ratio for each C asked for.

    .venv/bin/python scripts/bench_sweep.py [--trials 4] [--concurrency 1 2] [--steps 40]

Target: at most 1.3x (Ray Tune's own release gate is 1.28x for 10,000 short trials).
On a machine with fewer cores than C trials need, trials slow each other down and the
ratio measures the machine as much as the sweep machinery.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()

    from raytrain_loops import tune
    from raytrain_loops.driver.ray_start import start_local_ray
    from raytrain_loops.recipes import resolve

    work = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    per_trial = 2 * 0.5 + 0.25
    start_local_ray(max(os.cpu_count() or 1, int(max(args.concurrency) * per_trial + 1.999)))
    overrides = [f"loop.max_steps={args.steps}", "schedules.lr.warmup_steps=0", f"data.dir={work / 'data'}"]

    def sweep(name: str, values: list[float], concurrency: int) -> float:
        spec = {
            "name": name,
            "storage_path": str(work / "sweeps"),
            "space": {"schedules.lr.value": {"grid": values}},
            "num_samples": 1,
            "max_concurrent_trials": concurrency,
            "trial": {"num_workers": 2, "cpus_per_worker": 0.5},
        }
        start = time.perf_counter()
        tune(resolve("default"), spec, overrides=overrides)
        return time.perf_counter() - start

    sweep("warm-up", [1e-3], 1)  # data written, imports and Ray's first actors paid once
    lrs = [1e-3 * (i + 1) for i in range(args.trials)]
    trial = sweep("one-trial", lrs[:1], 1)
    rows = []
    for c in args.concurrency:
        wall = sweep(f"c{c}", lrs, c)
        ideal = trial * args.trials / c
        rows.append((c, wall, ideal))
    print(f"\ntrial time (a one-trial sweep): {trial:.1f} s; {args.trials} trials of {args.steps} steps")
    for c, wall, ideal in rows:
        print(f"concurrency {c}: sweep {wall:.1f} s, ideal {ideal:.1f} s, ratio {wall / ideal:.2f}")


if __name__ == "__main__":
    main()
