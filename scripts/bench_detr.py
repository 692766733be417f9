#!/usr/bin/env python
"""The detr recipe's update time by backbone: ``task.params.depth`` 0 (four conv blocks) against
the ResNet-style stack at the given depths and widths, one process, one thread (a recipe worker's
share of a 2-core machine).

Each variant is the recipe's own configuration with its ``depth`` and ``width``: the recipe's
model, criterion (Hungarian matching and all loss terms), AdamW groups, clipping and non-finite
check, on one micro-batch of the recipe's 32 generated images. Blocks of updates alternate between
the variants so machine noise hits each alike. Prints each variant's parameters, median ms per
update and updates/s, and its ratio to depth 0 measured in the same run.

    .venv/bin/python scripts/bench_detr.py [--variants 0:32 1:32 1:24 2:16] [--steps 10] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from raytrain_loops.config import load_config
from raytrain_loops.engine import Engine
from raytrain_loops.recipes import resolve
from raytrain_loops.runtime.wiring import task_engine
from raytrain_loops.tasks import build_task


def variant(spec: str, data_dir: Path, steps: int) -> tuple[str, Engine, list, int]:
    """An engine over the recipe's model at ``depth:width``, and its training batch."""
    depth, width = (int(v) for v in spec.split(":"))
    overrides = [f"task.params.depth={depth}", f"task.params.width={width}", f"loop.max_steps={steps}"]
    cfg = load_config(resolve("detr"), overrides)
    params = {**cfg.task.params, "train_images": 64, "validation_images": 16}
    task = build_task("detr", params)
    task.prepare(data_dir)
    table = pq.read_table(task.splits(data_dir)["train"].path).slice(0, cfg.data.batch_size)
    batch = task.collate({k: table.column(k).to_numpy(zero_copy_only=False) for k in ("image", "labels", "boxes")})
    torch.manual_seed(0)
    model = task.build_model()
    engine = task_engine(task, model, cfg, batches_per_epoch=steps)
    size = sum(p.numel() for p in model.parameters())
    return f"depth {depth}, width {width}", engine, [batch], size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["0:32", "1:32", "1:24", "1:16", "2:16"])
    parser.add_argument("--steps", type=int, default=10, help="updates per timed block")
    parser.add_argument("--repeats", type=int, default=5, help="timed blocks per variant, alternating")
    args = parser.parse_args()
    if not args.variants[0].startswith("0:"):
        parser.error("--variants: the first is the baseline and must be depth 0 ('0:WIDTH')")
    torch.set_num_threads(1)
    total = args.steps * (args.repeats + 1)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [variant(spec, Path(tmp), total) for spec in args.variants]
        times: dict[str, list[float]] = {name: [] for name, *_ in runs}
        for _, engine, micro, _ in runs:  # warm-up block, not timed
            for _ in range(args.steps):
                engine.train_step(micro)
        for _ in range(args.repeats):
            for name, engine, micro, _ in runs:
                start = time.perf_counter()
                for _ in range(args.steps):
                    engine.train_step(micro)
                times[name].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(times[runs[0][0]])
    print(f"{'backbone':<20} {'params':>9} {'ms/update':>10} {'updates/s':>10} {'vs depth 0':>11}")
    for name, _, _, size in runs:
        t = statistics.median(times[name])
        print(f"{name:<20} {size:>9,} {1e3 * t:>10.1f} {1 / t:>10.2f} {t / base:>10.2f}x")


if __name__ == "__main__":
    main()
