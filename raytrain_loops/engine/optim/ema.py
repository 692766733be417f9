"""Exponential moving average of a model's weights (model EMA, or DINO's momentum teacher)."""

from __future__ import annotations

import copy
from typing import Literal

import torch
from torch import nn

from raytrain_loops.engine.distributed.sharding import local

ARITHMETIC = ("lerp", "weighted_sum")
# Elements per group of the weighted sum: its temporary products stay this small, not a model's worth.
GROUP = 1 << 20


def weighted_sum_(dst: list[torch.Tensor], src: list[torch.Tensor], m: float) -> None:
    """``dst = dst * m + (1 - m) * src``, each product rounded to the tensors' dtype, then their sum:
    DINO's ``param_k.mul_(m).add_((1 - m) * param_q)`` and cvnets' ``ema * (1 - w) + w * model``
    (``w = 1 - m``) to the bit. Foreach kernels over groups of at most :data:`GROUP` elements (a
    contiguous tensor split into flat pieces); no fused multiply-add (``add_(alpha=)``), whose
    single rounding differs."""
    for d, s in _groups(dst, src):
        torch._foreach_mul_(d, m)
        torch._foreach_add_(d, torch._foreach_mul(s, 1.0 - m))


def _groups(dst: list[torch.Tensor], src: list[torch.Tensor]):
    """The pairs of tensors (or flat pieces of them) in groups of at most :data:`GROUP` elements."""
    group_d: list[torch.Tensor] = []
    group_s: list[torch.Tensor] = []
    size = 0
    for d, s in zip(dst, src, strict=True):
        flat = d.is_contiguous() and s.is_contiguous()
        for pd, ps in zip(d.view(-1).split(GROUP), s.view(-1).split(GROUP), strict=True) if flat else [(d, s)]:
            if group_d and size + pd.numel() > GROUP:
                yield group_d, group_s
                group_d, group_s, size = [], [], 0
            group_d.append(pd)
            group_s.append(ps)
            size += pd.numel()
    if group_d:
        yield group_d, group_s


class EMA:
    """A frozen copy of a model whose parameters follow ``ema = m * ema + (1 - m) * model``.

    The momentum ``m`` is passed at every update, so it can follow a schedule of the step.
    ``arithmetic`` (``ema.arithmetic``): ``lerp`` computes it with ``torch._foreach_lerp_`` (one
    pass), ``weighted_sum`` as DINO and cvnets write it (:func:`weighted_sum_`); the two round
    differently, so entries differ in the last bit from the first update on.
    ``buffers`` (``ema.buffers``): ``average`` moves the floating-point buffers (BatchNorm's
    running statistics) by the same rule, as cvnets' EMA does, and copies the integer ones
    (``num_batches_tracked``: a count cannot be averaged; cvnets writes the average back into the
    integer tensor, which truncates it); ``copy`` copies every buffer; ``keep`` leaves the EMA's
    own. ``module``: the copy to use instead of a deep copy; for an FSDP-sharded model (which
    cannot be deep-copied) a copy sharded the same way, whose local shards then follow the model's.
    """

    def __init__(
        self,
        model: nn.Module,
        buffers: Literal["average", "copy", "keep"] = "copy",
        module: nn.Module | None = None,
        arithmetic: Literal["lerp", "weighted_sum"] = "lerp",
    ):
        if buffers not in ("average", "copy", "keep"):
            raise ValueError(f"ema.buffers must be average, copy or keep; got {buffers!r}")
        if arithmetic not in ARITHMETIC:
            raise ValueError(f"ema.arithmetic must be lerp or weighted_sum; got {arithmetic!r}")
        self.arithmetic = arithmetic
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
            self._move([local(p) for p in self._dst], [local(p) for p in self._src], momentum)
            if self._avg_dst:
                self._move(self._avg_dst, self._avg_src, momentum)
        if self._copy_dst:
            torch._foreach_copy_(self._copy_dst, self._copy_src)

    def _move(self, dst: list[torch.Tensor], src: list[torch.Tensor], momentum: float) -> None:
        if self.arithmetic == "lerp":
            torch._foreach_lerp_(dst, src, 1.0 - momentum)
        else:
            weighted_sum_(dst, src, momentum)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)
