"""What Ray Train runs on every worker: set the worker up, then hand the loop its Ray adapters.

The loop itself is :class:`raytrain_loops.engine.loop.Loop` (no Ray); here it gets this worker's
batches (:class:`~raytrain_loops.worker.batches.RayBatches`), a reporter that writes checkpoint
files and calls ``ray.train.report`` (:class:`~raytrain_loops.worker.reporter.RayReporter`),
and the callbacks of a Ray run: the run log, the spike guard, injected faults, throughput and
the profiler. See docs/architecture.md for the whole path.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass

import ray.train
import ray.train.torch
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
from raytrain_loops.driver.errors import Stopped
from raytrain_loops.driver.run_dir import PRECISION_FILE
from raytrain_loops.driver.stops import StopBoard
from raytrain_loops.engine import Engine, precision, unwrap
from raytrain_loops.engine.distributed import collectives, sharding
from raytrain_loops.engine.guards import TrainingError
from raytrain_loops.engine.length import accum_steps, epochs_in_run, total_steps
from raytrain_loops.engine.loop import Loop, LoopSettings, Position
from raytrain_loops.engine.rng import seed_everything
from raytrain_loops.tasks import MapSplit, ParquetSplit, Task
from raytrain_loops.worker.batches import RayBatches
from raytrain_loops.worker.reporter import RayReporter


@dataclass
class WorkerPayload:
    """What the driver sends every worker: the run's config, the task, its data and where the
    run's files go; ``stops``, where a worker posts a stop that a retry cannot fix.
    ``init_checkpoint`` starts a new run from another run's checkpoint; ``tracking``, the MLflow
    run rank 0 logs to."""

    config: Config
    task: Task
    splits: dict[str, ParquetSplit | MapSplit]
    rows: dict[str, int]
    run_dir: str
    stops: StopBoard
    init_checkpoint: str | None = None
    console: Sender | None = None
    tracking: TrackedRun | None = None
    precision_warned: bool = False  # the driver warned of an emulated bf16 before Ray started


def _set_threads(config: Config) -> None:
    threads = config.scaling.threads_per_worker or max(1, int(config.scaling.cpus_per_worker))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # Ray does not set it
    torch.set_num_threads(threads)


def _resolve_precision(payload: WorkerPayload, rank: int, sender: Sender) -> Config:
    """The config with ``precision.dtype=auto`` resolved on this group's device (rank 0 decides;
    a run that resolved it before keeps that dtype, recorded in ``precision.json``), announced on
    the console by rank 0, with a warning for an explicit bf16 that this CPU emulates."""
    config, run_dir = payload.config, payload.run_dir
    requested = config.precision.dtype
    device = ray.train.torch.get_device()
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


def _prepare_model(
    module: torch.nn.Module, task: Task, config: Config
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """Checkpointing and compilation of the task's blocks, then DDP (Ray's ``prepare_model``) or
    FSDP2 sharding on this worker's device; with FSDP and an EMA, the EMA's copy sharded alike
    (an FSDP module cannot be deep-copied, so the copy is taken first)."""
    blocks = task.blocks(module)
    ema = copy.deepcopy(module) if config.scaling.strategy == "fsdp" and config.ema.enabled else None
    sharding.prepare_model(module, blocks, checkpointing=config.checkpointing, compile_cfg=config.compile)
    if config.scaling.strategy == "ddp":
        return ray.train.torch.prepare_model(module), None  # on GPUs, after it this worker's device is set
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype, reshard = config.precision.dtype, config.scaling.reshard_after_forward
    for m in (module, ema) if ema is not None else (module,):
        sharding.shard(m.to(device), task.blocks(m), device, dtype, reshard)
    return module, ema


def _any_worker(flag: bool) -> bool:
    votes = torch.tensor([float(flag)], device=collectives.collective_device())
    return collectives.all_reduce_sum(votes).item() > 0


def _announce_start(reporter, engine: Engine, config: Config, world: int, scale: float, sender: Sender, run_dir: str):
    """Rank 0: record what was restored (``init.json``) and tell the console of a resume or of a
    group running short of workers."""
    if reporter.loaded:
        storage.write_text(storage.join(run_dir, "init.json"), json.dumps(reporter.loaded) + "\n")
        if reporter.loaded.get("checkpoint"):
            sender.send("start", f"resumed at step {engine.step} from {reporter.loaded['checkpoint']}")
    if world != config.scaling.num_workers:
        k = accum_steps(config.accum, engine.epoch, scale)
        sender.send("start", f"{world} of {config.scaling.num_workers} workers: {k} micro-batches per update")


def _callbacks(
    payload: WorkerPayload,
    engine: Engine,
    faults: Faults,
    sender: Sender,
    rank: int,
    world: int,
    total: int,
    plain: torch.nn.Module,
    loaded: dict | None,
):
    """The loop callbacks of a Ray run: the run log (keeping of the earlier attempts' files what
    the restore, ``loaded``, says), the spike guard, faults, throughput (its FLOPs counted on
    ``plain``, the model as the task built it), the profiler and, when tracked, MLflow."""
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
    )
    log.sender = sender
    counts = task.counts if task.count_keys else None
    callbacks = [
        log,
        SpikeGuard(config.spike),
        faults,
        Throughput(config.logging.throughput, engine, task.criterion, counts, plain),
    ]
    callbacks.append(Profile(config.logging.profile, payload.run_dir, rank, engine.device))
    if payload.tracking is not None:
        callbacks.append(MlflowLog(payload.tracking, rank))
    return callbacks


def train_loop_per_worker(payload: WorkerPayload) -> Stopped | None:
    """Ray Train's entry point on every worker."""
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    sender = payload.console or Sender(None)
    payload = dataclasses.replace(payload, config=_resolve_precision(payload, rank, sender))
    config, task, run_dir = payload.config, payload.task, payload.run_dir
    _set_threads(config)

    seed_everything(config.loop.seed)  # identical initial weights on every worker
    model = task.build_model()
    plain = plain_copy(model, "meta")  # shapes only: the FLOP count's model, whatever the sharding
    model, ema_module = _prepare_model(model, task, config)
    # After sharding: fully_shard replaces the parameters, and the groups must hold the new ones.
    groups = task.param_groups(unwrap(model)) if config.optim.param_groups == "task" else None
    # A worker of an earlier attempt stopped: a retry would meet it again. Decided together (a
    # store whose listing lags could show the stop to some workers only).
    stopped = payload.stops.posted()
    if _any_worker(stopped is not None):
        return stopped or Stopped("TrainingError", "a worker of an earlier attempt stopped the run", 0)
    seed_everything(config.loop.seed + 1 + rank)  # distinct dropout and augmentation per worker

    source = RayBatches(task, config, payload.splits, payload.rows, rank, world)
    scale = config.scaling.num_workers / world  # > 1 when an elastic group runs short
    total = total_steps(config.loop, config.accum, source.batches_per_epoch, scale)
    faults = Faults(config.fault.plan, rank, run_dir)
    engine = Engine(
        model,
        faults.wrap_loss(task.criterion),
        config.engine,
        total_steps=total,
        total_epochs=epochs_in_run(config.loop, config.accum, source.batches_per_epoch, scale),
        task_param_groups=groups,
        counts=task.counts if task.count_keys else None,
        count_keys=task.count_keys,
        after_step=task.after_step,
        ema_module=ema_module,
    )
    reporter = RayReporter(engine, rank, world, run_dir)
    position = reporter.restore(payload.init_checkpoint) or Position()
    if rank == 0:
        _announce_start(reporter, engine, config, world, scale, sender, run_dir)
    callbacks = _callbacks(payload, engine, faults, sender, rank, world, total, plain, reporter.loaded)
    loop = Loop(engine, source, reporter, LoopSettings.of(config), task.evaluate, callbacks, scale, task.eval_metrics)
    try:
        loop.run(position)
    except TrainingError as err:
        # A restart would meet it again. Raised by every worker at the same step (decided from
        # all-reduced values), every worker ends the attempt normally and the driver raises it;
        # raised by this worker alone, the others wait in a collective: raise, so that Ray ends
        # the group now, and the restarted group (or the driver) finds the posted stop.
        stopped = Stopped(type(err).__name__, str(err), engine.step)
        payload.stops.post(rank, stopped)
        if payload.stops.agreed(world):
            return stopped
        raise
    return None
