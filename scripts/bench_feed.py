#!/usr/bin/env python
"""Where the ``lm_gpt`` recipe's training step goes, as the loop runs it, beside a bare loop.

``step``: the recipe wired as local mode wires it (its Parquet batches, its callbacks, its
engine), ``--steps`` updates timed after ``--warmup``, and each update cut into its parts:
the loop's wait for its batch, the engine's forward and backward, its all-reduce with
the decision's host read, its optimizer update (clipping included), and the loop's own work
(the update's time less the engine's and the wait: meters, callbacks, reports); ``collate`` runs on
the collate-ahead thread (``data.prefetch_batches``, 2), outside the update, and is given apart.
The same run again with ``data.prefetch_batches=0`` (read and collated in the loop's thread) gives
the loop's wait without the thread, the baseline of the wait. Beside them, in
the same run, the same update as a bare loop (the same Parquet rows read and collated, copied to
the device, forward through the blocks, the head and its loss, backward, one all-reduce and its
host read, clipping, AdamW), its parts timed alike. On CUDA every part ends with a
synchronisation, so that the GPU's time falls in the part that queued it. The loop's own work is
reported as a share of the bare step (target: at most 2%, median of ``--runs`` runs).

``data``: the ``lm`` Parquet path's rate on one CPU core, read plus collate, at the recipe's
full shapes and vocabulary (a first pass and a steady one), beside the rate one H100 needs at the
issue's 35% MFU and the project's 45% (FLOPs a token counted on the ``meta`` device).

    python scripts/bench_feed.py                       # both parts, at the CPU size (about a minute)
    python scripts/bench_feed.py --size full --device cuda --parts step
    OUT=/some/dir python scripts/bench_feed.py         # figures also written to $OUT/bench_feed.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from raytrain_loops.config import load_config
from raytrain_loops.driver.preflight import prepare
from raytrain_loops.engine.distributed import collectives
from raytrain_loops.engine.distributed.sharding import prepare_model
from raytrain_loops.engine.loop import Callback
from raytrain_loops.recipes import resolve
from raytrain_loops.runtime import local
from raytrain_loops.runtime.batches import Batches, preprocessed_here
from raytrain_loops.runtime.wiring import WorkerPayload, wire
from raytrain_loops.tasks.gpt import document_mask
from raytrain_loops.tasks.lm import IGNORE, LMTask

# The recipe at a width and vocabulary a 2-core CPU steps through in well under a second.
CPU_SIZE = ["task.params.dim=128", "task.params.layers=2", "task.params.heads=4", "task.params.vocab=4096"]
CPU_SIZE += ["task.params.max_tokens=2048"]
H100_BF16_TFLOPS = 989.4
OWN = "loop's own work"
COLLATE = "collate (its own thread)"  # not a part of the loop's update


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Parts:
    """Seconds per named part, summed; :meth:`timed` wraps a callable into one."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self.on = device, defaultdict(float), False

    def timed(self, name: str, fn, synced: bool = True):
        """``fn`` timed into ``name``; ``synced``: the device's queued work in it (not for a part
        that runs on another thread, which would wait for the step's kernels)."""

        def run(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if synced:
                    sync(self.device)
                self.seconds[name] += time.perf_counter() - start

        return run


class Clock(Callback):
    """The update period: from one update's end to the next, ``steps`` updates after ``warmup``."""

    def __init__(self, parts: Parts, warmup: int, steps: int):
        self.parts, self.warmup, self.steps, self.ends, self.waits = parts, warmup, steps, [], 0.0

    def on_step(self, result, step, epoch):
        sync(self.parts.device)
        self.ends.append(time.perf_counter())
        if len(self.ends) == self.warmup:
            self.parts.on = True  # the parts count from the next update on
        elif len(self.ends) > self.warmup:
            self.waits += result.data_time
        if len(self.ends) == self.warmup + self.steps:
            self.parts.on = False  # the run's last evaluation and checkpoint are not the update's


def config_for(args, tmp: Path, steps: int, *more: str):
    size = CPU_SIZE if args.size == "cpu" else []
    tokens = (steps + 8) * (2048 if args.size == "cpu" else 16384)
    overrides = [
        *size,
        f"task.params.tokens={tokens}",
        "scaling.num_workers=0",
        f"scaling.use_gpu={args.device == 'cuda'}",
        f"compile.enabled={args.compile}",
        f"precision.dtype={'bf16' if args.device == 'cuda' else 'fp32'}",  # the bare loop's too
        f"loop.max_steps={steps}",
        f"data.dir={tmp / 'data'}",
        f"run.storage_path={tmp / 'runs'}",
        "checkpoint.every_steps=1000000",  # the run's last alone, after the timed updates
        *more,
    ]
    return load_config(resolve("lm_gpt"), overrides)


def loop_run(args, tmp: Path, run: int, *overrides: str) -> dict:
    """One run of the recipe through the loop; the update's parts in ms."""
    device = torch.device(args.device)
    config = config_for(args, tmp, args.warmup + args.steps, *overrides)
    task, splits, rows = prepare(config, None)
    run_dir = tmp / "runs" / f"loop{run}{'-'.join(overrides)}"
    run_dir.mkdir(parents=True)
    sender = local.DisplaySender(local.Display())
    wired = wire(
        WorkerPayload(config, task, splits, rows, str(run_dir), None),
        0,
        1,
        device,
        sender,
        prepare_model=local._prepare_model,
        batches=functools.partial(local._batches, device=device),
        reporter=functools.partial(local.LocalReporter, run_dir=str(run_dir), config=config, sender=sender),
    )
    parts, engine = Parts(device), wired.engine
    task.collate = parts.timed("collate", task.collate, synced=False)
    engine._forward_backward = parts.timed("forward and backward", engine._forward_backward)
    engine._reduce = parts.timed("all-reduce and host read", engine._reduce)
    engine._apply = parts.timed("clip and optimizer", engine._apply)
    engine.train_step = parts.timed("engine", engine.train_step)
    clock = Clock(parts, args.warmup, args.steps)
    wired.loop.callbacks.append(clock)
    wired.loop.run(wired.position)
    n = args.steps
    total = clock.ends[-1] - clock.ends[args.warmup - 1]
    ms = {k: v / n * 1e3 for k, v in parts.seconds.items()}
    out = {
        "update": total / n * 1e3,
        "wait for the batch": clock.waits / n * 1e3,
        "forward and backward": ms["forward and backward"],
        "all-reduce and host read": ms["all-reduce and host read"],
        "clip and optimizer": ms["clip and optimizer"],
    }
    engine_rest = ms["engine"] - sum(
        ms[k] for k in ("forward and backward", "all-reduce and host read", "clip and optimizer")
    )
    out["engine's other work"] = engine_rest
    out[OWN] = out["update"] - ms["engine"] - clock.waits / n * 1e3
    out[COLLATE if config.data.prefetch_batches else "collate (in the wait)"] = ms["collate"]
    return out


def bare_run(args, tmp: Path) -> dict:
    """The same updates as a hand-written loop over the same Parquet rows; its parts in ms."""
    import pyarrow.parquet as pq

    device = torch.device(args.device)
    config = config_for(args, tmp, args.warmup + args.steps)
    task = LMTask(**config.task.params)
    task.prepare(Path(config.data.dir))
    torch.manual_seed(0)
    model = task.build_model()
    prepare_model(model, task.blocks(model), compile_cfg=config.compile)
    model = model.to(device)
    params = list(model.parameters())
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    dtype = torch.bfloat16 if device.type == "cuda" else None
    parquet = pq.ParquetFile(task.splits(Path(config.data.dir))["train"].path)
    seconds: dict[str, float] = defaultdict(float)

    def part(name: str, start: float) -> float:
        sync(device)
        now = time.perf_counter()
        seconds[name] += now - start
        return now

    batches = parquet.iter_batches(batch_size=1, columns=["tokens", "lengths"])
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            seconds.clear()
        t = time.perf_counter()
        rows = next(batches).to_pydict()
        t = part("read", t)
        batch = task.collate({k: [v[0]] for k, v in rows.items()})
        t = part("collate", t)
        inputs, targets, ntokens, *documents = (
            b.to(device, non_blocking=True) if torch.is_tensor(b) else b for b in batch
        )
        t = part("copy to the device", t)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            x = trunk(model, inputs, *documents)
            t = part("forward: blocks", t)
            logits = model.head(model.norm(x))
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
            t = part("forward: head and loss", t)
        loss.backward()
        t = part("backward", t)
        packed = torch.stack([torch.as_tensor(float(ntokens), device=device), loss.detach().double()])
        collectives.all_reduce_sum(packed)
        total_tokens, _ = packed.tolist()
        t = part("all-reduce and host read", t)
        torch._foreach_mul_([p.grad for p in params], 1.0 / total_tokens)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        part("clip and optimizer", t)
    return {k: v / args.steps * 1e3 for k, v in seconds.items()}


def trunk(model, tokens, documents=None):
    """The model's forward through its blocks (the GPT's own forward, less the norm and head)."""
    x = model.embed(tokens)
    mask = None if documents is None else document_mask(documents)
    for block in model.blocks:
        x = block(x, mask)
    return x


def step_part(args, tmp: Path) -> dict:
    runs = []
    for r in range(args.runs):
        loop = loop_run(args, tmp / f"run{r}", r)
        inline = loop_run(args, tmp / f"run{r}", r, "data.prefetch_batches=0")
        bare = bare_run(args, tmp / f"run{r}")
        bare_step = sum(bare.values())
        runs.append(
            {"loop": loop, "inline": inline, "bare": bare, "bare_step": bare_step, "ratio": loop[OWN] / bare_step}
        )
        print(
            f"run {r + 1}: loop update {loop['update']:.2f} ms, bare step {bare_step:.2f} ms, "
            f"loop's own work {loop[OWN]:.3f} ms = {runs[-1]['ratio']:.2%} of the bare step; the update with prefetch_batches=0 "
            f"{inline['update']:.2f} ms; the loop's wait "
            f"for its batch {loop['wait for the batch']:.3f} ms collated ahead, "
            f"{inline['wait for the batch']:.3f} ms in its thread (prefetch_batches=0)",
            flush=True,
        )
    mid = sorted(runs, key=lambda x: x["ratio"])[len(runs) // 2]
    print(f"\nthe median run's parts ({args.size} size, {args.device}), ms per update and share:")
    for name, table in (("the loop", mid["loop"]), ("the bare loop", mid["bare"])):
        whole = table["update"] if "update" in table else mid["bare_step"]
        print(f"  {name}: {whole:.2f} ms")
        for k, v in table.items():
            if k == COLLATE:
                print(f"    {k:<28} {v:9.3f} ms (outside the update)")
            elif k != "update":
                print(f"    {k:<28} {v:9.3f} ms {v / whole:7.1%}")
    ratios = [x["ratio"] for x in runs]
    waits = {k: [x[k]["wait for the batch"] for x in runs] for k in ("loop", "inline")}
    print(
        f"the loop's wait for its batch: collated ahead median {statistics.median(waits['loop']):.3f} ms "
        f"(runs {', '.join(f'{x:.3f}' for x in waits['loop'])}), in its own thread median "
        f"{statistics.median(waits['inline']):.3f} ms (runs {', '.join(f'{x:.3f}' for x in waits['inline'])})"
    )
    print(
        f"loop's own work / bare step: median {statistics.median(ratios):.2%} "
        f"(runs {', '.join(f'{x:.2%}' for x in ratios)}; target at most 2%)"
    )
    return {"runs": runs, "median_ratio": statistics.median(ratios)}


def flops_per_token(task: LMTask, batch) -> float:
    """Forward and backward FLOPs a target token of ``batch``, counted on the ``meta`` device."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = task.build_model()
    meta = tuple(b.to("meta") if torch.is_tensor(b) else b for b in batch)
    counter = FlopCounterMode(display=False)
    with counter:
        task.criterion(model, meta, None).loss.backward()
    return counter.get_total_flops() / batch[2]


def _steady(rates: list[float]) -> float:
    """The median of the passes after the first (a cold one), or the one pass."""
    return statistics.median(rates[1:]) if len(rates) > 1 else rates[0]


def data_part(args, tmp: Path) -> dict:
    """The Parquet path's tokens/s on one core at the recipe's full shapes and vocabulary."""
    import pyarrow

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # this process, all its threads, on one core
    torch.set_num_threads(1)
    pyarrow.set_cpu_count(1)
    pyarrow.set_io_thread_count(1)
    config = load_config(
        resolve("lm_gpt"),
        [f"task.params.tokens={args.data_tokens}", f"data.dir={tmp / 'data'}", "scaling.num_workers=1"],
    )
    task, splits, rows = prepare(config, None)
    inline = dataclasses.replace(config, data=dataclasses.replace(config.data, prefetch_batches=0))
    # The worker's path (collated ahead on a thread) and, alternating with it, all in this thread.
    sources = [Batches(task, c, splits, rows, 0, 1, "cpu", preprocessed_here) for c in (config, inline)]
    rates, walls, baseline = [], [], []  # tokens per second of the process's CPU time (its one core's), and of wall time
    for epoch in range(args.data_epochs):
        for source, out in zip(sources, (rates, baseline), strict=True):
            start, cpu, tokens = time.perf_counter(), time.process_time(), 0
            for batch in source.batches("train", epoch):
                tokens += batch[2]
            out.append(tokens / (time.process_time() - cpu))
            if out is rates:
                walls.append(tokens / (time.perf_counter() - start))
    per_token = flops_per_token(task, batch)
    need = {mfu: mfu * H100_BF16_TFLOPS * 1e12 / per_token for mfu in (0.35, 0.45)}
    steady, steady_inline = _steady(rates), _steady(baseline)
    print(
        f"\nthe lm path, read plus collate on one core ({args.data_tokens:,} tokens, vocab {task.vocab}, "
        f"{task.max_tokens // task.max_len} x {task.max_len} a batch), tokens per CPU-second: first pass "
        f"{rates[0]:,.0f}, steady {steady:,.0f} (passes {', '.join(f'{r:,.0f}' for r in rates[1:])}); "
        f"per wall second, the core shared with whatever else runs: {', '.join(f'{r:,.0f}' for r in walls)}"
    )
    print(
        f"the same passes all in one thread (data.prefetch_batches=0), alternating with those: steady "
        f"{steady_inline:,.0f} (passes {', '.join(f'{r:,.0f}' for r in baseline)}): the threads' cost "
        f"{steady_inline / steady:.2f}x the CPU time"
    )
    print(
        f"one H100 ({H100_BF16_TFLOPS} TFLOP/s dense bf16) at {per_token / 1e6:.0f} MFLOP a token needs "
        f"{need[0.35]:,.0f} tokens/s at 35% MFU, {need[0.45]:,.0f} at 45%: one core gives "
        f"{steady / need[0.35]:.1f}x / {steady / need[0.45]:.1f}x"
    )
    return {
        "first": rates[0],
        "steady": steady,
        "steady_one_thread": steady_inline,
        "passes_one_thread": baseline,
        "passes": rates,
        "wall": walls,
        "flops_per_token": per_token,
        "need": need,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", default=["step", "data"], choices=["step", "data"])
    ap.add_argument("--size", default="cpu", choices=["cpu", "full"], help="cpu: dim 128, 2 layers, vocab 4096")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--compile", action="store_true", help="compile.enabled=true (the recipe's blocks)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed updates a run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--data-tokens", type=int, default=4_000_000, help="tokens in the data part's split")
    ap.add_argument("--data-epochs", type=int, default=3, help="passes of the data part (the first is cold)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_feed.py --device cuda: no CUDA device here")
    out = {"args": vars(args), "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="bench-feed-") as tmp:
        if "step" in args.parts:
            out["step"] = step_part(args, Path(tmp) / "step")
        if "data" in args.parts:
            out["data"] = data_part(args, Path(tmp) / "data")
    if os.environ.get("OUT"):
        path = (
            Path(os.environ["OUT"]) / f"bench_feed_{args.size}_{args.device}{'_compiled' if args.compile else ''}.json"
        )
        path.write_text(json.dumps(out, indent=1, default=str))
        print(f"figures written to {path}")


if __name__ == "__main__":
    main()
