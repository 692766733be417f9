"""The run directory's layout: the names of the files every process that runs a part of the run
reads or writes (the driver, the workers, the Train controller, local mode, the tools), and its
checkpoints, listed in order."""

from __future__ import annotations

import json

from raytrain_loops import storage
from raytrain_loops.engine.checkpoint import files as ckpt_files

LOCK = "driver.lock"
CHANGES = "config_changes.jsonl"
ARTEFACTS = "artefacts"  # the task's pinned files: <run>/artefacts/<name>
ARTEFACTS_FILE = "artefacts.json"  # their SHA-256 and the prepared data's digest
SUMMARY = "summary.json"  # a finished run's metrics; removed when the run trains again
PRECISION_FILE = "precision.json"  # the dtype the run trains in (precision.dtype=auto resolved at its first start)
MODEL_FILE = "model.json"  # the task's class and its model's parameter and buffer shapes, recorded at the first start


def checkpoint_dirs(run_dir: str) -> list[str]:
    """The run's checkpoint directories, oldest first."""
    paths = [p for p in storage.list_dirs(run_dir) if ckpt_files.step_of(storage.name(p)) >= 0]
    return sorted(paths, key=lambda p: ckpt_files.order_key(storage.name(p)))


def exported_checkpoint(path: str, which: str = "newest") -> tuple[str, str]:
    """The checkpoint a tool reads for ``path``: ``path`` itself when it is a checkpoint; for a
    run directory its newest intact checkpoint (``which="newest"``, damaged ones passed over) or
    the best by ``checkpoint.score_metric`` (``which="best"``, from ``best/best.json``). Returns
    (checkpoint, why it was chosen); a CheckpointError naming the path when there is none."""
    if storage.exists(storage.join(path, ckpt_files.manifest_name(0))):
        if which == "best":
            raise ckpt_files.CheckpointError(f"{path} is a checkpoint: --checkpoint best takes a run directory")
        return path, "as given"
    if not storage.exists(storage.join(path, "config.yaml")):
        raise ckpt_files.CheckpointError(
            f"{path} is neither a checkpoint (no {ckpt_files.manifest_name(0)}) nor a run directory"
        )
    if which == "best":
        ranking = storage.read_text(storage.join(path, "best", "best.json"))
        if not ranking or not json.loads(ranking):
            raise ckpt_files.CheckpointError(f"{path} has no best/best.json: the run set no checkpoint.score_metric")
        name = json.loads(ranking)[0]["checkpoint"]
        copy = storage.join(path, "best", name)
        return (copy if storage.exists(copy) else storage.join(path, name)), "the run's best by its score metric"
    skipped = []
    for candidate in reversed(checkpoint_dirs(path)):
        try:
            ckpt_files.verify(candidate)
        except ckpt_files.CheckpointError as err:
            skipped.append(f"{storage.name(candidate)} ({err})")
            continue
        why = "the run's newest intact checkpoint" + (f"; passed over: {', '.join(skipped)}" if skipped else "")
        return candidate, why
    raise ckpt_files.CheckpointError(f"{path} holds no intact checkpoint" + (f": {', '.join(skipped)}" if skipped else ""))
