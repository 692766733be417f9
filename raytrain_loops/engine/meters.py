"""Metric sums and weights kept where they are produced, aggregated across workers on demand:
over a logging interval, and over an epoch (the global averages DINO and DETR return from an
epoch), fed by each applied update (:meth:`Meters.add_update`); and :class:`Smoother`, the smoothed values of the interval means that the progress line shows
(seamseg's momentum meters, DETR's window median)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from raytrain_loops.engine.distributed import collectives

if TYPE_CHECKING:
    from raytrain_loops.engine.update.decision import Reduced

__all__ = ["Meters", "Smoother"]

Number = torch.Tensor | float


class _Sums:
    """This worker's ``sum(value * weight)`` and ``sum(weight)`` per name."""

    def __init__(self) -> None:
        self.sums: dict[str, Number] = {}
        self.weights: dict[str, Number] = {}

    def add(self, name: str, total: Number, weight: Number) -> None:
        prev = self.sums.get(name)
        self.sums[name] = total if prev is None else prev + total
        prev_w = self.weights.get(name)
        self.weights[name] = weight if prev_w is None else prev_w + weight

    def clear(self) -> None:
        self.sums.clear()
        self.weights.clear()


class Meters:
    """Weighted means over a logging interval: ``sum(value * weight) / sum(weight)`` per name;
    with ``epochs``, the same sums over the current epoch beside them.

    Tensor values stay on their device (no host sync per step); host floats stay on the host.
    :meth:`reduce` packs everything into one tensor and sums it over workers with one all-reduce,
    so the means are over all workers' samples, not rank 0's. The names are agreed without a
    gather once known: a worker holding a name not reduced before says so in that all-reduce, and
    only then do the workers gather their names and reduce again.

    The epoch's sums are reduced at its end (:meth:`end_epoch`), and before a checkpoint
    (:meth:`flush_epoch`) into a part that is the same on every worker, so that rank 0's
    :meth:`state_dict` holds the epoch so far for all of them.
    """

    def __init__(self, epochs: bool = False) -> None:
        self._interval = _Sums()
        self._epoch = _Sums() if epochs else None  # this worker's, since the last flush
        self._epoch_reduced: dict[str, list[float]] = {}  # over all workers: [sum, weight]
        self._known: set[str] = set()  # names every worker has agreed on, the same everywhere
        self.flushed_at: int | None = None  # the engine's step at the epoch sums' last reduction

    def add(self, name: str, value: Number, weight: Number = 1.0) -> None:
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
        self._interval.add(name, total, weight)
        if self._epoch is not None:
            self._epoch.add(name, total, weight)

    def add_update(
        self,
        logs: list[tuple[dict[str, Any], Any]],
        reduced: Reduced,
        lr: float,
        compute: float,
        data_time: float,
        world_size: int,
    ) -> None:
        """Add an applied update: the criterion's ``logs`` (``(values, weight)`` per micro-batch; a
        value that is a ``(value, weight)`` pair takes its own weight), the reduced loss and
        gradient norm, the learning rate, the throughput and the step's times."""
        for values, weight in logs:
            for name, v in values.items():
                self.add(name, *v) if isinstance(v, tuple) else self.add(name, v, weight)  # a pair: its own weight
        # Host numbers, already identical on every worker: weight by 1/world so the summed
        # reduction gives back the value itself.
        w = 1.0 / world_size
        self.add("loss", reduced.loss, reduced.weight * w)
        self.add("grad_norm", reduced.grad_norm, w)
        self.add("lr", lr, w)
        self.add("sample_size", reduced.sample_size, w)
        # Units (tokens, for a token-level criterion) per second of step time over all workers
        # (fairseq's wps): weighted by each worker's time, the interval mean is units / time.
        busy = compute + data_time
        self.add("sample_size_per_s", reduced.sample_size / busy, busy * w)
        self.add("compute_time", compute)
        self.add("data_time", data_time)
        self.add("batch_time", busy)  # compute and waiting for data apart show which one holds a step up

    def reduce(self) -> dict[str, float]:
        """The means since the last call, over all workers; every worker must call it together."""
        sums = self._all_reduce(self._interval)
        return {name: s / w for name, (s, w) in sums.items()}

    def flush_epoch(self) -> None:
        """Reduce this epoch's sums so far over all workers (every worker calls it together)."""
        if self._epoch is None:
            raise RuntimeError("these meters keep no epoch sums (Meters(epochs=True) does)")
        for name, (s, w) in self._all_reduce(self._epoch).items():
            cell = self._epoch_reduced.setdefault(name, [0.0, 0.0])
            cell[0] += s
            cell[1] += w

    def flush_epoch_at(self, step: int) -> None:
        """:meth:`flush_epoch` unless it already ran at update ``step``: it runs a collective only
        when an update was applied since the last one (the step count is the same on every
        worker, so they agree)."""
        if self.flushed_at != step:
            self.flush_epoch()
            self.flushed_at = step

    def end_epoch(self) -> dict[str, float]:
        """The epoch's weighted means over all workers, and a fresh epoch (every worker calls it
        together)."""
        self.flush_epoch()
        means = {name: s / w for name, (s, w) in sorted(self._epoch_reduced.items()) if w > 0}
        self._epoch_reduced = {}
        return means

    def state_dict(self) -> dict[str, Any]:
        """The epoch's sums as of the last :meth:`flush_epoch` (the same on every worker)."""
        return {"epoch": {name: list(cell) for name, cell in self._epoch_reduced.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the epoch whose sums :meth:`state_dict` returned."""
        self._epoch_reduced = {str(k): [float(s), float(w)] for k, (s, w) in state.get("epoch", {}).items()}

    def _all_reduce(self, local: _Sums) -> dict[str, tuple[float, float]]:
        """``local``'s sums and weights over all workers, by name; ``local`` is then cleared."""
        names = sorted(self._known)
        flat = self._pack_and_reduce(local, names, float(not self._known.issuperset(local.sums)))
        if flat[-1] > 0:  # a name some worker has not had reduced yet: agree on the names first
            self._known.update(*collectives.all_gather_object(sorted(local.sums)))
            names = sorted(self._known)
            flat = self._pack_and_reduce(local, names, 0.0)
        local.clear()
        n = len(names)
        return {name: (flat[i], flat[n + i]) for i, name in enumerate(names) if flat[n + i] > 0}

    @staticmethod
    def _pack_and_reduce(local: _Sums, names: list[str], flag: float) -> list[float]:
        device = collectives.collective_device()
        sums, weights = local.sums, local.weights

        def cell(v: Number) -> torch.Tensor:
            if isinstance(v, torch.Tensor):
                return v.to(device, torch.float64)
            return torch.tensor(v, dtype=torch.float64, device=device)

        cells = [cell(sums.get(n, 0.0)) for n in names] + [cell(weights.get(n, 0.0)) for n in names]
        packed = torch.stack([*cells, cell(flag)])
        collectives.all_reduce_sum(packed)
        return packed.tolist()


class Smoother:
    """Smoothed values of a series of interval means that are the same on every worker, so
    smoothing them takes no collective.

    Both kinds count in steps, as the seeds' meters do (they update every iteration), so that the
    logging cadence does not change how far back the line looks: an interval of
    ``steps_per_interval`` steps stands for that many steps of its mean.

    ``momentum`` (seamseg's meters): ``sum(m**i * v[t-i]) / sum(m**i)`` over the steps so far, a
    moving average without the start-up bias of one that begins at 0 (the first value is shown as
    is). ``median`` (DETR's ``SmoothedValue``): the median of the intervals covering the last
    ``window`` steps.
    """

    def __init__(self, kind: str = "momentum", momentum: float = 0.9, window: int = 20, steps_per_interval: int = 1):
        if kind not in ("momentum", "median"):
            raise ValueError(f"smoothing kind must be 'momentum' or 'median'; got {kind!r}")
        self.kind, self.momentum, self.window = kind, float(momentum), int(window)
        self._k = k = max(int(steps_per_interval), 1)
        self._decay = self.momentum**k  # an interval's k steps age the past by m^k...
        self._weight = (1.0 - self._decay) / (1.0 - self.momentum)  # ...and add sum(m^j, j < k) of its mean
        self._kept = max(1, -(-self.window // k))  # the intervals the median's window covers
        self._series: dict[str, list[float]] = {}  # momentum: [sum, weight]; median: the window

    def update(self, values: Mapping[str, float]) -> dict[str, float]:
        """Take one interval's values; return every name's smoothed value so far."""
        for name, v in values.items():
            v = float(v)
            series = self._series.get(name)
            if self.kind == "median":
                kept = (series or [])[max(0, len(series or []) - self._kept + 1) :] if self._kept > 1 else []
                self._series[name] = kept + [v]
            elif series is None:
                self._series[name] = [self._weight * v, self._weight]
            else:
                series[0] = self._decay * series[0] + self._weight * v
                series[1] = self._decay * series[1] + self._weight
        return self.values()

    def values(self) -> dict[str, float]:
        """Every name's smoothed value."""
        if self.kind == "median":
            return {name: statistics.median(s) for name, s in self._series.items()}
        return {name: s / c for name, (s, c) in self._series.items()}

    def state_dict(self) -> dict[str, Any]:
        """The settings and the series, to continue after a resume."""
        settings = {"kind": self.kind, "momentum": self.momentum, "window": self.window, "steps_per_interval": self._k}
        return {**settings, "series": {name: list(s) for name, s in self._series.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the saved series; a run resumed with other settings (``logging`` may change
        on a rerun) starts its smoothing afresh."""
        settings = (state.get("kind"), state.get("momentum"), state.get("window"), state.get("steps_per_interval", 1))
        if settings != (self.kind, self.momentum, self.window, self._k):
            self._series = {}
            return
        self._series = {str(k): [float(x) for x in s] for k, s in state.get("series", {}).items()}
