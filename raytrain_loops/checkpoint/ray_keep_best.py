"""``KeepBest``, a Ray Train controller callback; runs in the Train controller's process (on the
driver's node). It keeps the best ``checkpoint.keep`` checkpoints by ``checkpoint.score_metric``
in the run directory's ``best/`` (:class:`~raytrain_loops.checkpoint.best.BestCheckpoints`).
"""

from __future__ import annotations

from typing import Any

from ray.train.v2.api.callback import UserCallback

from raytrain_loops import storage
from raytrain_loops.checkpoint.best import BEST, BestCheckpoints

__all__ = ["BEST", "KeepBest"]


class KeepBest(UserCallback):
    """Keeps the best checkpoints by ``checkpoint.score_metric`` in ``<run>/best/``.

    Ray's own retention stays by recency, so the newest checkpoint and the one before it (the
    fallback when the newest is damaged) are always there. After each checkpoint Ray registers
    (in the Train controller), this ranks it by the metric of the same report.
    """

    def __init__(self, run_dir: str, metric: str, mode: str, keep: int):
        self.best = BestCheckpoints(run_dir, metric, mode, keep)

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if checkpoint is not None:
            self.best.add(metrics[0] if metrics else {}, storage.name(checkpoint.path))
