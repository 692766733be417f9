"""What Ray Train runs on every worker: the loop wired as in any process
(:func:`raytrain_loops.runtime.wiring.wire`) with its Ray parts: the model under DDP (Ray's
``prepare_model``) or FSDP2, this worker's batches (``worker/preprocessing.py``), a reporter that writes
checkpoint files and calls ``ray.train.report`` (``checkpoint/ray_reporter.py``), and the stops a
retry cannot fix.

See docs/architecture.md for the whole path.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os

import ray
import ray.train
import ray.train.torch
import torch

from raytrain_loops.callbacks.preemption import Notice, PreemptionCheck
from raytrain_loops.checkpoint.ray_reporter import RayReporter
from raytrain_loops.config import Config
from raytrain_loops.console.feed import Sender
from raytrain_loops.data.reach import check_here
from raytrain_loops.engine.distributed import collectives, sharding
from raytrain_loops.errors import GroupBrokenError, Stopped, TrainingError
from raytrain_loops.runtime.wiring import WorkerPayload, wire
from raytrain_loops.streams import close
from raytrain_loops.tasks import DatasetSplit, Task
from raytrain_loops.worker.preprocessing import PREPROCESSED_ON, ray_batches

__all__ = ["WorkerPayload", "train_loop_per_worker"]


class _StoppedEarlier(Exception):
    """A worker of an earlier attempt posted a stop: this attempt ends at once."""

    def __init__(self, stopped: Stopped):
        self.stopped = stopped


def prepare_model(
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


def _check_stops(payload: WorkerPayload) -> None:
    """A worker of an earlier attempt stopped: a retry would meet it again. Decided together (a
    store whose listing lags could show the stop to some workers only)."""
    stopped = payload.stops.posted()
    if _any_worker(stopped is not None):
        raise _StoppedEarlier(stopped or Stopped("TrainingError", "a worker of an earlier attempt stopped the run", 0))


def _preemption_notice() -> Notice | None:
    """Ray Train's preemption notice (rank 0's, broadcast: a barrier), or None."""
    info = ray.train.get_preemption_info()
    if info is None:
        return None
    deadline = info.deadline_ms / 1000 if info.deadline_ms else None
    return Notice.of(info.preempted_node_to_ranks, deadline)


def _watched() -> bool:
    """Whether Ray Train watches node drains for this group (its preemption watcher, on unless
    ``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER`` turns it off), on every worker: asking for a notice
    that cannot come costs a barrier for nothing."""
    on = os.environ.get("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "1").lower() in ("1", "true")
    votes = torch.tensor([float(on)], device=collectives.collective_device())
    return collectives.all_reduce_sum(votes).item() == collectives.world_size()


def dataset_shards(payload: WorkerPayload) -> WorkerPayload:
    """``payload`` with each split that is a Ray Dataset replaced by this worker's shard of it
    (``ray.train.get_dataset_shard``)."""
    splits = {
        name: DatasetSplit(ray.train.get_dataset_shard(name), split.rows) if isinstance(split, DatasetSplit) else split
        for name, split in payload.splits.items()
    }
    return dataclasses.replace(payload, splits=splits)


def train_loop_per_worker(payload: WorkerPayload) -> Stopped | None:
    """Ray Train's entry point on every worker."""
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    node = f"{ray.util.get_node_ip_address()} (node id {ray.get_runtime_context().get_node_id()[:12]})"
    payload = dataset_shards(payload)
    check_here(payload.config.data.dir, payload.splits, node)  # this attempt's node reaches the data
    sender = payload.console or Sender(None)
    try:
        wired = wire(
            payload,
            rank,
            world,
            ray.train.torch.get_device(),
            sender,
            prepare_model=prepare_model,
            batches=functools.partial(ray_batches, sender=sender),
            reporter=functools.partial(
                RayReporter, rank=rank, world=world, run_dir=payload.run_dir, sender=sender, preprocessed_on=PREPROCESSED_ON
            ),
            before_data=functools.partial(_check_stops, payload),
        )
    except _StoppedEarlier as earlier:
        return earlier.stopped
    if _watched():
        max_preemptions = payload.config.run.max_preemptions
        wired.loop.callbacks.append(PreemptionCheck(_preemption_notice, rank, sender, max_preemptions))
    try:
        wired.loop.run(wired.position)
    except TrainingError as err:
        if collectives.torn_down(world):
            # A group failure Ray retries (or ended on purpose), not a stop to post: the values
            # that raised it were computed without the other workers.
            raise GroupBrokenError(
                f"worker {rank}'s process group was destroyed during step {wired.engine.step + 1} (the group is "
                f"being torn down), which left {type(err).__name__}: {err}"
            ) from err
        # A restart would meet it again. Raised by every worker at the same step (decided from
        # all-reduced values), every worker ends the attempt normally and the driver raises it;
        # raised by this worker alone, the others wait in a collective: raise, so that Ray ends
        # the group now, and the restarted group (or the driver) finds the posted stop.
        stopped = Stopped(type(err).__name__, str(err), wired.engine.step)
        payload.stops.post(rank, stopped)
        if payload.stops.agreed(world):
            return stopped
        raise
    finally:
        close(wired.loop.source)  # the executor working ahead ends with the attempt
    return None
