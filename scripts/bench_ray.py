#!/usr/bin/env python
"""What the Ray layer costs, measured against baselines in the same invocation.

1. Time to the first optimizer step: ``raytrain-loops train default`` against a minimal
   hand-written TorchTrainer script (same model, same Parquet data, 2 CPU workers, DDP), and
   ``raytrain-loops train default --local`` (local mode: one process, no Ray). All are fresh
   processes, the first two starting their own local Ray; runs alternate. The first step's wall
   time is read from what each wrote, measured from the moment the process was launched.
2. Steady step time: the median time between consecutive steps of a 1-worker run inside Ray
   (Ray Data ingestion, logging, reports) and of a local-mode run, against the bare engine
   stepping over the same data in memory in this process, all with one torch thread; runs
   alternate.

    .venv/bin/python scripts/bench_ray.py [--repeats 3] [--steps 400]

Targets: at most +1 s to the first step against the minimal TorchTrainer, local mode's first
step at most 0.25x the Ray path's; steady step at most 1.05x the bare engine's inside Ray, at
most 1.02x in local mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MINIMAL = textwrap.dedent(
    """
    import sys, time
    import numpy as np, ray, ray.data, ray.train, torch, torch.nn.functional as F
    from ray.train.torch import TorchTrainer, prepare_model
    from raytrain_loops.tasks.digits import SmallCNN

    TRAIN, OUT = sys.argv[1], sys.argv[2]

    def loop(cfg):
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = prepare_model(SmallCNN(32))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        rank = ray.train.get_context().get_world_rank()
        for i, batch in enumerate(ray.train.get_dataset_shard("train").iter_torch_batches(batch_size=32, drop_last=True)):
            x = batch["image"].float().reshape(-1, 1, 8, 8)
            loss = F.cross_entropy(model(x), batch["label"].long())
            opt.zero_grad()
            loss.backward()
            opt.step()
            if i == 0 and rank == 0:
                open(OUT, "w").write(str(time.time()))
            if i == 10:
                break
        ray.train.report({"loss": loss.item()})

    ray.init(num_cpus=3)
    TorchTrainer(loop, scaling_config=ray.train.ScalingConfig(num_workers=2),
                 datasets={"train": ray.data.read_parquet(TRAIN)},
                 run_config=ray.train.RunConfig(storage_path=sys.argv[3])).fit()
    """
)


def first_step_ours(tmp: Path, data_dir: Path, tag: str, local: bool = False) -> float:
    store = tmp / f"ours-{tag}{'-local' if local else ''}"
    start = time.time()
    cmd = [
        str(ROOT / ".venv/bin/raytrain-loops"),
        "train",
        "default",
        *(["--local"] if local else []),
        "loop.max_steps=10",
        f"run.storage_path={store}",
        f"data.dir={data_dir}",
    ]
    subprocess.run(cmd, check=True, capture_output=True, cwd=tmp)
    first = json.loads((next(store.glob("*/metrics.jsonl"))).read_text().splitlines()[0])
    return first["time"] - start


def first_step_minimal(tmp: Path, train: Path, tag: str) -> float:
    script, out = tmp / "minimal.py", tmp / f"minimal-{tag}.txt"
    script.write_text(MINIMAL)
    start = time.time()
    subprocess.run(
        [sys.executable, str(script), str(train), str(out), str(tmp / f"min-{tag}")],
        check=True,
        capture_output=True,
        cwd=tmp,
    )
    return float(out.read_text()) - start


def steady_ours(tmp: Path, data_dir: Path, steps: int, tag: str, local: bool = False) -> tuple[float, float]:
    """Median time between consecutive steps, and median time inside the step, of a 1-worker run
    on Ray or in local mode."""
    store = tmp / f"steady-{tag}{'-local' if local else ''}"
    cmd = [
        str(ROOT / ".venv/bin/raytrain-loops"),
        "train",
        "default",
        f"loop.max_steps={steps}",
        f"scaling.num_workers={0 if local else 1}",
        "scaling.threads_per_worker=1",
        f"run.storage_path={store}",
        f"data.dir={data_dir}",
    ]
    subprocess.run(cmd, check=True, capture_output=True, cwd=tmp)
    rows = [json.loads(line) for line in next(store.glob("*/metrics.jsonl")).read_text().splitlines()]
    times = [r["time"] for r in rows]
    interval = statistics.median(b - a for a, b in zip(times[1:], times[2:], strict=False))
    return interval, statistics.median(r["compute_time"] for r in rows[1:])


def steady_bare(data_dir: Path, steps: int) -> tuple[float, float]:
    import pyarrow.parquet as pq
    import torch

    from raytrain_loops.config import load_config
    from raytrain_loops.engine import Engine
    from raytrain_loops.recipes import resolve
    from raytrain_loops.tasks.digits import DigitsTask

    torch.set_num_threads(1)
    cfg = load_config(resolve("default"), [f"loop.max_steps={steps}"])
    task = DigitsTask(**cfg.task.params)
    table = pq.read_table(data_dir / "digits" / "train.parquet").to_pydict()
    import numpy as np

    images, labels = np.array(table["image"], dtype=np.float32), np.array(table["label"])
    torch.manual_seed(0)
    engine = Engine(task.build_model(), task.criterion, cfg.engine, total_steps=steps)
    per_epoch = len(labels) // cfg.data.batch_size
    rng = np.random.default_rng(0)
    times, computes, order = [], [], rng.permutation(len(labels))
    last = time.perf_counter()
    for s in range(steps):
        if s % per_epoch == 0:
            order = rng.permutation(len(labels))
        idx = order[(s % per_epoch) * cfg.data.batch_size :][: cfg.data.batch_size]
        result = engine.train_step([task.collate({"image": images[idx], "label": labels[idx]})])
        now = time.perf_counter()
        times.append(now - last)
        computes.append(result.compute_time)
        last = now
    return statistics.median(times[1:]), statistics.median(computes[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="alternated runs of each")
    ap.add_argument("--steps", type=int, default=400, help="steps of the steady-state runs")
    ap.add_argument("--part", choices=["all", "first", "steady"], default="all", help="which measurement to run")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        from raytrain_loops.tasks.digits import write_digits_parquet

        data_dir = tmp / "data"
        train = write_digits_parquet(data_dir / "digits")["train"]
        ours, minimal, local = [], [], []
        for r in range(args.repeats if args.part != "steady" else 0):
            minimal.append(first_step_minimal(tmp, train, str(r)))
            ours.append(first_step_ours(tmp, data_dir, str(r)))
            local.append(first_step_ours(tmp, data_dir, str(r), local=True))
            print(
                f"first step, run {r}: raytrain-loops {ours[-1]:.2f} s, minimal TorchTrainer {minimal[-1]:.2f} s, "
                f"local mode {local[-1]:.2f} s",
                flush=True,
            )
        steady: dict[str, list[float]] = {"ray": [], "local": [], "bare": [], "ray_ratio": [], "local_ratio": []}
        for r in range(args.repeats if args.part != "first" else 0):
            ray_step, ray_compute = steady_ours(tmp, data_dir, args.steps, str(r))
            bare_step, bare_compute = steady_bare(data_dir, args.steps)
            local_step, local_compute = steady_ours(tmp, data_dir, args.steps, str(r), local=True)
            for key, value in (("ray", ray_step), ("local", local_step), ("bare", bare_step)):
                steady[key].append(value)
            steady["ray_ratio"].append(ray_step / bare_step)
            steady["local_ratio"].append(local_step / bare_step)
            print(
                f"steady step, run {r}: inside Ray {ray_step * 1e3:.2f} ms (in the step {ray_compute * 1e3:.2f} ms), "
                f"local mode {local_step * 1e3:.2f} ms (in the step {local_compute * 1e3:.2f} ms), "
                f"bare engine {bare_step * 1e3:.2f} ms (in the step {bare_compute * 1e3:.2f} ms); "
                f"ratios {steady['ray_ratio'][-1]:.3f} (Ray), {steady['local_ratio'][-1]:.3f} (local)",
                flush=True,
            )
    if ours:
        mo, mm, ml = statistics.median(ours), statistics.median(minimal), statistics.median(local)
        print(
            f"time to first step: raytrain-loops {mo:.2f} s, minimal {mm:.2f} s, difference {mo - mm:+.2f} s "
            f"(target <= +1 s); local mode {ml:.2f} s, {ml / mo:.3f}x the Ray path (target <= 0.25x)"
        )
    if steady["ray"]:
        med = {k: statistics.median(v) for k, v in steady.items()}
        print(
            f"steady step time: inside Ray {med['ray'] * 1e3:.2f} ms, local mode {med['local'] * 1e3:.2f} ms, bare "
            f"engine {med['bare'] * 1e3:.2f} ms; median of the runs' ratios: {med['ray_ratio']:.3f} inside Ray "
            f"(target <= 1.05), {med['local_ratio']:.3f} local (target <= 1.02)"
        )


if __name__ == "__main__":
    main()
