"""Run a function on N processes joined in a process group (gloo on CPU, NCCL with one GPU per
process), with a hard deadline.

A worker that hangs makes the test fail (all processes are killed at the deadline) instead of
hanging the suite. Each worker's return value, or the exception it raised, comes back in rank
order.
"""

from __future__ import annotations

import datetime
import faulthandler
import functools
import os
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass
class WorkerOutcome:
    value: Any = None
    error: str | None = None
    message: str = ""
    seconds: float = 0.0  # in ``fn``, after the group was joined: process start-up is left out


def _entry(rank: int, world: int, outdir: str, backend: str, fn, args) -> None:
    # Where a worker is when the deadline finds it running: every thread's stack, on SIGUSR1.
    stacks = open(os.path.join(outdir, f"stacks.rank{rank}.txt"), "w")  # noqa: SIM115 - until the process ends
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # The group meets through a file in its own directory, not a TCP store on a port picked free
    # beforehand: in the suite, Ray's processes bind ports of their own all the time, and a port
    # one of them took in between leaves the other workers' store clients handshaking with a
    # server that never answers, a wait no timeout bounds. gloo's own connections bind theirs.
    dist.init_process_group(
        backend,
        init_method=f"file://{os.path.join(outdir, 'store')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    start = time.perf_counter()
    try:
        outcome = WorkerOutcome(value=fn(rank, world, *args))
    except Exception as err:  # reported to the test, which decides whether it was expected
        outcome = WorkerOutcome(error=type(err).__name__, message=f"{err}\n{traceback.format_exc()}")
    outcome.seconds = time.perf_counter() - start
    torch.save(outcome.__dict__, os.path.join(outdir, f"rank{rank}.pt"))
    if dist.is_initialized():  # a test may destroy it itself (a group torn down mid-step)
        dist.destroy_process_group()


# What every group's processes import, imported once by the server they are forked from.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.nn.parallel",
    "torch._dynamo",  # DistributedDataParallel.__init__ imports it: seconds in every worker otherwise
    "pyarrow.parquet",
    "raytrain_loops.config",
    "raytrain_loops.data",
    "raytrain_loops.engine",
    "raytrain_loops.engine.loop",
    "raytrain_loops.engine.distributed.sharding",
    "raytrain_loops.callbacks.throughput",
    "raytrain_loops.recipes",
    "raytrain_loops.tasks.detr",
    "raytrain_loops.tasks.dino",
    "raytrain_loops.tasks.lm",
    "raytrain_loops.tasks.seamseg",
    "tests.support.fakes",
    "tests.support.gloo",
    "tests.support.recording",
]


@functools.cache
def _context():
    """Processes forked from one server that imported torch, the engine and the tasks at its
    start (``forkserver``): a group's processes start in a fraction of a second, where spawned
    ones would import torch again, a few CPU-seconds each. The server holds no threads and no
    process group. It keeps the environment it started with: a test that needs another
    environment in its workers must pass it as an argument."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


# A group's bound on a hang (gloo's own is 30 minutes): the wall time a second of work can take in
# the suite, at nice 19 beside the Ray tests' bursts of process starts on 2 cores (two workers of
# the torn-down-group test took over 90 s there once, at nice 10). A test may ask for more, never for less.
HANG_FLOOR_S = 300.0


def run_gloo(world: int, fn, *args, timeout: float = HANG_FLOOR_S, daemon: bool = True) -> list[WorkerOutcome]:
    """Run ``fn(rank, world, *args)`` on ``world`` CPU processes; return their outcomes in rank order.
    ``daemon=False`` lets them start processes of their own (DataLoader workers); the deadline
    still kills them."""
    return run_group("gloo", world, fn, *args, timeout=timeout, daemon=daemon)


def _await_stacks(outdir: str, ranks: list[int], bound_s: float = 5.0) -> None:
    """Until each of ``ranks`` has written its stacks (faulthandler, on the SIGUSR1 just sent), at
    most ``bound_s``: a worker not yet in ``_entry`` writes none."""
    deadline = time.monotonic() + bound_s
    paths = [Path(outdir, f"stacks.rank{r}.txt") for r in ranks]
    while time.monotonic() < deadline and not all(p.exists() and p.stat().st_size for p in paths):
        time.sleep(0.05)


def _stacks(outdir: str, rank: int) -> str:
    path = Path(outdir, f"stacks.rank{rank}.txt")
    text = path.read_text() if path.exists() else ""
    return f"worker {rank}'s threads:\n{text or '(none written: not yet in the group)'}\n"


def run_group(backend: str, world: int, fn, *args, timeout: float = HANG_FLOOR_S, daemon: bool = True) -> list[WorkerOutcome]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes joined by ``backend`` (``nccl``: rank r
    on GPU r); return their outcomes in rank order. ``timeout`` bounds a hang, never under
    HANG_FLOOR_S; the workers still running then are reported with their threads' stacks."""
    timeout = max(timeout, HANG_FLOOR_S)
    ctx = _context()
    with tempfile.TemporaryDirectory() as outdir:
        procs = [
            ctx.Process(target=_entry, args=(r, world, outdir, backend, fn, args), daemon=daemon)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        for p in procs:
            p.join(max((deadline - datetime.datetime.now()).total_seconds(), 0.1))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            os.kill(procs[r].pid, signal.SIGUSR1)
        _await_stacks(outdir, hung)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            stacks = "".join(_stacks(outdir, r) for r in hung)
            raise AssertionError(f"workers {hung} of {world} still running after {timeout}s: a hang\n{stacks}")
        outcomes = []
        for r, p in enumerate(procs):
            path = os.path.join(outdir, f"rank{r}.pt")
            if not os.path.exists(path):
                raise AssertionError(f"worker {r} exited with code {p.exitcode} and reported nothing")
            outcomes.append(WorkerOutcome(**torch.load(path, weights_only=True)))
        return outcomes
