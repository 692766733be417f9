#!/usr/bin/env python
"""The Parquet data path, measured against pyarrow's plain read of the same files in the same
invocation.

A generated split: ``--gb`` of 64x64 RGB images stored as encoded PNG bytes (a ``label`` beside
them), in files of 8,192 rows with row groups of 128 rows, as docs/data.md recommends.

1. Rows per second delivered to the loop (the worker's chain: the epoch's plan, windows read
   ahead on a thread, permuted, cut into batches of 64) against pyarrow reading every row group
   of the same files in storage order and converting it to NumPy, both on the stored columns
   (no decoding). Target: at least 0.8x.
2. With ``Task.preprocess`` (PNG decode, a random crop and flip from each row's seed) executed by
   a worker's Ray Data executor (``RayPreprocessing``) on 1 and 2 CPUs, against the same decode
   on this process's one thread, over an epoch of the split's first ``--preprocess-rows`` rows:
   one executor per CPU count, given the following epochs' plans, so that its epochs continue one
   execution. Epoch 0 starts the execution (on 1 CPU: the first epoch after Ray's start) and
   epoch 1 follows it (both shown on their own: a task process may start in them); epochs 2 to
   ``--repeats`` + 1 are the runs: the steady state (rows/s after the first batch), the wait for
   an epoch's first batch (from asking for it to getting it) and the total (rows/s, the first
   batch included). The thread's three runs come before, between and after the executors'.
3. Peak memory (RSS) of a process streaming a quarter of the split and the whole of it, through
   the plan (one worker's share of a 1-worker group, no preprocessing), and of the driver's
   index of the footers at both sizes: it must not grow with the split.
4. The share of the step's time spent waiting for data (``data_time / batch_time``) in a
   training run of a small CNN on 2 workers reading the split through ``preprocess``.

    .venv/bin/python scripts/bench_data.py [--gb 2] [--repeats 3] [--dir /tmp/bench-data]

Runs alternate (part 2: see above); each figure is the median of ``--repeats`` runs, all runs printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from raytrain_loops.data.parquet import (  # noqa: E402
    ROW_SEED,
    Reader,
    SplitIndex,
    index_split,
    prefetched,
    sliced,
    train_plan,
    windows_from,
)
from raytrain_loops.runtime.batches import read_and_preprocess  # noqa: E402
from raytrain_loops.streams import close  # noqa: E402
from raytrain_loops.tasks.base import Task  # noqa: E402
from raytrain_loops.tasks.datasets import patterns  # noqa: E402
from raytrain_loops.tasks.images import crops  # noqa: E402

ROWS_PER_FILE, ROW_GROUP, SIDE, BATCH = 8192, 128, 64, 64


def png(rng: np.random.Generator) -> bytes:
    # Smooth gradients plus noise: compresses like a photograph, not like pure noise.
    base = np.linspace(0, 255, SIDE, dtype=np.float32)
    img = base[None, :, None] * rng.random(3) + base[:, None, None] * rng.random(3)
    return patterns.png(np.clip(img * 0.5 + rng.normal(0, 24, (SIDE, SIDE, 3)), 0, 255).astype(np.uint8))


def write_split(path: Path, gb: float) -> None:
    """The split, written once (kept between invocations: its size is in a marker file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    marker = path / "_done.json"  # pyarrow skips names starting with "_"
    if marker.exists() and json.loads(marker.read_text())["gb"] == gb:
        return
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("*.parquet"):
        old.unlink()
    rng = np.random.default_rng(0)
    pool = [png(rng) for _ in range(2048)]  # encoded images reused: generation is not what is measured
    written, f, t0 = 0, 0, time.perf_counter()
    while written < gb * 1e9:
        picks = rng.integers(0, len(pool), ROWS_PER_FILE)
        table = pa.table({"image": [pool[i] for i in picks], "label": (picks % 10).astype(np.int64)})
        pq.write_table(table, path / f"part-{f:05d}.parquet", row_group_size=ROW_GROUP)
        written += (path / f"part-{f:05d}.parquet").stat().st_size
        f += 1
        print(f"\rwriting the split: {written / 1e9:.2f} / {gb} GB", end="", flush=True)
    print(f" ({f} files, {time.perf_counter() - t0:.0f} s)")
    marker.write_text(json.dumps({"gb": gb}))


def subset(index: SplitIndex, fraction: float) -> SplitIndex:
    k = max(1, int(len(index.files) * fraction))
    return SplitIndex(index.path, index.filesystem, index.files[:k], index.row_groups[:k], index.columns)


def first_rows(index: SplitIndex, rows: int) -> SplitIndex:
    """The split's first ``rows`` rows (whole row groups, in storage order) as an index of its own."""
    files, groups, at = [], [], 0
    for path, sizes in zip(index.files, index.row_groups, strict=True):
        kept = []
        for n in sizes:
            if at >= rows:
                break
            kept.append(n)
            at += n
        if kept:
            files.append(path)
            groups.append(kept)
    return SplitIndex(index.path, index.filesystem, files, groups, index.columns)


def pyarrow_read(index: SplitIndex) -> float:
    """Rows per second of pyarrow reading every row group in storage order, to NumPy."""
    import pyarrow.parquet as pq

    t0, rows = time.perf_counter(), 0
    for path in index.files:
        handle = pq.ParquetFile(path)
        for g in range(handle.num_row_groups):
            table = handle.read_row_group(g, columns=index.columns)
            arrays = [table.column(c).to_numpy() for c in index.columns]
            rows += len(arrays[0])
    return rows / (time.perf_counter() - t0)


def stream(index: SplitIndex) -> int:
    """The rows the loop receives from the worker's chain (no preprocessing), in batches of 64."""
    plan = train_plan(index, 0, 0, 1, 0, 128, 10_000)
    batches = sliced(prefetched(windows_from(Reader(index), plan, 0), 1), BATCH, lambda b: b, drop_last=True)
    return sum(len(batch["label"]) for batch in batches)


def ours(index: SplitIndex) -> float:
    """Rows per second the loop receives from the worker's chain (no preprocessing)."""
    t0 = time.perf_counter()
    rows = stream(index)
    return rows / (time.perf_counter() - t0)


class Images:
    """A task whose preprocess decodes, crops and flips (the seeds of each row)."""

    def preprocess(self, batch: dict, train: bool) -> dict:
        return {"image": crops(batch["image"], batch[ROW_SEED], SIDE, train), "label": batch["label"]}


class BenchImages(Images, Task):
    """:class:`Images` as a task the preprocessing tasks receive."""


def timed(batches: Iterable[dict], rows: int) -> tuple[float, float, float]:
    """(seconds to the first batch, rows/s after it, rows/s in all) of ``batches`` until ``rows``
    rows came, timed from the call that asked for them."""
    t0, done, first, at_first = time.perf_counter(), 0, 0.0, 0
    for batch in batches:
        if not first:
            first, at_first = time.perf_counter() - t0, len(batch["label"])
        done += len(batch["label"])
        if done >= rows:
            break
    total = time.perf_counter() - t0
    close(batches)
    return first, (done - at_first) / max(total - first, 1e-9), done / total


def decode_here(index: SplitIndex, rows: int) -> tuple[float, float, float]:
    """:func:`timed` of the same preprocessing on this process's thread (the training worker's lot
    without preprocessing tasks), 256 rows per call."""
    plan = train_plan(index, 0, 0, 1, 0, 128, 1024)
    return timed(read_and_preprocess(Images(), index, plan, range(plan.windows), 0, 0, (0, 0), 256, True), rows)


def preprocessed_rate(
    preprocessing, index: SplitIndex, cpus: int, epoch: int, last: int
) -> tuple[float, float, float]:
    """:func:`timed` of ``epoch`` (all of ``index``'s rows) from ``preprocessing``, a worker's Ray
    Data executor kept across epochs (windows of 1,024 rows, 256 rows per call of ``preprocess``,
    at most ``cpus`` tasks at once); given the plans of the epochs up to ``last``, it continues one
    execution from one epoch to the next."""
    from raytrain_loops.config.run import DataConfig, PreprocessConfig
    from raytrain_loops.runtime.batches import EpochPlans

    data = DataConfig(preprocess=PreprocessConfig(num_cpus=1, concurrency=cpus, batch_rows=256))
    plan = train_plan(index, 0, epoch, 1, 0, 128, 1024)
    ahead = EpochPlans(index, 0, 1, 0, 128, 1024, last)
    return timed(preprocessing(BenchImages(), data, plan, index, 0, (0, epoch), True, ahead), index.rows)


def child_rss(kind: str, path: str, fraction: float) -> dict:
    """Run a streaming pass (or the driver's indexing) in a fresh process; its peak RSS in MB."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, "--dir", path, "--fraction", str(fraction)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _status(field: str) -> float:
    """A field of /proc/self/status in MB (VmRSS: now, VmHWM: the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_child(kind: str, path: str, fraction: float) -> None:
    before = _status("VmRSS")  # the interpreter, NumPy and pyarrow, imported
    index = subset(index_split(path, ["image", "label"]), fraction)
    rows = stream(index) if kind == "stream" else 0
    gb = sum(os.path.getsize(f) for f in index.files) / 1e9
    peak = _status("VmHWM")
    print(
        json.dumps(
            {"gb": round(gb, 2), "rows": rows or index.rows, "peak": round(peak), "growth": round(peak - before)}
        )
    )


class ImagesTask(Images):
    """The split through ``preprocess`` into a small CNN, for the training run of part 4."""

    def __init__(self, path: str):
        self.path = path

    def splits(self, data_dir):
        from raytrain_loops import ParquetSplit

        return {"train": ParquetSplit(self.path, ["image", "label"])}

    def build_model(self):
        from torch import nn

        return nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
        )  # fmt: skip

    def collate(self, batch):
        import torch

        x = torch.from_numpy(np.ascontiguousarray(batch["image"])).permute(0, 3, 1, 2).float().div_(255)
        return x, torch.as_tensor(batch["label"])

    def criterion(self, model, batch, ctx):
        import torch.nn.functional as F

        from raytrain_loops import LossOutput

        x, y = batch
        return LossOutput(F.cross_entropy(model(x), y), sample_size=len(y))


def training_share(path: str, steps: int, out: str) -> dict:
    """data_time / batch_time of a 2-worker run of :class:`ImagesTask` (Ray started by fit)."""
    import raytrain_loops

    task = type("BenchImagesTask", (ImagesTask, Task), {})(path)
    config = {
        "loop": {"max_steps": steps},
        "data": {"batch_size": 64, "materialize": "never"},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every_steps": 0},
        "logging": {"every_steps": 10},
        "run": {"storage_path": out, "progress": False},
    }
    result = raytrain_loops.fit(config, task=task)
    m = result.metrics
    return {"data_time": m.get("data_time"), "batch_time": m.get("batch_time")}


def report(name: str, values: list[float], unit: str = "rows/s") -> float:
    med = statistics.median(values)
    print(f"  {name}: {med:,.0f} {unit} (runs: {', '.join(f'{v:,.0f}' for v in values)})")
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/bench-data")
    parser.add_argument("--preprocess-rows", type=int, default=16384)
    parser.add_argument("--child", choices=["stream", "index"])
    parser.add_argument("--fraction", type=float, default=1.0)
    parser.add_argument("--train-steps", type=int, default=200, help="part 4's run length")
    parser.add_argument("--parts", default="1,2,3,4", help="which parts to run, e.g. 1,3")
    args = parser.parse_args()
    if args.child:
        return run_child(args.child, args.dir, args.fraction)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    write_split(Path(args.dir), args.gb)
    index = index_split(args.dir, ["image", "label"])
    gb = sum(os.path.getsize(f) for f in index.files) / 1e9
    print(f"split: {index.rows:,} rows, {len(index.files)} files, {gb:.2f} GB; {os.cpu_count()} CPUs")

    parts = {int(p) for p in args.parts.split(",")}
    if 1 in parts:
        part1(index, args.repeats)
    if 2 in parts:
        part2(index, args.repeats, args.preprocess_rows)
    if 3 in parts:
        part3(args.dir, args.repeats)
    if 4 in parts:
        part4(args.dir, args.repeats, args.train_steps)


def part1(index: SplitIndex, repeats: int) -> None:
    print("1. rows/s to the loop, stored columns (no decoding), alternating runs:")
    plain, mine = [], []
    for _ in range(repeats):
        plain.append(pyarrow_read(index))
        mine.append(ours(index))
    p, m = report("pyarrow read, storage order", plain), report("the loop's chain (plan, shuffle, batches)", mine)
    print(f"  ratio: {m / p:.2f}x (target >= 0.8x)")


def part2(index: SplitIndex, repeats: int, rows: int) -> None:
    epoch = first_rows(index, rows)
    print(f"2. with preprocess (PNG decode, crop, flip), epochs of {epoch.rows:,} rows:")
    import ray

    from raytrain_loops.worker.preprocessing import RayPreprocessing

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    runs: dict[str, list[tuple[float, float, float]]] = {"here": [], "1": [], "2": []}
    firsts: dict[str, tuple[float, float, float]] = {}
    seconds: dict[str, tuple[float, float, float]] = {}  # epoch 1: the pool's second task process may start in it
    runs["here"].append(decode_here(epoch, epoch.rows))
    for cpus in (1, 2):
        # One executor per CPU count, as a training worker holds one: epoch 0 starts its execution,
        # epochs 1 to repeats + 1 continue it back to back (the consumer never pauses, as in training).
        preprocessing = RayPreprocessing(1)
        firsts[str(cpus)] = preprocessed_rate(preprocessing, epoch, cpus, 0, repeats + 1)
        seconds[str(cpus)] = preprocessed_rate(preprocessing, epoch, cpus, 1, repeats + 1)
        for e in range(2, repeats + 2):
            runs[str(cpus)].append(preprocessed_rate(preprocessing, epoch, cpus, e, repeats + 1))
        preprocessing.close()
        runs["here"].append(decode_here(epoch, epoch.rows))  # the thread's runs between the executors'
    ray.shutdown()
    print(f"  load average {os.getloadavg()[0]:.2f}, {os.getloadavg()[1]:.2f}, {os.getloadavg()[2]:.2f} at the end")
    for cpus, (first, _, total) in firsts.items():
        what = "the first epoch after Ray's start" if cpus == "1" else "its first epoch (Ray already up)"
        print(f"  {cpus} CPU(s), {what}: first batch {first:.2f} s, total {total:,.0f} rows/s")
        first, steady, total = seconds[cpus]
        print(f"  {cpus} CPU(s), epoch 1: first batch {first:.2f} s, steady {steady:,.0f}, total {total:,.0f} rows/s")
    med = {}
    names = (("here", "on the consuming thread"), ("1", "Ray Data, 1 CPU (epochs 2 on of one execution)"), ("2", "Ray Data, 2 CPUs"))
    for key, name in names:
        r = runs[key]
        print(f"  {name}:")
        med[key] = report("steady state", [x[1] for x in r])
        report("first batch", [x[0] * 1000 for x in r], "ms")
        report("total, the first batch included", [x[2] for x in r])
    one, two = med["1"] / med["here"], med["2"] / med["1"]
    print(
        f"  steady state: 1 CPU / consuming thread {one:.2f}x (target >= 0.9x); 2 CPUs / 1 CPU {two:.2f}x (target >= 1)"
    )


def part3(path: str, repeats: int) -> None:
    print("3. peak RSS (MB), and its growth past the imports, of a streaming pass and of the driver's index:")
    for kind in ("stream", "index"):
        for fraction in (0.25, 1.0):
            runs = [child_rss(kind, path, fraction) for _ in range(repeats)]
            peak, growth = [r["peak"] for r in runs], [r["growth"] for r in runs]
            print(
                f"  {kind}, {runs[0]['gb']} GB ({runs[0]['rows']:,} rows): peak {statistics.median(peak):.0f} "
                f"(runs: {peak}), growth {statistics.median(growth):.0f} (runs: {growth})"
            )


def part4(path: str, repeats: int, steps: int) -> None:
    import tempfile

    print(f"4. a training run: 2 workers, a small CNN, {steps} steps of 64 rows, preprocess in the worker's tasks:")
    with tempfile.TemporaryDirectory() as out:
        shares = [training_share(path, steps, out + f"/{i}") for i in range(repeats)]
    ratios = ", ".join(f"{s['data_time'] / s['batch_time']:.2f}" for s in shares)
    batch = ", ".join(f"{s['batch_time']:.3f}" for s in shares)
    median = statistics.median(s["data_time"] / s["batch_time"] for s in shares)
    print(f"  data_time / batch_time: {median:.2f} (runs: {ratios}; batch_time {batch} s)")


if __name__ == "__main__":
    main()
