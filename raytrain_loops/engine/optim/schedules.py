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
  - ``poly``: ``end + (value - end) * (1 - progress) ** power``.

``convention`` (``per: step`` only) gives instead the indexing of a reference implementation, so a
port of its loop gets the same value at every update ``t`` (0-based) of ``n``:

- ``dino`` (cosine): DINO's ``cosine_scheduler``. The warm-up is a linspace of ``w`` points that
  reaches ``value`` at ``w - 1``; then ``end + (value - end) * (1 + cos(pi * (t - w) / (n - w))) / 2``,
  which never reaches ``end``.
- ``cvnets`` (cosine): ml-cvnets' ``CosineScheduler`` with ``max_iterations = n``: the engine's
  warm-up, then a cosine over the period ``n - w + 1``; never below 0. cvnets indexes it by
  micro-batch; here it is indexed by update (a deliberate deviation: see docs/seeds.md).
- ``seamseg`` (poly): seamseg's poly ``LambdaLR`` wrapped in ``BurnInLR``, stepped with the 1-based
  global step ``g = t + 1``: ``warmup_start + (value - warmup_start) * g / w`` while ``g <= w``
  (``warmup_start`` is ``value * burn_in_start``), then ``BurnInLR`` reads the poly one step late:
  ``end + (value - end) * (1 - (g - 1) / n) ** power``, which ends at ``value * (1 / n) ** power``
  (with ``w = 0`` there is no ``BurnInLR`` and the poly reads ``g``, reaching ``end`` at the last update).
- ``hf`` and ``fairseq`` (cosine): Hugging Face's ``get_cosine_schedule_with_warmup`` (with ``end``,
  its ``min_lr`` variant) and fairseq's ``cosine`` with ``t_mult = 1`` and ``max_update = n`` (whose
  ``warmup_init_lr`` defaults to ``min_lr``: set ``warmup_start`` to ``end``). The engine's warm-up,
  then a cosine over ``(t - w) / (n - w)``, never reaching ``end``.

After the run's last update (``t >= n``) a convention holds its value at ``n - 1``.
"""

from __future__ import annotations

import bisect
import math

from raytrain_loops.config.engine import Schedule


def _cosine(s: Schedule, x: float) -> float:
    """Half a cosine from ``value`` (``x = 0``) to ``end`` (``x = 1``)."""
    return s.end + 0.5 * (s.value - s.end) * (1.0 + math.cos(math.pi * x))


def _warmup(s: Schedule, t: float, w: float) -> float:
    """The straight line from ``warmup_start`` (``t = 0``) to ``value`` (``t = w``)."""
    return s.warmup_start + (s.value - s.warmup_start) * t / w


def _dino(s: Schedule, t: int, n: int) -> float:
    """DINO's ``cosine_scheduler`` at global iteration ``t`` of ``n``."""
    w = s.warmup_steps
    if t < w:  # numpy.linspace(start, value, w): w points, the last one the peak
        return s.warmup_start if w == 1 else _warmup(s, t, w - 1)
    return _cosine(s, (t - w) / max(n - w, 1))


def _cvnets(s: Schedule, t: int, n: int) -> float:
    """ml-cvnets' iteration-based ``CosineScheduler`` at ``t``, ``max_iterations = n``."""
    w = s.warmup_steps
    value = _warmup(s, t, w) if t < w else _cosine(s, (t - w) / (n - w + 1))
    return max(0.0, value)


def _seamseg(s: Schedule, t: int, n: int) -> float:
    """seamseg's poly under ``BurnInLR``, stepped with the global step after its increment."""
    g = t + 1  # seamseg counts global_step += 1 before scheduler.step(global_step)
    if g <= s.warmup_steps:
        return _warmup(s, g, s.warmup_steps)
    late = 1 if s.warmup_steps else 0  # BurnInLR reads the poly's step before it advances it
    return s.end + (s.value - s.end) * max(1.0 - (g - late) / n, 0.0) ** s.power


def _hf(s: Schedule, t: int, n: int) -> float:
    """Hugging Face's ``get_cosine_schedule_with_warmup`` (and fairseq's ``cosine``) at ``t`` of ``n``."""
    w = s.warmup_steps
    return _warmup(s, t, w) if t < w else _cosine(s, (t - w) / max(n - w, 1))


_CONVENTIONS = {"dino": _dino, "cvnets": _cvnets, "seamseg": _seamseg, "hf": _hf, "fairseq": _hf}


def _shape(s: Schedule, t: int, n: int) -> float:
    """The value at position ``t`` of ``n`` (steps or epochs, the unit of ``s.warmup_steps``)."""
    if s.convention != "engine":
        return _CONVENTIONS[s.convention](s, min(t, max(n - 1, 0)), max(n, 1))
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
