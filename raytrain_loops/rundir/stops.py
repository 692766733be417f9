"""A stop that a retry cannot fix, agreed by every worker through the run's store.

The engine's errors of the :class:`~raytrain_loops.errors.TrainingError` family come from
all-reduced values, so every worker raises them at the same step; every worker then ends the
attempt normally (no retry) and the driver raises :class:`TrainingStopped`. A ``TrainingError``
raised by one worker alone (a task's criterion or a callback deciding from its own values)
would end that worker only, and the others would wait in their next collective until its
timeout (half an hour by default), while Ray reads the return value of rank 0 alone.

So a worker that stops posts its stop in the run directory and waits a few seconds for every
worker's. When all have posted, they return normally. When not, it raises: Ray tears the group
down at once, and a restarted group finds the posted stop and ends before training, on every
worker. The driver raises the posted stop whichever way the group ended.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass

from raytrain_loops import storage
from raytrain_loops.errors import Stopped, TrainingStopped

AGREE_S = 10.0  # how long a stopping worker waits for the others' stops


@dataclass(frozen=True)
class StopBoard:
    """Where the workers of one ``fit`` (all its attempts) post their stops: ``<run>/stops/<id>/``."""

    path: str
    max_workers: int

    @classmethod
    def new(cls, run_dir: str, max_workers: int) -> StopBoard:
        return cls(storage.join(run_dir, "stops", uuid.uuid4().hex[:12]), max_workers)

    def _file(self, rank: int) -> str:
        return storage.join(self.path, f"rank{rank}.json")

    def post(self, rank: int, stopped: Stopped) -> None:
        storage.write_text(self._file(rank), json.dumps(asdict(stopped)) + "\n")

    def agreed(self, world: int, timeout: float = AGREE_S) -> bool:
        """Whether all ``world`` workers posted a stop within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        pending = set(range(world))
        while True:
            pending = {r for r in pending if not storage.exists(self._file(r))}
            if not pending or time.monotonic() > deadline:
                return not pending
            time.sleep(0.1)

    def posted(self) -> Stopped | None:
        """The stop of the lowest rank that posted one, or None."""
        for rank in range(self.max_workers):
            text = storage.read_text(self._file(rank))
            if text:
                return Stopped(**json.loads(text))
        return None


def fit_or_stop(trainer, board: StopBoard):
    """``trainer.fit()``; raise :class:`TrainingStopped` when a worker posted a stop, whether the
    group then ended normally or failed (its attempts used up)."""
    try:
        result = trainer.fit()
    except Exception:
        stopped = board.posted()
        if stopped is None:
            raise
        raise TrainingStopped(stopped.kind, stopped.message, stopped.step) from None
    stopped = board.posted() or (result.return_value if isinstance(result.return_value, Stopped) else None)
    if stopped is not None:
        raise TrainingStopped(stopped.kind, stopped.message, stopped.step)
    return result
