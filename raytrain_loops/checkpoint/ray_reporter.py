"""The loop's reporter on Ray; runs on every Ray Train worker: ``ray.train.report`` with checkpoint
files, and the restore of a run's newest intact checkpoint (the workers' agreement on it:
:mod:`raytrain_loops.checkpoint.reporter`, :mod:`raytrain_loops.checkpoint.restore`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

import ray
import ray.train

from raytrain_loops import ray_private
from raytrain_loops.checkpoint.reporter import CheckpointReporter
from raytrain_loops.checkpoint.restore import candidates
from raytrain_loops.console.feed import Sender
from raytrain_loops.engine import Engine
from raytrain_loops.engine.coalesce import skipping_note
from raytrain_loops.engine.loop import Position

POLL_S_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"  # Ray Train's controller polls its workers this often
RAY_POLL_S = 2.0  # Ray's default


class RayReporter(CheckpointReporter):
    """Writes this worker's part of a checkpoint and reports it to Ray; restores the run's newest
    intact checkpoint. ``sender``: rank 0's console; ``preprocessed_on``: the rows preprocessed
    on each node so far (the batch source's count, read at each checkpoint)."""

    def __init__(
        self,
        engine: Engine,
        rank: int,
        world: int,
        run_dir: str,
        sender: Sender | None = None,
        preprocessed_on: Mapping[str, int] | None = None,
    ):
        super().__init__(engine, rank, world, run_dir)
        self.sender = sender
        self.preprocessed_on = preprocessed_on if preprocessed_on is not None else {}

    def in_flight(self) -> bool:
        """Whether a report of this worker's is not yet taken by Ray Train's controller: uploading,
        waiting for its turn, or in the worker's result queue (one place: the controller takes one
        report per poll). Read from Ray's training context, which has no public reading of it
        (:func:`raytrain_loops.ray_private.report_in_flight`); where that is not as this expects,
        False (every report goes out)."""
        return bool(ray_private.report_in_flight())

    def skipped(self, last_sent: int | None, step: int, checkpoint: bool = False) -> None:
        """The loop skipped its first report (every worker's reporter is told; ``checkpoint``: it
        was to carry one): rank 0 says so."""
        if self.rank == 0 and self.sender is not None:
            poll_s = float(os.environ.get(POLL_S_ENV, RAY_POLL_S))
            self.sender.send("start", skipping_note(last_sent, step, poll_s, checkpoint))

    def report(self, metrics: dict[str, Any], checkpoint: Position | None) -> None:
        """``ray.train.report`` on every worker; with a checkpoint when ``checkpoint`` (the data
        position to resume from) is given.

        Reports are asynchronous: the training thread waits only for the other workers (a
        barrier), while the upload and the hand-over to Ray's controller (which polls every
        couple of seconds) happen on Ray's background thread, which then deletes the local copy.
        The files are written here first, so the checkpoint holds the state of this step.
        """
        async_mode = ray.train.CheckpointUploadMode.ASYNC
        if checkpoint is None:
            ray.train.report(metrics, checkpoint_upload_mode=async_mode)
            return
        node = ray.get_runtime_context().get_node_id()
        tmp = self._write(checkpoint, node, preprocessed_on=dict(self.preprocessed_on))
        try:
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(tmp),
                checkpoint_dir_name=self._dir_name(),
                checkpoint_upload_mode=async_mode,
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def restore(self, init_checkpoint: str | None = None) -> Position | None:
        """Load this run's newest intact checkpoint, else ``init_checkpoint`` (another run's, e.g.
        a PBT donor's); return the data position.

        The candidates are every checkpoint directory of the run, newest first: the one Ray
        registered last, and any newer one a failed attempt finished writing before Ray had
        registered it (reports are asynchronous). See :meth:`restore_from`.
        """
        latest = ray.train.get_checkpoint()
        return self.restore_from(candidates(self.run_dir, latest.path if latest else None), init_checkpoint)

    def _local_copy(self, path: str):
        return ray.train.Checkpoint(path).as_directory()
