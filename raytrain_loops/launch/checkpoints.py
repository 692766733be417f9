"""The loop's reporter on Ray: ``ray.train.report`` with checkpoint files, and the restore of a
run's newest intact checkpoint. The files themselves are :mod:`raytrain_loops.engine.checkpoint`."""

from __future__ import annotations

import json
import math
import shutil
from typing import Any

import ray
import ray.train
from ray.train.v2.api.callback import UserCallback

from raytrain_loops.engine import Engine
from raytrain_loops.engine import checkpoint as ckpt_files
from raytrain_loops.engine.distributed import collectives
from raytrain_loops.engine.loop import Position
from raytrain_loops.launch import storage
from raytrain_loops.launch.rundir import checkpoint_dirs


class RayReporter:
    """Writes this worker's part of a checkpoint and reports it; restores the run's newest intact
    checkpoint."""

    def __init__(self, engine: Engine, rank: int, world: int, run_dir: str):
        self.engine, self.rank, self.world, self.run_dir = engine, rank, world, run_dir
        self.loaded: dict[str, Any] | None = None  # what restore() loaded: path, model digest, skipped

    def _dir_name(self) -> str:
        """``checkpoint_<step>``; with a suffix when that directory exists (written by an attempt
        that failed, or found damaged), so a new checkpoint never merges into an old one. Only
        rank 0's name counts: Ray gives every worker's files the name rank 0 chose."""
        name = f"checkpoint_{self.engine.step:08d}"
        if self.rank != 0:
            return name
        candidate, n = name, 1
        while storage.exists(storage.join(self.run_dir, candidate)):
            n += 1
            candidate = f"{name}-{n}"
        return candidate

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
        tmp = storage.scratch_dir("ckpt")
        try:
            state = self.engine.state_dict()
            mine = {
                "rng": state.pop("rng"),
                "data": {"epoch": checkpoint.epoch, "batches": checkpoint.batches},
                "world_size": self.world,
                "node_id": ray.get_runtime_context().get_node_id(),  # where this worker ran
            }
            files = {ckpt_files.rank_file(self.rank): mine}
            if self.engine.sharded:
                ckpt_files.write_sharded(tmp, self.rank, files, state, self.world)
            else:
                if self.rank == 0:
                    files[ckpt_files.STATE] = state
                ckpt_files.write_files(tmp, self.rank, files, self.world)
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

    def restore_from(self, paths: list[str], init_checkpoint: str | None = None) -> Position | None:
        """Load the first intact checkpoint of ``paths`` (newest first), else ``init_checkpoint``,
        else nothing (a start from step 0); then check that every worker loaded the same.

        Only damage (:class:`~raytrain_loops.engine.checkpoint.CheckpointError`) moves on to the
        one before; any other error while reading (out of memory, an I/O error) stops the
        restore on every worker. When every checkpoint is damaged (a first upload cut off by a
        preemption), the run starts again from the beginning, and ``loaded`` says so.
        """
        skipped: list[dict[str, str]] = []
        position, failure = None, None
        try:
            position = self._first_intact(paths, skipped)
            refused = [s for s in skipped if s["refused"]]
            if position is None and refused:
                # Whole files that weights_only refuses (a type in the saved state it does not
                # allow): starting again would throw the run's progress away for a fixable cause.
                raise ckpt_files.CheckpointError(
                    f"no checkpoint of {self.run_dir} could be loaded, and {len(refused)} were refused by "
                    f"torch.load(weights_only=True) rather than damaged; the newest: {refused[0]['reason']}"
                )
            if position is None and paths and self.rank == 0:
                start = f"from {init_checkpoint}" if init_checkpoint else "from the beginning"
                print(
                    f"warning: no intact checkpoint in {self.run_dir} ({len(skipped)} damaged); starting {start}",
                    flush=True,
                )
            if position is None and init_checkpoint:
                position = self._load(ray.train.Checkpoint(init_checkpoint), skipped)
                self.loaded["init"] = True  # another run's checkpoint: this run starts from it
        except Exception as err:  # every worker learns of it below, instead of waiting on the others
            failure = err
        if position is None and failure is None and skipped:
            self.loaded = {
                "checkpoint": None,
                "model_sha256": None,
                "world_size": self.world,
                "skipped": skipped,
                "started_fresh": True,
            }
        agree(self.loaded, self.rank, failure)
        return position

    def _first_intact(self, paths: list[str], skipped: list[dict[str, str]]) -> Position | None:
        for path in paths:
            try:
                return self._load(ray.train.Checkpoint(path), skipped)
            except ckpt_files.CheckpointError as err:
                if self.rank == 0:
                    print(f"warning: checkpoint {path} is unusable, trying the one before: {err}", flush=True)
                skipped.append({"checkpoint": path, "reason": str(err), "refused": err.refused})
        return None

    def _load(self, checkpoint, skipped: list[dict[str, str]]) -> Position:
        with checkpoint.as_directory() as d:
            world = ckpt_files.verify(d)
            shared = ckpt_files.read_file(d, ckpt_files.STATE)
            # A group of another size (an elastic resize) takes rank 0's position, rescaled.
            mine = ckpt_files.read_file(d, ckpt_files.rank_file(self.rank if world == self.world else 0))
            if ckpt_files.is_sharded(d):
                # Every worker reads the parts of the shards it holds now (any group size).
                targets = self.engine.sharded_targets()
                ckpt_files.read_sharded(d, targets)
                shared, digest = {**shared, **targets}, ckpt_files.sharded_digest(d)
            else:
                digest = ckpt_files.digest(shared["model"])
        state = {**shared, "rng": mine["rng"]} if world == self.world else shared
        self.engine.load_state_dict(state)
        self.loaded = {
            "checkpoint": checkpoint.path,
            "model_sha256": digest,
            "world_size": world,
            "skipped": skipped,
        }
        batches = mine["data"]["batches"]
        return Position(int(mine["data"]["epoch"]), batches * world // self.world if world != self.world else batches)


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


BEST = "best"


def ranked(entries: list[dict[str, Any]], mode: str, k: int | None) -> list[dict[str, Any]]:
    """The best ``k`` (all when None) of ``entries`` ({checkpoint, step, score}), best first;
    of equal scores the newer first. An entry without a numeric score (the metric was not
    reported yet, or is NaN) is never among them."""
    scored = [e for e in entries if isinstance(e["score"], int | float) and not math.isnan(e["score"])]
    sign = -1.0 if mode == "max" else 1.0
    scored.sort(key=lambda e: (sign * e["score"], -ckpt_files.order_key(e["checkpoint"])[0], e["checkpoint"]))
    return scored if k is None else scored[:k]


class KeepBest(UserCallback):
    """Keeps the best checkpoints by ``checkpoint.score_metric`` in ``<run>/best/``.

    Ray's own retention stays by recency, so the newest checkpoint and the one before it (the
    fallback when the newest is damaged) are always there. After each checkpoint Ray registers
    (in the Train controller), this ranks it by the metric of the same report and, when it is
    among the best ``keep``, links (a local run) or copies (an object store, server side) it to
    ``best/<name>``, dropping the copy that fell out. ``best/best.json`` lists them, best first.
    With ``keep=0`` every checkpoint stays where it is and ``best.json`` ranks them in place.
    """

    def __init__(self, run_dir: str, metric: str, mode: str, keep: int):
        self.run_dir, self.metric, self.mode, self.keep = run_dir, metric, mode, keep or None

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if checkpoint is None:
            return
        try:
            self._rank(metrics[0] if metrics else {}, storage.name(checkpoint.path))
        except Exception as err:  # the best copies are a convenience: a storage hiccup must not end the run
            print(f"warning: could not update {storage.join(self.run_dir, BEST)}: {err}", flush=True)

    def _rank(self, metrics: dict[str, Any], name: str) -> None:
        score = metrics.get(self.metric)
        if self.metric.startswith("eval_") and metrics.get("evaluated_step") != metrics.get("step"):
            score = None  # the report carries an earlier step's evaluation: these weights were not evaluated
        index = storage.join(self.run_dir, BEST, "best.json")
        before = json.loads(storage.read_text(index) or "[]")
        entry = {"checkpoint": name, "step": ckpt_files.step_of(name), "score": score}
        best = ranked([e for e in before if e["checkpoint"] != name] + [entry], self.mode, self.keep)
        if self.keep is not None:
            kept = {e["checkpoint"] for e in best}
            if name in kept:
                storage.copy_tree(storage.join(self.run_dir, name), storage.join(self.run_dir, BEST, name))
            for old in before:
                if old["checkpoint"] not in kept:
                    storage.delete_tree(storage.join(self.run_dir, BEST, old["checkpoint"]))
        for e in best:
            e["path"] = storage.join(self.run_dir, *([BEST] if self.keep else []), e["checkpoint"])
        storage.write_text(index, json.dumps(best, indent=1) + "\n")
