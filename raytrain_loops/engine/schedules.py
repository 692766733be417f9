"""Schedules as pure functions of the global step, so a resumed run continues them exactly."""

from __future__ import annotations

import bisect
import math

from raytrain_loops.config.engine import Schedule


def schedule_value(s: Schedule, step: int, total_steps: int) -> float:
    """The value of schedule ``s`` at optimizer step ``step`` of a run of ``total_steps`` steps."""
    if step < s.warmup_steps:
        return s.warmup_start + (s.value - s.warmup_start) * step / s.warmup_steps
    if s.kind == "constant":
        return s.value
    if s.kind == "step":
        return s.value * s.gamma ** bisect.bisect_right(s.milestones, step)
    span = max(total_steps - s.warmup_steps - 1, 1)
    progress = min((step - s.warmup_steps) / span, 1.0)
    if s.kind == "linear":
        return s.value + (s.end - s.value) * progress
    return s.end + 0.5 * (s.value - s.end) * (1.0 + math.cos(math.pi * progress))


def schedule_values(schedules: dict[str, Schedule], step: int, total_steps: int) -> dict[str, float]:
    """Every named schedule evaluated at ``step``."""
    return {name: schedule_value(s, step, total_steps) for name, s in schedules.items()}
