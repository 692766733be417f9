"""Exponential moving average of a model's weights (model EMA, or DINO's momentum teacher)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from raytrain_loops.engine.distributed.sharding import local


class EMA:
    """A frozen copy of a model whose parameters follow ``ema = m * ema + (1 - m) * model``.

    The momentum ``m`` is passed at every update, so it can follow a schedule of the step.
    ``module``: the copy to use instead of a deep copy; for an FSDP-sharded model (which cannot be
    deep-copied) a copy sharded the same way, whose local shards then follow the model's.
    """

    def __init__(self, model: nn.Module, copy_buffers: bool = True, module: nn.Module | None = None):
        self.module = (copy.deepcopy(model) if module is None else module).eval().requires_grad_(False)
        self.copy_buffers = copy_buffers
        self._src = list(model.parameters())
        self._dst = list(self.module.parameters())
        if [p.shape for p in self._src] != [p.shape for p in self._dst]:
            raise ValueError("the EMA's module must have the model's parameters (same order and shapes)")
        self._src_buffers = list(model.buffers())
        self._dst_buffers = list(self.module.buffers())

    @torch.no_grad()
    def update(self, momentum: float) -> None:
        """Move the EMA weights towards the model's by ``1 - momentum``."""
        if momentum < 1.0:
            # Local shards under FSDP: the same elementwise update, with no DTensor dispatch.
            torch._foreach_lerp_([local(p) for p in self._dst], [local(p) for p in self._src], 1.0 - momentum)
        if self.copy_buffers and self._dst_buffers:
            torch._foreach_copy_(self._dst_buffers, self._src_buffers)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)
