#!/usr/bin/env python
"""The LM recipe's model on one GPU: the engine's step against a hand-written loop doing the same
math, in bf16 and fp16, with tokens/s, achieved TFLOP/s and MFU.

Both runners train the same model (the ``lm`` task's byte-level GPT, at the shipped size and at
a GPT-2-small-like size) on the same packed stdlib batches, already on the GPU, with the same
update: autocast forward, a loss summed over tokens, backward, gradients divided by the token
count (``loss.reduction=sum``), global-norm clipping at 1.0, AdamW, the fp16 loss scaler, and a
non-finite check that reads the loss on the host. The engine runs under an NCCL process group of
one, as a one-GPU Ray worker does. Blocks of steps alternate between the two runners so that
clock and thermal drift hit both; each of ``--runs`` runs gives a median step time per runner,
and the table shows every run's ratio and their median.

FLOPs are counted once per batch shape with ``torch.utils.flop_counter`` (forward and backward,
padding included, which is what the GPU computes); MFU is achieved FLOP/s over the device's
dense bf16/fp16 peak from the table below (``--peak-tflops`` overrides it).

    python scripts/bench_gpu.py [--sizes small gpt] [--dtypes bf16 fp16] [--runs 3] [--compile]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from raytrain_loops.config import load_config
from raytrain_loops.engine import Engine
from raytrain_loops.engine.precision import DTYPES
from raytrain_loops.recipes import resolve
from raytrain_loops.tasks.lm import LMTask

# Dense bf16/fp16 tensor-core peaks in TFLOP/s (no sparsity), by a substring of the device name.
PEAK_TFLOPS = {"H200": 989.4, "H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0, "L40S": 362.1}

SIZES = {
    # the shipped recipe's model (recipes/lm.yaml)
    "small": dict(dim=128, layers=4, heads=4, max_len=256, max_tokens=4096),
    # GPT-2-small-like: 12 layers of width 768, 12 heads, 1024-byte sequences, 16k tokens a step
    "gpt": dict(dim=768, layers=12, heads=12, max_len=1024, max_tokens=16384),
}


def peak_tflops(override: float | None) -> float:
    if override:
        return override
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), float("nan"))


class Bare:
    """The same update written by hand."""

    def __init__(self, task: LMTask, dtype: str, lr: float):
        torch.manual_seed(0)
        self.task, self.dtype = task, DTYPES[dtype]
        self.model = task.build_model().cuda()
        self.params = list(self.model.parameters())
        # foreach, the default on CUDA, as the engine's optimizer (fused=False alone would turn it off too)
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
        self.scaler = torch.amp.GradScaler("cuda", enabled=dtype == "fp16")

    def step(self, batch) -> None:
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=self.dtype):
            out = self.task.criterion(self.model, batch, None)
        self.scaler.scale(out.loss).backward()
        self.scaler.unscale_(self.opt)
        torch._foreach_mul_([p.grad for p in self.params], 1.0 / out.sample_size)
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        if not math.isfinite(out.loss.item()) and not self.scaler.is_enabled():
            raise FloatingPointError("non-finite loss")
        self.scaler.step(self.opt)
        self.scaler.update()


class EngineRunner:
    def __init__(self, task: LMTask, dtype: str, lr: float):
        torch.manual_seed(0)
        cfg = load_config(resolve("lm"), [f"precision.dtype={dtype}", f"schedules.lr.value={lr}"])
        self.engine = Engine(task.build_model().cuda(), task.criterion, cfg.engine, total_steps=10**6)

    def step(self, batch) -> None:
        self.engine.train_step([batch])


def block(runner, batches, start: int, steps: int) -> float:
    """Seconds per step over ``steps`` consecutive batches."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for s in range(start, start + steps):
        runner.step(batches[s % len(batches)])
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def profile(runners: dict, batches, steps: int = 5) -> None:
    """Print each runner's heaviest GPU ops over ``steps`` steps (``--profile``)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name, runner in runners.items():
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            block(runner, batches, 0, steps)
        print(f"--- {name}: {steps} steps")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def flops_per_step(task: LMTask, batches) -> float:
    """Mean forward+backward FLOPs of a step over the batches (counted once per distinct shape)."""
    model = task.build_model().cuda()
    by_shape: dict[tuple, float] = {}
    total = 0.0
    for batch in batches:
        shape = tuple(batch[0].shape)
        if shape not in by_shape:
            counter = FlopCounterMode(display=False)
            with counter, torch.autocast("cuda", dtype=torch.bfloat16):
                task.criterion(model, batch, None).loss.backward()
            by_shape[shape] = counter.get_total_flops()
        total += by_shape[shape]
    return total / len(batches)


def load_batches(task: LMTask, data_dir: Path) -> list:
    import numpy as np
    import pyarrow.parquet as pq

    task.prepare(data_dir)
    table = pq.read_table(task.splits(data_dir)["train"].path).to_pydict()
    out = []
    for tokens, lengths in zip(table["tokens"], table["lengths"], strict=True):
        row = {"tokens": np.array([tokens], dtype=object), "lengths": np.array([lengths], dtype=object)}
        inputs, targets, n = task.collate(row)
        out.append((inputs.cuda(), targets.cuda(), n))
    return out


def measure(size: str, dtype: str, args, data_dir: Path, peak: float) -> dict:
    task = LMTask(**SIZES[size], compile=args.compile)
    batches = load_batches(task, data_dir)[: args.batches]
    tokens = sum(b[2] for b in batches) / len(batches)
    flops = flops_per_step(LMTask(**SIZES[size]), batches)
    lr = 6e-4 if size == "gpt" else 6e-3
    bare, engine = Bare(task, dtype, lr), EngineRunner(task, dtype, lr)
    # Warm-up over every batch the timing uses: the first step of each shape picks kernels (and,
    # compiled, recompiles), which would otherwise fall on whichever runner meets the shape first.
    for runner in (bare, engine):
        block(runner, batches, 0, max(args.warmup, args.repeats * args.steps))
    if args.profile:
        profile({"bare": bare, "engine": engine}, batches)
    runs = []
    for _ in range(args.runs):
        tb, te = [], []
        for r in range(args.repeats):
            tb.append(block(bare, batches, r * args.steps, args.steps))
            te.append(block(engine, batches, r * args.steps, args.steps))
        runs.append((statistics.median(tb), statistics.median(te)))
    ratios = [e / b for b, e in runs]
    mid = sorted(range(len(runs)), key=lambda i: ratios[i])[len(runs) // 2]  # the median run
    b, e = runs[mid]
    params = sum(p.numel() for p in engine.engine.module.parameters())
    return {
        "size": size,
        "params_m": params / 1e6,
        "dtype": dtype,
        "compile": args.compile,
        "tokens": tokens,
        "bare_ms": b * 1e3,
        "engine_ms": e * 1e3,
        "ratios": ratios,
        "ratio": ratios[mid],
        "tok_s": tokens / e,
        "tflops": flops / e / 1e12,
        "mfu": flops / e / 1e12 / peak,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["small", "gpt"], choices=sorted(SIZES))
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=sorted(DTYPES))
    ap.add_argument("--runs", type=int, default=3, help="runs; the table gives each run's ratio and the median")
    ap.add_argument("--repeats", type=int, default=5, help="alternated blocks per runner in a run")
    ap.add_argument("--steps", type=int, default=20, help="steps per block")
    ap.add_argument(
        "--warmup", type=int, default=20, help="steps per runner before timing (at least every batch timed)"
    )
    ap.add_argument("--batches", type=int, default=200, help="distinct packed batches cycled through")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (dynamic shapes)")
    ap.add_argument("--profile", action="store_true", help="print each runner's heaviest GPU ops first")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak")
    ap.add_argument("--data-dir", default=None, help="where the LM Parquet goes (default: a temporary directory)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1)  # as a one-GPU Ray Train worker runs
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = peak_tflops(args.peak_tflops)
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="bench-gpu-"))
    print(
        f"{torch.cuda.get_device_name()} (peak {peak:g} TFLOP/s dense bf16), torch {torch.__version__}, "
        f"stdlib {Path(sysconfig.get_paths()['stdlib']).name}, compile={args.compile}"
    )
    header = f"{'model':>6} {'params':>7} {'dtype':>5} {'tokens':>7} {'bare ms':>8} {'engine ms':>9} "
    header += f"{'engine/bare (runs)':>26} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'mem GiB':>7}"
    print(header)
    worst = 0.0
    for size in args.sizes:
        for dtype in args.dtypes:
            torch.cuda.reset_peak_memory_stats()
            r = measure(size, dtype, args, data_dir, peak)
            worst = max(worst, r["ratio"])
            runs = ", ".join(f"{x:.3f}" for x in r["ratios"])
            print(
                f"{r['size']:>6} {r['params_m']:>6.1f}M {r['dtype']:>5} {r['tokens']:>7.0f} {r['bare_ms']:>8.2f} "
                f"{r['engine_ms']:>9.2f} {r['ratio']:>7.3f} ({runs}) {r['tok_s']:>9.0f} {r['tflops']:>8.1f} "
                f"{r['mfu']:>6.1%} {r['peak_mem_gib']:>7.1f}",
                flush=True,
            )
    print(f"worst median ratio {worst:.3f} (target <= 1.02)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
