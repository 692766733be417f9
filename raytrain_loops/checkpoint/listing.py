"""A run directory's checkpoints: listed in order, the newest complete one, the one a tool reads,
and the older ones dropped beyond ``checkpoint.keep`` (a local run's retention; Ray Train keeps a
Ray run's)."""

from __future__ import annotations

import json

from raytrain_loops import storage
from raytrain_loops.checkpoint import files as ckpt_files


def checkpoint_dirs(run_dir: str) -> list[str]:
    """The run's checkpoint directories, oldest first."""
    paths = [p for p in storage.list_dirs(run_dir) if ckpt_files.step_of(storage.name(p)) >= 0]
    return sorted(paths, key=lambda p: ckpt_files.order_key(storage.name(p)))


def last_checkpoint(run_dir: str) -> str | None:
    """The run's newest checkpoint whose workers all wrote their manifests (their files are
    verified when a run resumes from it); None when there is none."""
    for path in reversed(checkpoint_dirs(run_dir)):
        try:
            world = int(
                json.loads(storage.read_text(storage.join(path, ckpt_files.manifest_name(0))) or "{}")["world_size"]
            )
        except (ValueError, KeyError, TypeError):
            continue
        if all(storage.exists(storage.join(path, ckpt_files.manifest_name(rank))) for rank in range(1, world)):
            return path
    return None


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


def retain(run_dir: str, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints of ``run_dir`` (``keep`` 0: every one stays)."""
    if keep:
        for old in checkpoint_dirs(run_dir)[:-keep]:
            storage.delete_tree(old)
