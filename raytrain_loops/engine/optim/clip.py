"""Gradient clipping and the step's normalisation in one pass over the gradients."""

from __future__ import annotations

import torch

from raytrain_loops.config.engine import ClipConfig
from raytrain_loops.engine.distributed import collectives

__all__ = ["clip_and_normalise"]


def clip_and_normalise(
    grads: list[torch.Tensor],
    factor: float,
    grad_norm: float,
    clip: ClipConfig,
    *,
    across_shards: bool,
    collective_device: torch.device,
) -> None:
    """Scale ``grads`` in place by ``factor`` (the step's normalisation) and clip them as
    ``clip.mode`` says: ``global`` by the whole gradient's norm ``grad_norm``, ``per_param`` each
    parameter by its own norm (``across_shards``: each worker holds a shard of every parameter,
    whose norm then takes one all-reduce of the squares, on ``collective_device``)."""
    if clip.mode == "global":
        factor *= min(1.0, clip.max_norm / (grad_norm + 1e-6))
    if factor != 1.0 and grads:
        torch._foreach_mul_(grads, factor)
    if clip.mode == "per_param" and grads:
        norms = torch._foreach_norm(grads)
        if across_shards:
            squares = torch.stack(norms).double().square().to(collective_device)
            norms = list(collectives.all_reduce_sum(squares).sqrt().to(grads[0].device, grads[0].dtype).unbind())
        coefs = [torch.clamp(clip.max_norm / (n + 1e-6), max=1.0) for n in norms]
        torch._foreach_mul_(grads, coefs)
