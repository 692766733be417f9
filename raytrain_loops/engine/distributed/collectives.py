"""Collectives the engine needs, as no-ops when no process group is running."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def torn_down(world: int) -> bool:
    """Whether the process group of ``world`` workers this process trained in is gone: Ray
    destroys it when it tears the group down (a preemption's restart, another worker's failure)
    while the training thread may be mid-step, and from then on the collectives are no-ops that
    leave this worker's own values."""
    return world > 1 and world_size() != world


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over all workers in place (a no-op on one worker) and return it."""
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_object(obj: Any) -> list[Any]:
    """Every worker's ``obj``, in rank order."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def collective_device() -> torch.device:
    """The device tensors must live on for the process group's backend (CUDA for NCCL)."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
