"""A local run's checkpoints: each written into the run directory as a Ray run's are (whole or
not at all on a local file system), then kept and ranked as Ray keeps them."""

from __future__ import annotations

import os
import shutil
from typing import Any

from raytrain_loops import storage
from raytrain_loops.checkpoint.best import BestCheckpoints
from raytrain_loops.checkpoint.listing import retain
from raytrain_loops.checkpoint.reporter import CheckpointReporter
from raytrain_loops.checkpoint.restore import candidates
from raytrain_loops.config import Config
from raytrain_loops.console.feed import Sender
from raytrain_loops.engine import Engine
from raytrain_loops.engine.loop import Position

__all__ = ["LocalReporter"]


class LocalReporter(CheckpointReporter):
    """A local run's reports: the last metrics kept (the run's result), each checkpoint written
    into the run directory (a local one: under a hidden name, then renamed), then Ray's retention
    (``checkpoint.keep``, the newest) and ``best/`` by ``checkpoint.score_metric``, as a Ray run
    keeps them."""

    def __init__(self, engine: Engine, run_dir: str, config: Config, sender: Sender):
        super().__init__(engine, 0, 1, run_dir)
        c = config.checkpoint
        self.keep, self.sender = c.keep, sender
        self.best = BestCheckpoints(run_dir, c.score_metric, c.score_mode, c.keep) if c.score_metric else None
        self.metrics: dict[str, Any] = {}
        self.checkpoint: str | None = None

    def report(self, metrics: dict[str, Any], checkpoint: Position | None) -> None:
        self.metrics = dict(metrics)
        if checkpoint is None:
            return
        name = self._dir_name()
        dest = storage.join(self.run_dir, name)
        tmp = self._write(checkpoint, None)
        try:
            _place(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.checkpoint = dest
        self.sender.checkpoint(metrics.get("step"), dest)
        if self.best is not None:
            self.best.add(metrics, name)
        retain(self.run_dir, self.keep)

    def restore(self, init_checkpoint: str | None = None) -> Position | None:
        return self.restore_from(candidates(self.run_dir, None), init_checkpoint)


def _place(tmp: str, dest: str) -> None:
    """Move a checkpoint written in ``tmp`` to ``dest``: on a local file system whole or not at all
    (moved under a hidden name, a rename where both are on one file system, then renamed); to an
    object store, its files uploaded (the manifests tell a complete checkpoint from a cut one)."""
    if storage.is_uri(dest):
        storage.upload_dir(tmp, dest)
        return
    partial = os.path.join(os.path.dirname(dest), f".{os.path.basename(dest)}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.move(tmp, partial)
    os.rename(partial, dest)
