"""Exponential moving average of a model's weights (model EMA, or DINO's momentum teacher)."""

from __future__ import annotations

import copy
from typing import Literal

import torch
from torch import nn

from raytrain_loops.engine.distributed.sharding import local


class EMA:
    """A frozen copy of a model whose parameters follow ``ema = m * ema + (1 - m) * model``.

    The momentum ``m`` is passed at every update, so it can follow a schedule of the step.
    ``buffers`` (``ema.buffers``): ``average`` moves the floating-point buffers (BatchNorm's
    running statistics) by the same rule, as cvnets' EMA does, and copies the integer ones
    (``num_batches_tracked``: a count cannot be averaged; cvnets writes the average back into the
    integer tensor, which truncates it); ``copy`` copies every buffer; ``keep`` leaves the EMA's
    own. ``module``: the copy to use instead of a deep copy; for an FSDP-sharded model (which
    cannot be deep-copied) a copy sharded the same way, whose local shards then follow the model's.
    """

    def __init__(
        self, model: nn.Module, buffers: Literal["average", "copy", "keep"] = "copy", module: nn.Module | None = None
    ):
        if buffers not in ("average", "copy", "keep"):
            raise ValueError(f"ema.buffers must be average, copy or keep; got {buffers!r}")
        self.module = (copy.deepcopy(model) if module is None else module).eval().requires_grad_(False)
        self.buffers = buffers
        self._src = list(model.parameters())
        self._dst = list(self.module.parameters())
        if [p.shape for p in self._src] != [p.shape for p in self._dst]:
            raise ValueError("the EMA's module must have the model's parameters (same order and shapes)")
        pairs = list(zip(self.module.buffers(), model.buffers(), strict=True)) if buffers != "keep" else []
        averaged = [(d, s) for d, s in pairs if buffers == "average" and d.is_floating_point()]
        copied = [(d, s) for d, s in pairs if not (buffers == "average" and d.is_floating_point())]
        self._avg_dst, self._avg_src = [d for d, _ in averaged], [s for _, s in averaged]
        self._copy_dst, self._copy_src = [d for d, _ in copied], [s for _, s in copied]

    @torch.no_grad()
    def update(self, momentum: float) -> None:
        """Move the EMA weights (and averaged buffers) towards the model's by ``1 - momentum``;
        copy the copied buffers."""
        if momentum < 1.0:
            # Local shards under FSDP: the same elementwise update, with no DTensor dispatch.
            torch._foreach_lerp_([local(p) for p in self._dst], [local(p) for p in self._src], 1.0 - momentum)
            if self._avg_dst:
                torch._foreach_lerp_(self._avg_dst, self._avg_src, 1.0 - momentum)
        if self._copy_dst:
            torch._foreach_copy_(self._copy_dst, self._copy_src)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)
