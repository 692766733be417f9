"""Models and batches between wrappers and devices: the module inside a DDP or compiled wrapper
(:func:`unwrap`), and a nested batch moved to a device (:func:`to_device`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["to_device", "unwrap"]


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
