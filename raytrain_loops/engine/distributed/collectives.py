"""Collectives the engine needs, as no-ops when no process group is running."""

from __future__ import annotations

from collections.abc import Sequence
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


def _is_running_stat(module: torch.nn.Module, name: str) -> bool:
    """A normalisation layer's running mean or variance: what ``average`` mode averages."""
    return isinstance(module, torch.nn.modules.batchnorm._NormBase) and name in ("running_mean", "running_var")


def sync_buffers(modules: Sequence[torch.nn.Module], mode: str = "broadcast") -> None:
    """Make every worker's persistent buffers of ``modules`` (those a checkpoint saves: BatchNorm's
    running statistics among them) the same: rank 0's (``broadcast``), or, ``average``, the mean
    over workers of the normalisation layers' running means and variances (timm's
    ``distribute_bn`` reduce mode), rank 0's for every other buffer. One collective per dtype; a
    no-op on one worker."""
    if world_size() == 1:
        return
    groups: dict[tuple[torch.dtype, bool], list[torch.Tensor]] = {}
    for module in modules:
        for owner in module.modules():
            for name, buf in owner.named_buffers(recurse=False):
                if buf is not None and name not in owner._non_persistent_buffers_set:
                    averaged = mode == "average" and buf.is_floating_point() and _is_running_stat(owner, name)
                    groups.setdefault((buf.dtype, averaged), []).append(buf)
    device = collective_device()
    for (_, averaged), bufs in sorted(groups.items(), key=lambda item: (str(item[0][0]), item[0][1])):
        flat = torch.cat([b.detach().reshape(-1) for b in bufs]).to(device)
        if flat.dtype == torch.bool:  # as bytes: not every backend reduces or broadcasts bool
            flat = flat.to(torch.uint8)
        if averaged:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat /= world_size()
        else:
            dist.broadcast(flat, src=0)
        with torch.no_grad():
            for buf, part in zip(bufs, flat.split([b.numel() for b in bufs]), strict=True):
                buf.copy_(part.view_as(buf))
