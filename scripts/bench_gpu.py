#!/usr/bin/env python
"""The LM recipe's model on one GPU: the engine's step against a hand-written loop doing the same
math, in bf16 and fp16, with tokens/s, achieved TFLOP/s and MFU.

Both runners train the same model (the ``lm`` task's GPT: ``small``, the byte-level size the
``lm`` recipe had before it was sized for 2-core CPUs;
``gpt``, GPT-2 small's shape on bytes, 85M parameters; ``gpt2``, the ``lm_gpt`` recipe's model,
124M parameters with a tied 50304-token embedding, on generated tokens) on the same packed
batches (stdlib bytes, or generated tokens), already on the GPU, with the same
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

``--strategies ddp fsdp`` prints a second table instead: the ``lm_gpt`` recipe's model on every
GPU of the machine (one process each, NCCL), wrapped in DDP or sharded by FSDP2, with regional
compilation off and on: tokens/s over all GPUs and MFU against their summed bf16 peak, each step
fed as a worker feeds it (the Parquet batches read and collated, pinned, the next copied to the
GPU beside the step) and the share of the time spent waiting for them; ``--packing`` overrides the
recipe's (``fixed``), ``--attention flex`` keeps each packed sequence to itself with FlexAttention's
block mask instead of the recipe's boolean mask (``sdpa``; CUDA only; the MFU's FLOPs stay those of
attention over whole rows), ``--prefetch 0 2`` sets ``data.prefetch_batches`` per row (column
``ahead``; 0: the batches read, collated and pinned on the loop's thread), ``--scopes blocks model`` compiles block by block, the whole model, or
each in a row of its own. ``--profile`` adds, under each row, where the device's time went over 3
more steps (torch's profiler): its kernels' time against the wall time (the rest is the device
waiting for the host), that time by kind of kernel (matrix products, attention, the loss, the
optimizer and clipping, kernels the compiler fused, collectives, copies, other), and the heaviest
kernels.
``--device cpu`` runs that table's code on gloo CPU processes with the recipe's task at a small
width and vocabulary (a check of the code, the tied embedding sharded included; no MFU).

    python scripts/bench_gpu.py --strategies ddp fsdp [--compiles off on] [--scopes blocks model]
        [--attention sdpa flex] [--prefetch 0 2] [--profile] [--steps 20]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from raytrain_loops.config import load_config
from raytrain_loops.config.engine import CompileConfig
from raytrain_loops.engine import Engine
from raytrain_loops.engine.devices import to_device
from raytrain_loops.engine.distributed.sharding import prepare_model
from raytrain_loops.engine.update import precision
from raytrain_loops.engine.update.precision import DTYPES
from raytrain_loops.recipes import resolve
from raytrain_loops.tasks.lm import LMTask

# Dense bf16/fp16 tensor-core peaks in TFLOP/s (no sparsity), by a substring of the device name.
PEAK_TFLOPS = {"H200": 989.4, "H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0, "L40S": 362.1}

SIZES = {
    # the lm recipe's model and batches before it was sized for 2-core CPUs (it now has 3 blocks and
    # batches of 2,048 bytes); kept so that docs/benchmarks.md's GPU figures stay comparable
    "small": dict(dim=128, layers=4, heads=4, max_len=256, max_tokens=4096),
    # GPT-2-small-like on bytes: 12 layers of width 768, 12 heads, 1024-byte sequences, 16k tokens a step
    "gpt": dict(dim=768, layers=12, heads=12, max_len=1024, max_tokens=16384),
}
# The lm_gpt recipe's model on a CPU: its generated tokens and tied embedding, small enough for gloo.
CPU_CHECK = dict(dim=64, layers=2, heads=2, vocab=512, max_len=256, max_tokens=4096)


def task_params(size: str, batches: int) -> dict:
    """The task's parameters for ``size``: ``gpt2`` (and ``cpu``, its small check) are the lm_gpt
    recipe's, with just enough generated tokens for ``batches`` batches."""
    if size not in ("gpt2", "cpu"):
        return SIZES[size]
    params = dict(load_config(resolve("lm_gpt")).task.params)
    if size == "cpu":
        params.update(CPU_CHECK)
    return {**params, "tokens": (batches + 8) * params["max_tokens"]}


def peak_tflops(override: float | None) -> float:
    if override:
        return override
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), float("nan"))


