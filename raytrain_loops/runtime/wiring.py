"""The loop wired in one training process, without Ray: what a Ray Train worker
(:mod:`raytrain_loops.worker.train`) and a local run (:mod:`raytrain_loops.runtime.local`) do
alike. Threads, seeds, ``precision.dtype=auto`` decided, the task's model built, the engine, the
restore, the callbacks and the loop; each caller brings its model preparation (DDP or FSDP on Ray,
none locally), its batch source and its reporter.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from raytrain_loops import storage
from raytrain_loops.callbacks.faults import Faults
from raytrain_loops.callbacks.mlflow_log import MlflowLog, TrackedRun
from raytrain_loops.callbacks.profiler import Profile
from raytrain_loops.callbacks.run_log import RunLog, kept_files
from raytrain_loops.callbacks.spike_guard import SpikeGuard
from raytrain_loops.callbacks.throughput import Throughput, plain_copy
from raytrain_loops.config import Config
from raytrain_loops.console.feed import Sender
from raytrain_loops.engine import Engine, unwrap
from raytrain_loops.engine.api import checked_criterion, checked_evaluate
from raytrain_loops.engine.length import accum_steps, epochs_in_run, total_steps
from raytrain_loops.engine.loop import Loop, LoopSettings, Position
from raytrain_loops.engine.rng import seed_everything
from raytrain_loops.engine.update import precision
from raytrain_loops.engine.update.micro import Resize
from raytrain_loops.rundir.layout import MICRO_BATCH_FILE, PRECISION_FILE
from raytrain_loops.rundir.stops import StopBoard
from raytrain_loops.tasks import MapSplit, ParquetSplit, Task


@dataclass
class WorkerPayload:
    """What the driver sends every worker: the run's config, the task, its data and where the
    run's files go; ``stops``, where a worker posts a stop that a retry cannot fix (None locally).
    ``init_checkpoint`` starts a new run from another run's checkpoint; ``tracking``, the MLflow
    run rank 0 logs to."""

    config: Config
    task: Task
    splits: dict[str, ParquetSplit | MapSplit]
    rows: dict[str, int]
    run_dir: str
    stops: StopBoard | None
    init_checkpoint: str | None = None
    console: Sender | None = None
    tracking: TrackedRun | None = None
    precision_warned: bool = False  # the driver warned of an emulated bf16 before Ray started


def set_threads(config: Config) -> None:
    threads = config.scaling.threads_per_worker or max(1, int(config.scaling.cpus_per_worker))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # Ray does not set it
    torch.set_num_threads(threads)


def resolve_precision(payload: WorkerPayload, rank: int, sender: Sender, device: torch.device) -> Config:
    """The config with ``precision.dtype=auto`` resolved on this group's device (rank 0 decides;
    a run that resolved it before keeps that dtype, recorded in ``precision.json``), announced on
    the console by rank 0, with a warning for an explicit bf16 that this CPU emulates."""
    config, run_dir = payload.config, payload.run_dir
    requested = config.precision.dtype
    record_path = storage.join(run_dir, PRECISION_FILE)
    recorded = None
    if rank == 0 and requested == "auto" and payload.init_checkpoint is None:
        text = storage.read_text(record_path)
        earlier = json.loads(text) if text else {}
        if earlier.get("requested") == "auto":
            recorded = earlier.get("dtype")
    dtype, reason = precision.decide(requested, device, recorded)
    if rank == 0:
        hw = precision.hardware(device)
        if requested == "auto":
            sender.send("start", f"precision: auto -> {dtype} ({reason})")
        elif dtype == "bf16" and hw.kind == "cpu" and not hw.native_bf16 and not payload.precision_warned:
            sender.send("start", precision.emulated_warning(hw))
        if recorded is None:  # a dtype taken from the record keeps the record of its first start
            record = {"requested": requested, "dtype": dtype, "reason": reason, "device": hw.name}
            storage.write_text(record_path, json.dumps(record) + "\n")
    return dataclasses.replace(config, precision=dataclasses.replace(config.precision, dtype=dtype))


def announce_start(reporter, engine: Engine, config: Config, world: int, scale: float, sender: Sender, run_dir: str):
    """Rank 0: record what was restored (``init.json``) and tell the console of a resume or of a
    group running short of workers."""
    if reporter.loaded:
        storage.write_text(storage.join(run_dir, "init.json"), json.dumps(reporter.loaded) + "\n")
        if reporter.loaded.get("checkpoint"):
            sender.send("start", f"resumed at step {engine.step} from {reporter.loaded['checkpoint']}")
    if world != config.scaling.workers:
        k = accum_steps(config.accum, engine.epoch, scale)
        sender.send("start", f"{world} of {config.scaling.num_workers} workers: {k} micro-batches per update")


def micro_batches(engine: Engine, run_dir: str, rank: int, sender: Sender) -> None:
    """``accum.micro_batch=auto``: start from the smaller of the restored checkpoint's micro-batch
    and the one recorded after the latest OOM (a group restarted because an OOM broke its
    collectives: only the failing worker knew, and recorded it before raising), and record and
    announce every change (rank 0, or the failing worker alone before a restart)."""
    if not engine.micro.auto:
        return
    path = storage.join(run_dir, MICRO_BATCH_FILE)
    text = storage.read_text(path)
    engine.micro.splits = max(engine.micro.splits, int(json.loads(text)["splits"]) if text else 1)
    if rank == 0 and engine.micro.splits > 1:
        sender.send("start", f"micro-batches: each batch split in {engine.micro.splits} (accum.micro_batch=auto)")

    def record(resize: Resize) -> None:
        if rank == 0 or resize.restart:
            storage.write_text(path, json.dumps(dataclasses.asdict(resize)) + "\n")
            sender.send("micro_batch", resize.line())

    engine.micro.on_resize = record


def callbacks(
    payload: WorkerPayload,
    engine: Engine,
    faults: Faults,
    sender: Sender,
    rank: int,
    world: int,
    total: int,
    plain: torch.nn.Module,
    loaded: dict | None,
    criterion: Any,
):
    """The loop callbacks of a run: the run log (keeping of the earlier attempts' files what
    the restore, ``loaded``, says), the spike guard, faults, throughput (its FLOPs counted on
    ``plain``, the model as the task built it, with ``criterion``, the task's), the profiler and,
    when tracked, MLflow."""
    config, task = payload.config, payload.task
    log = RunLog(
        payload.run_dir,
        rank,
        total,
        config.run.progress,
        engine.step,
        world,
        config.logging.smoothing,
        config.logging.every_steps,
        kept_files(loaded, engine.callback_state),
        config.logging.system_series,
    )
    log.sender = sender
    counts = task.counts if task.count_keys else None
    callbacks = [
        log,
        SpikeGuard(config.spike),
        faults,
        Throughput(config.logging.throughput, engine, criterion, counts, plain),
    ]
    callbacks.append(Profile(config.logging.profile, payload.run_dir, rank, engine.device))
    if payload.tracking is not None:
        callbacks.append(MlflowLog(payload.tracking, rank, system_series=config.logging.system_series))
    return callbacks


@dataclass
class Wired:
    """A training process ready to run: ``loop.run(position)``."""

    engine: Engine
    loop: Loop
    reporter: Any
    position: Position


def task_engine(
    task: Task,
    model: torch.nn.Module,
    config: Config,
    batches_per_epoch: int,
    *,
    scale: float = 1.0,
    criterion: Any = None,
    groups: list[dict[str, Any]] | None = None,
    ema_module: torch.nn.Module | None = None,
) -> Engine:
    """The engine a worker builds for ``task`` over ``model``: the task's criterion (or
    ``criterion``), its parameter groups under ``optim.param_groups=task`` (or ``groups``, taken
    after sharding), counts, ``after_step`` and batch splitting; the run's updates and epochs for
    ``batches_per_epoch`` batches an epoch (``scale``: an elastic group's micro-batches per batch)."""
    if groups is None and config.optim.param_groups == "task":
        groups = task.param_groups(model)
    return Engine(
        model,
        criterion or task.criterion,
        config.engine,
        total_steps=total_steps(config.loop, config.accum, batches_per_epoch, scale),
        total_epochs=epochs_in_run(config.loop, config.accum, batches_per_epoch, scale),
        task_param_groups=groups,
        counts=task.counts if task.count_keys else None,
        count_keys=task.count_keys,
        after_step=task.after_step,
        ema_module=ema_module,
        split_batch=task.split_batch,
    )


def wire(
    payload: WorkerPayload,
    rank: int,
    world: int,
    device: torch.device,
    sender: Sender,
    *,
    prepare_model: Callable[[torch.nn.Module, Task, Config], tuple[torch.nn.Module, torch.nn.Module | None]],
    batches: Callable[..., Any],
    reporter: Callable[[Engine], Any],
    before_data: Callable[[], None] = lambda: None,
) -> Wired:
    """Set this process up as worker ``rank`` of ``world`` on ``device`` and build its loop:
    ``prepare_model`` wraps or shards the task's model (returns it and the EMA's sharded copy,
    if any); ``before_data`` runs once the model is ready (a Ray worker checks the stops posted
    by an earlier attempt there); ``batches(task, config, splits, rows, rank, world)`` is the
    batch source; ``reporter(engine)`` writes checkpoints and restores the run's newest."""
    payload = dataclasses.replace(payload, config=resolve_precision(payload, rank, sender, device))
    config, task, run_dir = payload.config, payload.task, payload.run_dir
    set_threads(config)

    seed_everything(config.loop.seed)  # identical initial weights on every worker
    model = task.build_model()
    plain = plain_copy(model, "meta")  # shapes only: the FLOP count's model, whatever the sharding
    model, ema_module = prepare_model(model, task, config)
    # After sharding: fully_shard replaces the parameters, and the groups must hold the new ones.
    groups = task.param_groups(unwrap(model)) if config.optim.param_groups == "task" else None
    before_data()
    seed_everything(config.loop.seed + 1 + rank)  # distinct dropout and augmentation per worker

    source = batches(task, config, payload.splits, payload.rows, rank, world)
    scale = config.scaling.workers / world  # > 1 when an elastic group runs short
    faults = Faults(config.fault.plan, rank, run_dir)
    criterion = checked_criterion(task.criterion, f"{type(task).__name__}.criterion")
    engine = task_engine(
        task,
        model,
        config,
        source.batches_per_epoch,
        scale=scale,
        criterion=faults.wrap_loss(criterion),
        groups=groups,
        ema_module=ema_module,
    )
    made = reporter(engine)
    made.data = source  # checkpoints record, and resume from, the source's data positions
    position = made.restore(payload.init_checkpoint) or Position()
    micro_batches(engine, run_dir, rank, sender)
    if rank == 0:
        announce_start(made, engine, config, world, scale, sender, run_dir)
    cbs = callbacks(payload, engine, faults, sender, rank, world, engine.total_steps, plain, made.loaded, criterion)
    evaluate = checked_evaluate(task.evaluate, f"{type(task).__name__}.evaluate")
    loop = Loop(engine, source, made, LoopSettings.of(config), evaluate, cbs, scale, task.eval_metrics)
    return Wired(engine, loop, made, position)
