"""The run directory's layout: the names of the files every process that runs a part of the run
reads or writes (the driver, the workers, the Train controller, local mode, the tools), and its
checkpoints, listed in order."""

from __future__ import annotations

from raytrain_loops import storage
from raytrain_loops.engine.checkpoint import files as ckpt_files

LOCK = "driver.lock"
CHANGES = "config_changes.jsonl"
ARTEFACTS = "artefacts"  # the task's pinned files: <run>/artefacts/<name>
ARTEFACTS_FILE = "artefacts.json"  # their SHA-256 and the prepared data's digest
SUMMARY = "summary.json"  # a finished run's metrics; removed when the run trains again
PRECISION_FILE = "precision.json"  # the dtype the run trains in (precision.dtype=auto resolved at its first start)


def checkpoint_dirs(run_dir: str) -> list[str]:
    """The run's checkpoint directories, oldest first."""
    paths = [p for p in storage.list_dirs(run_dir) if ckpt_files.step_of(storage.name(p)) >= 0]
    return sorted(paths, key=lambda p: ckpt_files.order_key(storage.name(p)))