class Bare:
    """The same update written by hand."""

    def __init__(self, task: LMTask, dtype: str, lr: float, compiled: bool = False):
        torch.manual_seed(0)
        self.task, self.dtype = task, DTYPES[dtype]
        self.model = whole_model(task, compiled).cuda()
        self.params = list(self.model.parameters())
        # fused, as the engine's optimizer on CUDA
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
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
    def __init__(self, task: LMTask, dtype: str, lr: float, compiled: bool = False):
        torch.manual_seed(0)
        cfg = load_config(resolve("lm"), [f"precision.dtype={dtype}", f"schedules.lr.value={lr}"])
        self.engine = Engine(whole_model(task, compiled).cuda(), task.criterion, cfg.engine, total_steps=10**6)


def whole_model(task: LMTask, compiled: bool) -> torch.nn.Module:
    """The task's model, compiled whole (``compile.scope=model``, dynamic shapes) when ``compiled``."""
    model = task.build_model()
    cfg = CompileConfig(enabled=compiled, scope="model", dynamic=True)
    prepare_model(model, task.blocks(model), compile_cfg=cfg)
    return model

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


def load_batches(task: LMTask, data_dir: Path, device: str = "cuda") -> list:
    import numpy as np
    import pyarrow.parquet as pq

    task.prepare(data_dir)
    table = pq.read_table(task.splits(data_dir)["train"].path).to_pydict()
    out = []
    for tokens, lengths in zip(table["tokens"], table["lengths"], strict=True):
        row = {"tokens": np.array([tokens], dtype=object), "lengths": np.array([lengths], dtype=object)}
        out.append(to_device(task.collate(row), torch.device(device)))
    return out


def measure(size: str, dtype: str, args, data_dir: Path, peak: float) -> dict:
    params = task_params(size, args.batches)
    task = LMTask(**params)
    batches = load_batches(task, data_dir)[: args.batches]
    tokens = sum(b[2] for b in batches) / len(batches)
    flops = flops_per_step(LMTask(**params), batches)
    lr = 6e-3 if size == "small" else 6e-4
    bare, engine = Bare(task, dtype, lr, args.compile), EngineRunner(task, dtype, lr, args.compile)
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


def _strategy_worker(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    """One process of the strategy table: the recipe's model under DDP or FSDP on this rank's
    device, ``spec["steps"]`` timed engine steps after a warm-up, fed as a worker feeds them (the
    Parquet batches read and collated, pinned on CUDA, the next copied ahead beside the step),
    the time waiting for them apart; rank 0 writes the result."""
    import json

    from torch.nn.parallel import DistributedDataParallel as DDP

    from raytrain_loops.driver.preflight import prepare
    from raytrain_loops.engine.devices import copied_ahead
    from raytrain_loops.engine.distributed.sharding import shard
    from raytrain_loops.engine.loop import timed_groups
    from raytrain_loops.runtime.batches import Batches, preprocessed_here

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    cfg = load_config(
        resolve("lm_gpt"),
        [
            f"precision.dtype={spec['dtype']}",
            f"scaling.strategy={spec['strategy']}",
            f"compile.enabled={spec['compile']}",
            f"compile.scope={spec['scope']}",
            f"data.dir={spec['data_dir']}",
            f"data.prefetch_batches={spec['prefetch']}",
            *(f"task.params.{k}={v}" for k, v in spec["params"].items()),
        ],
    )
    task, splits, rows = prepare(cfg, None)
    source = Batches(task, cfg, splits, rows, rank, world, device, preprocessed_here)
    stream = copied_ahead(timed_groups((b for e in range(10**6) for b in source.batches("train", e)), 1), device)
    torch.manual_seed(0)
    model = task.build_model().to(device)
    prepare_model(model, task.blocks(model), checkpointing=cfg.checkpointing, compile_cfg=cfg.compile)
    if spec["strategy"] == "fsdp":
        shard(model, task.blocks(model), device, spec["dtype"], cfg.scaling.reshard_after_forward)
    else:
        model = DDP(model, device_ids=[rank] if cuda else None)
    engine = Engine(model, task.criterion, cfg.engine, total_steps=10**6)

    def run(steps: int) -> tuple[float, float, float]:
        if cuda:
            torch.cuda.synchronize()
        t, tokens, waits = time.perf_counter(), 0, 0.0
        for _ in range(steps):
            start = time.perf_counter()
            group, wait = next(stream)
            waits += time.perf_counter() - start  # the batch's read and collate, and its copy's start
            engine.train_step(group, data_time=wait)
            tokens += group[0][2]
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t, tokens, waits

    run(spec["warmup"])
    seconds, tokens, waits = run(spec["steps"])
    kinds = None
    if spec["profile"]:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            wall = run(PROFILED_STEPS)[0]
        kinds = device_time(prof.key_averages(), wall) if rank == 0 else None
    totals = torch.tensor([tokens, seconds, waits], dtype=torch.float64, device=device)
    dist.all_reduce(totals)  # tokens of all workers; their seconds (each worker's wall time, averaged below)
    if rank == 0:
        result = {
            "tok_s": totals[0].item() / (totals[1].item() / world),
            "step_ms": totals[1].item() / world / spec["steps"] * 1e3,
            "tokens": totals[0].item() / spec["steps"],
            "wait_share": totals[2].item() / totals[1].item(),
            "params_m": sum(p.numel() for p in engine.module.parameters()) / 1e6,
            "mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
            "profile": kinds,
        }
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


PROFILED_STEPS = 3
"""The steps ``--profile`` records after a row's timed ones."""

# A kernel's kind, by the first pattern its name matches (kernel names differ across torch, CUDA and
# GPU generations: these are the libraries' and kernels' stems, not whole names).
KINDS = [
    ("collectives", r"nccl"),
    ("copies", r"memcpy|memset"),
    ("attention", r"flash|fmha|attention|flex|sdpa|_efficient_|cutlassf|pytorch_flash"),
    ("loss", r"logsoftmax|log_softmax|nll_loss|cross_entropy"),
    ("optimizer and clipping", r"adam|multi_tensor_apply|foreach|lpnorm"),
    ("compiler-fused", r"^triton_|triton"),
    ("matrix products", r"gemm|cutlass|nvjet|xmma|cublas|sm90_|sm80_|matmul|wgmma"),
]


def kind_of(kernel: str) -> str:
    """The kind of a device kernel by its name (:data:`KINDS`), ``other`` when none matches."""
    name = kernel.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, name)), "other")


