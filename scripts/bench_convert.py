"""``raytrain-loops convert``'s rate on 1 and on 2 CPUs, side by side in one invocation: a
generated ImageFolder (examples/imagefolder.py's images, PNG and JPEG, read from the page cache)
converted in a fresh process with a local Ray of each size. Each process converts a small set
first: Ray Data's first execution in a process starts its workers and imports their libraries
(seconds), which the second does not pay. Prints both rates (the summary line's: from the scan of
the source to meta.json, Ray's start-up left out) and the ratio of 2 CPUs to 1.

    .venv/bin/python scripts/bench_convert.py [--images 6000] [--size 64] [--rows-per-file 256]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child(src: str, out: str, cpus: int, rows_per_file: int) -> None:
    """One process: a local Ray of ``cpus`` CPUs, the warm-up, then the measured conversion."""
    from raytrain_loops.tools.convert import convert, start

    start(cpus)
    warm = Path(out) / "warm-src"
    from examples.imagefolder import write_tree

    write_tree(warm, 8, 16)
    convert("imagefolder", str(warm), f"{out}/warm", say=lambda _: None)
    print(convert("imagefolder", src, f"{out}/measured", rows_per_file=rows_per_file, say=lambda _: None).line())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=6000)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--rows-per-file", type=int, default=256)
    ap.add_argument("--child", nargs=3, metavar=("SRC", "OUT", "CPUS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), args.rows_per_file)
        return
    from examples.imagefolder import write_tree

    with tempfile.TemporaryDirectory() as tmp:
        src = write_tree(Path(tmp) / "src", args.images // 3, args.size)
        rates = {}
        for cpus in (1, 2):
            cmd = [sys.executable, __file__, "--child", str(src), f"{tmp}/out{cpus}", str(cpus),
                   "--rows-per-file", str(args.rows_per_file)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            rates[cpus] = float(re.search(r"\(([\d.]+) images/s\)", out).group(1))
            print(f"{cpus} CPU(s): {out}")
        print(f"images/s: 1 CPU {rates[1]:.0f}, 2 CPUs {rates[2]:.0f}; ratio 2/1 = {rates[2] / rates[1]:.2f}")


if __name__ == "__main__":
    main()
