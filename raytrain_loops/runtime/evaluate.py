"""A checkpoint evaluated again, without Ray: one process of a group (a Ray worker, or the only one in
local mode) builds the run's model as training did, loads the checkpoint's model and EMA weights
(every worker together, as a resumed group does: the same checks, no code unpickled), makes the
workers' buffers the same as the loop does before an evaluation, and evaluates the eval split
through the loop's own :func:`~raytrain_loops.engine.loop.evaluate`.

The run's directory is only read (by the driver: ``config.yaml``, ``precision.json``): nothing is
written there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from raytrain_loops.checkpoint import CheckpointError, CheckpointReporter
from raytrain_loops.config import Config
from raytrain_loops.engine import Engine
from raytrain_loops.engine.api import checked_evaluate
from raytrain_loops.engine.length import epochs_in_run, total_steps
from raytrain_loops.engine.loop import evaluate, sync_buffers
from raytrain_loops.engine.rng import seed_everything
from raytrain_loops.engine.update import precision
from raytrain_loops.runtime.wiring import WorkerPayload, set_threads
from raytrain_loops.tasks import Task


def _decided(config: Config, device: torch.device) -> Config:
    """The config with ``precision.dtype=auto`` decided on this group's device (the caller puts
    in the dtype the run recorded, when it did)."""
    dtype, _ = precision.decide(config.precision.dtype, device)
    return dataclasses.replace(config, precision=dataclasses.replace(config.precision, dtype=dtype))


def evaluate_checkpoint(
    payload: WorkerPayload,
    rank: int,
    world: int,
    device: torch.device,
    *,
    prepare_model: Callable[[torch.nn.Module, Task, Config], tuple[torch.nn.Module, torch.nn.Module | None]],
    batches: Callable[..., Any],
) -> dict[str, float]:
    """Evaluate ``payload.init_checkpoint`` as worker ``rank`` of ``world``: the eval split's
    metrics over all workers (``eval_*``, ``eval_ema_*``), with the checkpoint's ``step`` and
    ``epoch``. ``prepare_model`` and ``batches`` are the caller's, as for
    :func:`~raytrain_loops.runtime.wiring.wire`. A damaged checkpoint raises
    :class:`~raytrain_loops.checkpoint.CheckpointError` naming it."""
    config = _decided(payload.config, device)
    task = payload.task
    set_threads(config)
    seed_everything(config.loop.seed)  # the model built as training built it, before its weights load
    model, ema_module = prepare_model(task.build_model(), task, config)
    source = batches(task, config, payload.splits, payload.rows, rank, world)
    per_epoch = source.batches_per_epoch
    engine = Engine(
        model,
        task.criterion,
        config.engine,
        total_steps=total_steps(config.loop, config.accum, per_epoch),
        total_epochs=epochs_in_run(config.loop, config.accum, per_epoch),
        counts=task.counts if task.count_keys else None,
        count_keys=task.count_keys,
        ema_module=ema_module,
    )
    reporter = CheckpointReporter(engine, rank, world, payload.run_dir)
    if reporter.restore_from([], payload.init_checkpoint) is None:
        raise CheckpointError(f"{payload.init_checkpoint} could not be loaded")
    sync_buffers(engine, config.eval.bn_buffers)
    stream = source.batches("eval", engine.epoch)
    try:
        checked = checked_evaluate(task.evaluate, f"{type(task).__name__}.evaluate")
        metrics = evaluate(engine, stream, checked, config.eval.ema, task.eval_metrics)
    finally:
        closer = getattr(stream, "close", None)
        if callable(closer):
            closer()
    return {**metrics, "step": engine.step, "epoch": engine.epoch}