def device_time(averages, wall_s: float, top: int = 6) -> dict:
    """From torch's profiler's ``key_averages()`` over steps that took ``wall_s``: the device
    kernels' summed time against the wall time (``busy``: over 1 where streams overlap, such as
    collectives beside the step), each kind's share of the wall time (:func:`kind_of`), and the
    ``top`` heaviest kernels with their share. Empty shares on a CPU (no device kernels)."""
    from torch.autograd import DeviceType

    kernels = [(a.key, a.self_device_time_total / 1e6, a.count) for a in averages if a.device_type != DeviceType.CPU]
    kernels = [k for k in kernels if k[1] > 0]
    by_kind: dict[str, float] = {}
    for name, seconds, _ in kernels:
        kind = kind_of(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + seconds
    heaviest = sorted(kernels, key=lambda k: -k[1])[:top]
    return {
        "busy": sum(k[1] for k in kernels) / wall_s,
        "kinds": {kind: seconds / wall_s for kind, seconds in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "heaviest": [(name[:90], seconds / wall_s, count) for name, seconds, count in heaviest],
    }


def profile_lines(p: dict) -> list[str]:
    """``--profile``'s lines under a row of the strategy table."""
    if not p["kinds"]:
        return ["    profile: no device kernels (a CPU run)"]
    kinds = ", ".join(f"{kind} {share:.1%}" for kind, share in p["kinds"].items())
    lines = [f"    device kernels {p['busy']:.1%} of the wall time ({PROFILED_STEPS} steps): {kinds}"]
    lines += [f"      {share:6.1%} x{count:<5} {name}" for name, share, count in p["heaviest"]]
    return lines


def strategy_table(args) -> None:
    """Tokens/s and MFU of DDP and FSDP, compile off and on, on every GPU of the machine."""
    import json
    import socket

    import torch.multiprocessing as mp

    cuda = args.device == "cuda"
    world = torch.cuda.device_count() if cuda else 2
    size = "gpt2" if cuda else "cpu"
    params = task_params(size, args.batches)
    params["packing"] = args.packing or params["packing"]
    attentions = args.attention or [params.get("attention", "sdpa")]
    if "flex" in attentions and not cuda:
        raise SystemExit("bench_gpu.py: --attention flex is for CUDA (FlexAttention has no backward on CPU)")
    peak = peak_tflops(args.peak_tflops) if cuda else float("nan")
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="bench-gpu-"))
    task = LMTask(**params)
    for attention in attentions:  # an attention the packing cannot take is refused here
        LMTask(**{**params, "attention": attention})
    task.prepare(data_dir)
    flops_per_token = float("nan")
    if cuda:
        sample = load_batches(task, data_dir)[: args.batches]
        flops_per_token = flops_per_step(task, sample) / (sum(b[2] for b in sample) / len(sample))
    name = device_line(torch.device("cuda" if cuda else "cpu"))
    print(f"{world} x {name}, peak {peak:g} TFLOP/s dense bf16 each, torch {torch.__version__}, model {size}")
    print(
        f"{'strategy':>8} {'compile':>7} {'scope':>6} {'packing':>8} {'attn':>5} {'ahead':>5} {'params':>7} {'tokens/step':>11} {'step ms':>8} {'tok/s':>10} "
        f"{'MFU':>6} {'wait':>6} {'mem GiB':>7}"
    )
    rows = [
        (strategy, compiled, scope if compiled == "on" else "-", attention, ahead)
        for strategy in args.strategies
        for compiled in args.compiles
        for scope in (args.scopes if compiled == "on" else ["-"])
        for attention in attentions
        for ahead in args.prefetch
    ]
    for strategy, compiled, scope, attention, ahead in rows:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        out = Path(tempfile.mkdtemp(prefix="bench-gpu-")) / "result.json"
        spec = dict(
            device=args.device,
            params={**params, "attention": attention},  # the FLOPs above: attention over whole rows
            dtype="bf16",
            strategy=strategy,
            compile=compiled == "on",
            scope=scope if compiled == "on" else "blocks",
            profile=args.profile,
            prefetch=ahead,
            data_dir=str(data_dir),
            batches=args.batches,
            warmup=args.warmup,
            steps=args.steps,
        )
        mp.spawn(_strategy_worker, args=(world, port, spec, str(out)), nprocs=world, join=True)
        r = json.loads(out.read_text())
        mfu = r["tok_s"] * flops_per_token / (peak * 1e12 * world)
        print(
            f"{strategy:>8} {compiled:>7} {scope:>6} {params['packing']:>8} {attention:>5} {ahead:>5} {r['params_m']:>6.1f}M {r['tokens']:>11.0f} "
            f"{r['step_ms']:>8.1f} {r['tok_s']:>10.0f} {mfu:>6.1%} {r['wait_share']:>6.1%} {r['mem_gib']:>7.1f}",
            flush=True,
        )
        if r["profile"] is not None:
            print("\n".join(profile_lines(r["profile"])), flush=True)


