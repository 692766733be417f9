"""The workers' agreement on what they restore; runs on every Ray Train worker (and in any process
group). The candidates a run's checkpoints offer, every worker's list merged, and the final check
that every worker loaded the same checkpoint with the same weights (or learns of the one that
failed), so that no worker trains on alone or waits in a collective for the others.
"""

from __future__ import annotations

from typing import Any

from raytrain_loops import storage
from raytrain_loops.checkpoint import files as ckpt_files
from raytrain_loops.checkpoint.listing import checkpoint_dirs
from raytrain_loops.engine.distributed import collectives


class FailedElsewhere(Exception):
    """Another worker's restore failed (not for damage): :func:`agree` names it."""



def merged_candidates(paths: list[str]) -> list[str]:
    """Every worker's candidate paths, merged, newest first: the same list on every worker."""
    everyone = collectives.all_gather_object(list(paths))
    merged = {p for listing in everyone for p in listing}
    return sorted(merged, key=lambda p: (ckpt_files.order_key(storage.name(p)), p), reverse=True)



class RestoreMismatch(RuntimeError):
    """The workers of a group did not all load the same checkpoint, or one of them failed to."""



def candidates(run_dir: str, registered: str | None) -> list[str]:
    """The run's checkpoint directories, newest first, with ``registered`` (the one Ray holds)
    among them even when the listing does not show it."""
    paths = checkpoint_dirs(run_dir)
    if registered is not None and storage.name(registered) not in map(storage.name, paths):
        # Ray's path is one on its file system (no scheme for a bucket): name it in the run's terms.
        paths.append(storage.join(run_dir, storage.name(registered)))
    return sorted(paths, key=lambda p: ckpt_files.order_key(storage.name(p)), reverse=True)



def agree(loaded: dict[str, Any] | None, rank: int, failure: BaseException | None = None) -> None:
    """Check, across the process group (when one is running), that every worker restored the
    same checkpoint with the same weights; raise :class:`RestoreMismatch` naming each worker's
    (checkpoint, step, weights digest) when not. A worker whose own restore failed (``failure``)
    re-raises its error; the others raise naming it, instead of training on without it."""
    name = storage.name(loaded["checkpoint"]) if loaded and loaded["checkpoint"] else None
    mine = {
        "checkpoint": name,
        "step": ckpt_files.step_of(name) if name else 0,
        "model_sha256": loaded["model_sha256"] if loaded else None,
        "error": f"{type(failure).__name__}: {failure}" if failure else None,
    }
    everyone = collectives.all_gather_object(mine)
    if failure is not None:
        raise failure
    failed = {r: o["error"] for r, o in enumerate(everyone) if o["error"]}
    if failed:
        raise RestoreMismatch(f"worker(s) failed to restore a checkpoint: {failed}")
    views = [tuple(o[k] for k in ("checkpoint", "step", "model_sha256")) for o in everyone]
    if len(set(views)) > 1:
        detail = "; ".join(f"worker {r}: {v}" for r, v in enumerate(views))
        raise RestoreMismatch(
            f"the workers restored different checkpoints (checkpoint, step, weights digest): {detail}"
        )
