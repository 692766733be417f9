"""The detectors of the step: an out-of-memory error from any backend, and where a non-finite
value came from (the errors the step raises are in :mod:`raytrain_loops.errors`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is an out-of-memory error from any backend."""
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError) and "out of memory" in str(err))


def _nonfinite(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.is_floating_point() and not bool(torch.isfinite(obj).all())
    if isinstance(obj, (list, tuple)):
        return any(_nonfinite(o) for o in obj)
    if isinstance(obj, dict):
        return any(_nonfinite(o) for o in obj.values())
    if isinstance(obj, float):
        return not math.isfinite(obj)
    return False


def first_nonfinite_module(model: nn.Module, run: Callable[[], object]) -> str | None:
    """Run ``run()`` with hooks on every module; the first module (in completion order) whose
    output was non-finite, as its qualified name (``""`` is the model itself)."""
    found: list[str] = []
    hooks = []
    for name, module in model.named_modules():

        def hook(_m, _inputs, output, name=name):
            if not found and _nonfinite(output):
                found.append(name or type(model).__name__)

        hooks.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    return found[0] if found else None


def first_nonfinite_grad(model: nn.Module) -> str | None:
    """The name of the first parameter whose gradient is non-finite (in this worker's shard, under
    FSDP: a check of the whole DTensor would be a collective that only some workers reach)."""
    from raytrain_loops.engine.distributed.sharding import local

    for name, p in model.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(local(p.grad)).all()):
            return name
    return None


