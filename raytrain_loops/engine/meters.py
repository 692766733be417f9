"""Metric sums and weights kept where they are produced, aggregated across workers on demand."""

from __future__ import annotations

import torch

from raytrain_loops.engine import dist


class Meters:
    """Weighted means over a logging interval: ``sum(value * weight) / sum(weight)`` per name.

    Tensor values stay on their device (no host sync per step); host floats stay on the host.
    :meth:`reduce` packs everything into one tensor and sums it over workers with one all-reduce,
    so the means are over all workers' samples, not rank 0's.
    """

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor | float] = {}
        self._weights: dict[str, torch.Tensor | float] = {}

    def add(self, name: str, value: torch.Tensor | float, weight: torch.Tensor | float = 1.0) -> None:
        """Add ``value`` with ``weight`` (either may be a device tensor or a host number)."""
        if isinstance(value, torch.Tensor):
            value = value.detach().float()
        elif isinstance(weight, torch.Tensor):
            value = torch.tensor(float(value), device=weight.device)
        else:
            value = float(value)
        if isinstance(weight, torch.Tensor):
            weight = weight.detach().float()
        total = value * weight
        prev = self._sums.get(name)
        self._sums[name] = total if prev is None else prev + total
        prev_w = self._weights.get(name)
        self._weights[name] = weight if prev_w is None else prev_w + weight

    def reduce(self) -> dict[str, float]:
        """The means since the last call, over all workers; every worker must call it together."""
        names = sorted(set().union(*(set(n) for n in dist.all_gather_object(sorted(self._sums)))))
        device = dist.collective_device()

        def column(values: dict[str, torch.Tensor | float]) -> list[torch.Tensor]:
            out = []
            for name in names:
                v = values.get(name, 0.0)
                out.append(
                    v.to(device, torch.float64)
                    if isinstance(v, torch.Tensor)
                    else torch.tensor(v, dtype=torch.float64, device=device)
                )
            return out

        cells = column(self._sums) + column(self._weights)
        packed = torch.stack(cells) if cells else torch.zeros(0, dtype=torch.float64, device=device)
        dist.all_reduce_sum(packed)
        flat = packed.tolist()
        self._sums.clear()
        self._weights.clear()
        n = len(names)
        return {name: flat[i] / flat[n + i] for i, name in enumerate(names) if flat[n + i] > 0}
