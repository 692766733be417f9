"""The loop's reporter on Ray; runs on every Ray Train worker: ``ray.train.report`` with checkpoint
files, and the restore of a run's newest intact checkpoint (the workers' agreement on it:
:mod:`raytrain_loops.runtime.reporter`, :mod:`raytrain_loops.runtime.restore`)."""

from __future__ import annotations

import shutil
from typing import Any

import ray
import ray.train

from raytrain_loops.engine.loop import Position
from raytrain_loops.runtime.reporter import CheckpointReporter
from raytrain_loops.runtime.restore import candidates
from raytrain_loops.worker.batches import PREPROCESSED_ON


class RayReporter(CheckpointReporter):
    """Writes this worker's part of a checkpoint and reports it to Ray; restores the run's newest
    intact checkpoint."""

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
        tmp = self._write(checkpoint, node, preprocessed_on=dict(PREPROCESSED_ON))
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
