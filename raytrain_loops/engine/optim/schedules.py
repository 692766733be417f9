"""Schedules as pure functions of the global step or of the epoch, so a resumed run continues
them exactly.

A schedule's position is ``t`` of ``n``: the optimizer step of the run's ``total_steps``
(``per: step``), or the epoch of the run's ``total_epochs`` (``per: epoch``; the value then
holds for a whole epoch). With ``w = warmup_steps`` (in the same unit):

- ``t < w``: ``warmup_start + (value - warmup_start) * t / w``;
- after it, ``progress = min((t - w) / max(n - w - 1, 1), 1)``, which reaches 1 at the last
  step (or epoch) of the run, and:

  - ``constant``: ``value``;
  - ``step``: ``value * gamma ** (number of milestones <= t)``;
  - ``linear``: ``value + (end - value) * progress``;
  - ``cosine``: ``end + (value - end) * (1 + cos(pi * progress)) / 2``;
  - ``poly``: ``end + (value - end) * (1 - progress) ** power`` (seamseg's
    ``value * (1 - progress) ** power`` when ``end`` is 0).
"""

from __future__ import annotations

import bisect
import math

from raytrain_loops.config.engine import Schedule


def _shape(s: Schedule, t: int, n: int) -> float:
    """The value at position ``t`` of ``n`` (steps or epochs, the unit of ``s.warmup_steps``)."""
    if t < s.warmup_steps:
        return s.warmup_start + (s.value - s.warmup_start) * t / s.warmup_steps
    if s.kind == "constant":
        return s.value
    if s.kind == "step":
        return s.value * s.gamma ** bisect.bisect_right(s.milestones, t)
    span = max(n - s.warmup_steps - 1, 1)
    progress = min((t - s.warmup_steps) / span, 1.0)
    if s.kind == "linear":
        return s.value + (s.end - s.value) * progress
    if s.kind == "poly":
        return s.end + (s.value - s.end) * (1.0 - progress) ** s.power
    return s.end + 0.5 * (s.value - s.end) * (1.0 + math.cos(math.pi * progress))


def schedule_value(s: Schedule, step: int, total_steps: int, epoch: int = 0, total_epochs: int = 0) -> float:
    """The value of schedule ``s`` at optimizer step ``step`` of a run of ``total_steps`` steps,
    in epoch ``epoch`` of ``total_epochs`` (read by ``per: epoch`` schedules only, which need
    ``total_epochs`` >= 1)."""
    if s.per == "step":
        return _shape(s, step, total_steps)
    if total_epochs < 1:
        raise ValueError("a per=epoch schedule needs the run's epochs (Engine(total_epochs=...))")
    return _shape(s, epoch, total_epochs)


def schedule_values(
    schedules: dict[str, Schedule], step: int, total_steps: int, epoch: int = 0, total_epochs: int = 0
) -> dict[str, float]:
    """Every named schedule evaluated at ``step`` (and ``epoch``)."""
    return {name: schedule_value(s, step, total_steps, epoch, total_epochs) for name, s in schedules.items()}
