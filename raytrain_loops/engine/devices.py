"""Models and batches between wrappers and devices: the module inside a DDP or compiled wrapper
(:func:`unwrap`), a nested batch moved to a device (:func:`to_device`), whether a worker's host
batches are pinned (:func:`pins`) and the loop's next micro-batches copied to its device while
the current step runs (:func:`copied_ahead`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = ["copied_ahead", "pins", "to_device", "unwrap"]

T = TypeVar("T")


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP (or compiled) wrapper."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def to_device(batch: Any, device: torch.device) -> Any:
    """Move the tensors of a (nested) batch to ``device`` without blocking the host."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def pins(device: torch.device | str | None) -> bool:
    """Whether a worker on ``device`` pins its host batches in page-locked memory (a CUDA device:
    its copies to the device then run without the host waiting, beside the step)."""
    return device is not None and torch.device(device).type == "cuda"


def copied_ahead(groups: Iterable[tuple[list[Any], T]], device: torch.device) -> Iterator[tuple[list[Any], T]]:
    """``(micro-batches, extra)`` pairs with the micro-batches on ``device``, each group's copy
    started on a side stream before the group ahead of it is handed out, so that on a CUDA device
    it runs while that group's step computes (``non_blocking`` from pinned memory). Elsewhere the
    groups pass through as they are (the engine moves each micro-batch itself)."""
    if torch.device(device).type != "cuda":
        yield from groups
        return
    side = torch.cuda.Stream(device)

    def start(item: tuple[list[Any], T]) -> tuple[list[Any], T, torch.cuda.Event]:
        group, extra = item
        with torch.cuda.stream(side):
            moved = [to_device(b, device) for b in group]
            done = torch.cuda.Event()
            done.record(side)
        return moved, extra, done

    it = iter(groups)
    pending = start(item) if (item := next(it, None)) is not None else None
    while pending is not None:
        following = next(it, None)
        moved, extra, done = pending
        pending = start(following) if following is not None else None
        torch.cuda.current_stream(device).wait_event(done)
        for t in _tensors(moved):
            t.record_stream(torch.cuda.current_stream(device))  # allocated on the side stream, used on this one
        yield moved, extra


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v)
