#!/usr/bin/env python
"""One worker's epoch plan of a large Parquet split, measured: the time and the peak memory
(Python's allocations, NumPy's included: ``tracemalloc``) of one :func:`train_plan` call and one
:func:`eval_plan` call, and the size of the plan a worker keeps.

The split is simulated (an index, no files): ``--rows`` rows in files of 8,192 rows with row
groups of 128 rows, as docs/data.md recommends, chunks of 128 rows (``data.shuffle_chunk_rows``'s
default). ``--files N`` sets ``--rows`` to N whole files. ``--index`` also measures the driver's
index of the split at that size (the footers' figures a :class:`SplitIndex` keeps, built here
without files): the time to build it, the memory it keeps and its peak (``tracemalloc``), and its
pickled size (what each worker is sent).

    .venv/bin/python scripts/bench_plan.py [--rows 10000000 | --files 100000] [--world 1 8] [--index] [--repeats 3]

Each time is the median of ``--repeats`` calls; the peak is that of one more call.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from raytrain_loops.data.parquet import SplitIndex, eval_plan, train_plan  # noqa: E402

FILE_ROWS, GROUP_ROWS, CHUNK_ROWS, BUFFER = 8192, 128, 128, 10_000


def simulated(rows: int) -> SplitIndex:
    """An index of ``rows`` rows in files of FILE_ROWS rows, row groups of GROUP_ROWS rows."""
    files = [min(FILE_ROWS, rows - at) for at in range(0, rows, FILE_ROWS)]
    groups = [[min(GROUP_ROWS, n - at) for at in range(0, n, GROUP_ROWS)] for n in files]
    return SplitIndex("simulated", None, [f"part-{i:06d}.parquet" for i in range(len(files))], groups, ["x"])


def measure(call, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = call()
        times.append(time.perf_counter() - start)
    del plan
    tracemalloc.start()
    plan = call()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"s": round(statistics.median(times), 3), "peak_mb": round(peak / 2**20, 1), "kept_mb": _kept(plan)}


def index_memory(rows: int) -> dict:
    """The driver's index of ``rows`` rows: build time, memory kept and peak, pickled size."""
    start = time.perf_counter()
    simulated(rows)
    seconds = time.perf_counter() - start
    tracemalloc.start()
    index = simulated(rows)
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    pickled = len(pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL))
    return {"files": len(index.files), "row_groups": sum(map(len, index.row_groups)), "build_s": round(seconds, 2),
            "kept_mb": round(kept / 2**20, 1), "peak_mb": round(peak / 2**20, 1), "pickled_mb": round(pickled / 2**20, 1)}  # fmt: skip


def _kept(plan) -> float:
    return round(sum(v.nbytes for v in vars(plan).values() if hasattr(v, "nbytes")) / 2**20, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--world", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--files", type=int, default=0, help="the split's size in files (sets --rows)")
    parser.add_argument("--index", action="store_true", help="measure the driver's index too")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.files:
        args.rows = args.files * FILE_ROWS
    if args.index:
        print(json.dumps({"rows": args.rows, "index": index_memory(args.rows)}), flush=True)
    index = simulated(args.rows)
    for world in args.world:
        train = measure(lambda w=world: train_plan(index, 0, 1, w, w - 1, CHUNK_ROWS, BUFFER), args.repeats)
        evaluation = measure(lambda w=world: eval_plan(index, w, w - 1), args.repeats)
        print(json.dumps({"rows": args.rows, "world": world, "train_plan": train, "eval_plan": evaluation}), flush=True)


if __name__ == "__main__":
    main()
