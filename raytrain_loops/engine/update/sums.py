"""This worker's sums over an update's micro-batches, before the step's all-reduce."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from raytrain_loops.engine.api import LossOutput

__all__ = ["LocalSums"]


@dataclass
class LocalSums:
    """This worker's sums over its micro-batches, before the reduction."""

    sample_size: torch.Tensor | float = 0.0
    loss_sum: torch.Tensor | float = 0.0
    terms: float = 0.0
    ooms: int = 0
    losses: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (micro-batch index, loss)
    logs: list[tuple[dict[str, Any], Any]] = field(default_factory=list)  # (criterion logs, weight)
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # summed over micro-batches
    term_sums: dict[str, float] = field(default_factory=dict)  # unscaled terms, for error messages

    def add(self, index: int, out: LossOutput) -> None:
        """Add micro-batch ``index``'s criterion output (detached)."""
        loss = out.loss.detach().float()
        self.losses.append((index, loss))
        self.loss_sum = self.loss_sum + loss
        self.sample_size = self.sample_size + out.sample_size
        self.terms += 1.0
        self.add_stats(out.stats)
        if out.terms:
            self.logs.append(({**out.logs, **out.term_logs()}, out.sample_size))
            for name, t in out.terms.items():
                self.term_sums[name] = self.term_sums.get(name, 0.0) + t.detach().float()
        else:
            self.logs.append((out.logs, out.sample_size))

    def add_stats(self, stats: dict[str, torch.Tensor], weight: float = 1.0) -> None:
        for k, v in stats.items():
            v = v.detach().double().flatten() * weight
            self.stats[k] = v if k not in self.stats else self.stats[k] + v
