"""``SpikeGuard``, a loop callback; runs on every worker (or in the calling process). Ray-free. It
stops the run on a loss spike (``spike``): each applied update's loss, the same on every worker
after the step's all-reduce, goes to a :class:`SpikeDetector`, so every worker raises the same
:class:`~raytrain_loops.errors.LossSpikeError` at the same step; the recent losses are the
callback's checkpointed state, so a resumed run calls a spike where the uninterrupted one would.
"""

from __future__ import annotations

import math
from typing import Any

from raytrain_loops.config.engine import SpikeConfig
from raytrain_loops.engine import StepResult
from raytrain_loops.engine.loop import Callback
from raytrain_loops.errors import LossSpikeError


class SpikeDetector:
    """Calls a spike when a step's loss (already averaged over all workers, so every worker
    decides the same) exceeds ``factor`` times the mean of the previous ``window`` losses."""

    def __init__(self, factor: float, window: int, min_steps: int):
        from collections import deque

        self.factor, self.min_steps = factor, min_steps
        self.history: deque[float] = deque(maxlen=window)

    def check(self, loss: float, step: int) -> None:
        if self.factor <= 0 or not math.isfinite(loss):
            return
        if len(self.history) >= self.min_steps:
            mean = sum(self.history) / len(self.history)
            if mean > 0 and loss > self.factor * mean:
                raise LossSpikeError(
                    f"loss spike at step {step}: {loss:.4g} is {loss / mean:.1f}x the mean {mean:.4g} of the last "
                    f"{len(self.history)} steps (spike.factor={self.factor:g})"
                )
        self.history.append(loss)

    def state_dict(self) -> dict[str, list[float]]:
        """The recent losses, so a resumed run calls a spike where the uninterrupted one would."""
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        """Restore what :meth:`state_dict` captured (the newest ``window`` losses of it)."""
        self.history.clear()
        self.history.extend(float(v) for v in state["history"])



class SpikeGuard(Callback):
    """Stops the run on a loss spike: each applied update's loss (the same on every worker) goes
    to a :class:`SpikeDetector` built from the ``spike`` config section."""

    def __init__(self, cfg: SpikeConfig):
        self.detector = SpikeDetector(cfg.factor, cfg.window, cfg.min_steps)

    def on_step(self, result: StepResult, step: int, epoch: int) -> None:
        if result.applied:
            self.detector.check(result.loss, step)

    def state_dict(self) -> dict[str, Any]:
        return self.detector.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state)