def device_line(device: torch.device) -> str:
    """The device's name, whether it computes bf16 natively and what precision.dtype=auto makes of it."""
    hw = precision.hardware(device)
    native = "native" if hw.native_bf16 else "no native"
    return f"{hw.name} ({native} bf16: precision.dtype=auto -> {precision.resolve('auto', hw)[0]})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["small", "gpt"], choices=[*SIZES, "gpt2"])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=sorted(DTYPES))
    ap.add_argument("--runs", type=int, default=3, help="runs; the table gives each run's ratio and the median")
    ap.add_argument("--repeats", type=int, default=5, help="alternated blocks per runner in a run")
    ap.add_argument("--steps", type=int, default=20, help="steps per block")
    ap.add_argument(
        "--warmup", type=int, default=20, help="steps per runner before timing (at least every batch timed)"
    )
    ap.add_argument("--batches", type=int, default=200, help="distinct packed batches cycled through")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (dynamic shapes)")
    ap.add_argument(
        "--profile", action="store_true", help="the heaviest GPU ops first; --strategies: the device's time by kind"
    )
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak")
    ap.add_argument("--data-dir", default=None, help="where the LM Parquet goes (default: a temporary directory)")
    ap.add_argument("--strategies", nargs="+", choices=["ddp", "fsdp"], help="the DDP/FSDP table on every GPU")
    ap.add_argument("--compiles", nargs="+", default=["off", "on"], choices=["off", "on"], help="for --strategies")
    ap.add_argument("--packing", choices=["variable", "fixed"], help="for --strategies (default: the recipe's)")
    ap.add_argument(
        "--scopes", nargs="+", default=["blocks"], choices=["blocks", "model"], help="compile.scope, for --strategies"
    )
    ap.add_argument(
        "--attention", nargs="+", choices=["sdpa", "flex"], help="for --strategies (default: the recipe's, sdpa)"
    )
    ap.add_argument(
        "--prefetch",
        nargs="+",
        type=int,
        default=[2],
        help="data.prefetch_batches, for --strategies (0: read and collated on the loop's thread)",
    )
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a gloo check of --strategies")
    args = ap.parse_args()
    if args.strategies:
        strategy_table(args)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1)  # as a one-GPU Ray Train worker runs
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = peak_tflops(args.peak_tflops)
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="bench-gpu-"))
    print(
        f"{device_line(torch.device('cuda'))}, peak {peak:g} TFLOP/s dense bf16, torch {torch.__version__}, "
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
