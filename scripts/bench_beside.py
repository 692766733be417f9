#!/usr/bin/env python
"""This tree's data path beside another commit's (``--old``: a checkout, e.g. ``git worktree add``),
in one invocation, runs alternating (old, this), each in a fresh process that imports the
package from its own tree (``PYTHONPATH``):

1. ``scripts/bench_data.py`` part 4: ``data_time / batch_time`` of a 2-worker training run of a
   small CNN reading a generated split through ``preprocess`` (each tree's own script).
2. ``images_cls``'s time in ``fit`` at a small size (``--images`` training images streamed from
   the files, ``--steps`` updates, an evaluation at the end); the data drawn once before, untimed.

    .venv/bin/python scripts/bench_beside.py --old /work/wt-old [--repeats 3]

Each figure is the median of ``--repeats`` runs, all runs printed, with the load average at the
start of each run.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FIT = """
import json, sys, time
from pathlib import Path
import raytrain_loops
from raytrain_loops.recipes import resolve
from raytrain_loops.tasks.images import ImagesTask
data, out, images, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ImagesTask(images, 1024).prepare(Path(data))
overrides = [f"task.params.train_images={images}", "task.params.eval_images=1024", f"loop.max_steps={steps}",
             f"eval.every_steps={steps}", "checkpoint.every_steps=0", "data.materialize=never",
             f"data.dir={data}", f"run.storage_path={out}", "run.progress=false"]
t0 = time.perf_counter()
result = raytrain_loops.fit(resolve("images_cls"), overrides=overrides)
print(json.dumps({"fit_s": time.perf_counter() - t0, "package": raytrain_loops.__file__}))
"""


def child(tree: Path, argv: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, *argv], cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode:  # a loaded machine: Ray's start may time out; one more try, said aloud
        print(f"{tree}: a run failed ({out.stderr.strip().splitlines()[-1][:200]}); trying it again", flush=True)
        out = subprocess.run([sys.executable, *argv], cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{tree}: {' '.join(argv[:2])} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def share(tree: Path, data: str, steps: int) -> float:
    argv = ["scripts/bench_data.py", "--parts", "4", "--repeats", "1", "--gb", "0.05", "--dir", data]
    text = child(tree, [*argv, "--train-steps", str(steps)])
    return float(re.search(r"data_time / batch_time: ([0-9.]+)", text).group(1))


def fit_time(tree: Path, data: str, images: int, steps: int) -> float:
    import json

    with tempfile.TemporaryDirectory() as out:
        line = child(tree, ["-c", FIT, data, out, str(images), str(steps)]).strip().splitlines()[-1]
    result = json.loads(line)
    assert result["package"].startswith(str(tree)), result["package"]
    return result["fit_s"]


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, type=Path, help="a checkout of the commit to compare against")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=200, help="part 4's run length")
    parser.add_argument("--images", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=100, help="images_cls's updates")
    parser.add_argument("--dir", default="/tmp/bench-beside")
    args = parser.parse_args()
    trees = {"old": args.old.resolve(), "this": ROOT}
    shares: dict[str, list[float]] = {k: [] for k in trees}
    fits: dict[str, list[float]] = {k: [] for k in trees}
    for r in range(args.repeats):
        for name, tree in trees.items():
            at = load()
            shares[name].append(share(tree, args.dir + "/split", args.train_steps))
            print(f"run {r} {name}: part 4 data share {shares[name][-1]:.2f} (load {at})", flush=True)
            at = load()
            fits[name].append(fit_time(tree, args.dir + "/images", args.images, args.steps))
            print(f"run {r} {name}: images_cls {fits[name][-1]:.1f} s in fit (load {at})", flush=True)
    for name, tree in trees.items():
        s, f = shares[name], fits[name]
        print(f"{name} ({tree}):")
        print(f"  part 4 data_time / batch_time: {statistics.median(s):.2f} (runs: {', '.join(f'{v:.2f}' for v in s)})")
        print(f"  images_cls in fit: {statistics.median(f):.1f} s (runs: {', '.join(f'{v:.1f}' for v in f)})")
    ratio = statistics.median(fits["this"]) / statistics.median(fits["old"])
    print(f"images_cls in fit, this / old: {ratio:.2f}x; load at the end {load()}")


if __name__ == "__main__":
    main()
