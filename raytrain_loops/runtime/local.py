"""Local mode (``scaling.num_workers=0``): the loop of one worker in the calling process, without
Ray. The same wiring as a Ray worker (:func:`raytrain_loops.runtime.wiring.wire`), the same
batches as a one-worker Ray run (Parquet splits in the epoch's plan, ``Task.preprocess`` applied
in this process), checkpoints in the run directory's layout, so that a local run continues on a
cluster and a cluster's run continues here. Ray is not imported on this path.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from raytrain_loops.checkpoint import checkpoint_dirs
from raytrain_loops.checkpoint.local_reporter import LocalReporter
from raytrain_loops.config import Config, ConfigError
from raytrain_loops.console.display import Display
from raytrain_loops.console.feed import Sender
from raytrain_loops.engine.distributed import sharding
from raytrain_loops.errors import TrainingError, TrainingStopped
from raytrain_loops.runtime.batches import Batches, preprocessed_here
from raytrain_loops.runtime.evaluate import evaluate_checkpoint
from raytrain_loops.runtime.wiring import WorkerPayload, wire
from raytrain_loops.tasks import Task


class DisplaySender(Sender):
    """The console events of rank 0 and of what stands for Ray's controller, shown on this
    process's display as the driver's console shows them."""

    def __init__(self, display: Display):
        super().__init__(None)
        self.display = display

    def send(self, kind: str, text: str, **data: Any) -> None:
        self.display.show({"kind": kind, "text": text, **data})


def local_device(config: Config) -> torch.device:
    if not config.scaling.use_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("scaling.use_gpu", "local mode found no CUDA device in this process")
    return torch.device("cuda", torch.cuda.current_device())


def _prepare_model(module: torch.nn.Module, task: Task, config: Config) -> tuple[torch.nn.Module, None]:
    """Checkpointing and compilation of the task's blocks, on this process's device. One process
    holds the whole model: ``scaling.strategy=fsdp`` trains it unsharded and checkpoints it whole,
    which a run under FSDP shards again when it continues from it."""
    sharding.prepare_model(module, task.blocks(module), checkpointing=config.checkpointing, compile_cfg=config.compile)
    return module.to(local_device(config)), None


def train_local(payload: WorkerPayload) -> tuple[dict[str, Any], str | None]:
    """Run the loop in this process as the only worker; return the last reported metrics and the
    newest checkpoint. The task's own errors are raised here with their own tracebacks; an
    error of the :class:`~raytrain_loops.errors.TrainingError` family (non-finite values,
    a loss spike) as :class:`~raytrain_loops.errors.TrainingStopped`, as on Ray."""
    device = local_device(payload.config)
    display = Display()
    sender = DisplaySender(display)
    with _callers_state(), _sigterm_interrupts():
        try:
            return _run(payload, device, sender)
        finally:
            display.close()


def evaluate_local(payload: WorkerPayload) -> dict[str, Any]:
    """``raytrain-loops evaluate --local``: ``payload.init_checkpoint`` evaluated in this process as
    the only worker (:func:`~raytrain_loops.runtime.evaluate.evaluate_checkpoint`), with a local
    run's model preparation and batches."""
    device = local_device(payload.config)
    with _callers_state():
        batches = functools.partial(_batches, device=device)
        return evaluate_checkpoint(payload, 0, 1, device, prepare_model=_prepare_model, batches=batches)


def _run(payload: WorkerPayload, device: torch.device, sender: Sender) -> tuple[dict[str, Any], str | None]:
    wired = wire(
        payload,
        0,
        1,
        device,
        sender,
        prepare_model=_prepare_model,
        batches=functools.partial(_batches, device=device),
        reporter=functools.partial(LocalReporter, run_dir=payload.run_dir, config=payload.config, sender=sender),
    )
    try:
        wired.loop.run(wired.position)
    except TrainingError as err:
        raise TrainingStopped(type(err).__name__, str(err), wired.engine.step) from err
    newest = checkpoint_dirs(payload.run_dir)
    return wired.reporter.metrics, wired.reporter.checkpoint or (newest[-1] if newest else None)


@contextlib.contextmanager
def _callers_state() -> Iterator[None]:
    """The run sets torch's thread count, ``OMP_NUM_THREADS`` and the random generators' seeds of
    this process as a worker's; the caller's are given back when it ends."""
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """A SIGTERM stops the run as a Ctrl-C does (``fit`` then names the last checkpoint), on the
    main thread; elsewhere it keeps its handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _batches(task: Task, config: Config, splits: dict[str, Any], rows: dict[str, int], rank: int, world: int, device):
    return Batches(task, config, splits, rows, rank, world, device, preprocessed_here)
