"""The loop's reporter without Ray's part: a worker's checkpoint files, and the restore of a run's
newest intact checkpoint, which the workers of a group go through together (their agreement:
:mod:`raytrain_loops.checkpoint.restore`). A Ray worker's :class:`~raytrain_loops.checkpoint.ray_reporter.RayReporter`
and a local run's :class:`~raytrain_loops.checkpoint.local_reporter.LocalReporter` build on it; the files
themselves are :mod:`raytrain_loops.checkpoint.files`."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from typing import Any, Protocol

from raytrain_loops import storage
from raytrain_loops.checkpoint import files as ckpt_files
from raytrain_loops.checkpoint.restore import FailedElsewhere, agree, merged_candidates
from raytrain_loops.config import ConfigError
from raytrain_loops.engine import Engine
from raytrain_loops.engine.distributed import collectives
from raytrain_loops.engine.loop import Position


class DataPositions(Protocol):
    """A batch source that records data positions itself: ``record`` gives what a checkpoint
    keeps of this worker's data at a loop position, ``resume`` the loop's position from every
    writer's record (None where a worker of a group of the same size did not read another's;
    ``records`` None: nothing to resume, the source's own plans from the beginning)."""

    def record(self, position: Position) -> dict[str, Any]: ...

    def resume(self, records: list[Any] | None) -> Position: ...


class CheckpointReporter:
    """Writes this worker's part of a checkpoint; restores the run's newest intact checkpoint.
    Subclasses report (:meth:`report`) and give a local copy of a checkpoint (:meth:`_local_copy`)."""

    def __init__(self, engine: Engine, rank: int, world: int, run_dir: str):
        self.engine, self.rank, self.world, self.run_dir = engine, rank, world, run_dir
        # The batch source, when it records data positions in rows on the epoch's deal
        # (record/resume, :class:`~raytrain_loops.runtime.batches.Batches`); else the loop's
        # positions are recorded as they are.
        self.data: DataPositions | None = None
        self.loaded: dict[str, Any] | None = None  # what restore() loaded: path, model digest, skipped
        self._partial: str | None = None  # a checkpoint whose failed load had begun writing into the engine

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

    def _write(self, checkpoint: Position, node_id: str | None, **where: Any) -> str:
        """A scratch directory holding this worker's files of a checkpoint of the engine's state
        now, with ``checkpoint`` (the data position to resume from), ``node_id`` (where it ran)
        and ``where`` (more of where its work ran, e.g. the nodes that preprocessed its rows);
        the caller moves it into the run directory."""
        tmp = storage.scratch_dir("ckpt")
        try:
            state = self.engine.state_dict()
            mine = {
                "rng": state.pop("rng"),
                "data": self._data_record(checkpoint),
                "world_size": self.world,
                "node_id": node_id,
                **where,
            }
            files = {ckpt_files.rank_file(self.rank): mine}
            if self.engine.sharded:
                ckpt_files.write_sharded(tmp, self.rank, files, state, self.world)
            else:
                if self.rank == 0:
                    files[ckpt_files.STATE] = state
                ckpt_files.write_files(tmp, self.rank, files, self.world)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp

    @contextlib.contextmanager
    def _local_copy(self, path: str) -> Iterator[str]:
        """A local directory holding the files of the checkpoint ``path``."""
        if not storage.is_uri(path):
            yield path
            return
        local = storage.scratch_dir("restore")
        try:
            yield storage.download_dir(path, local)
        finally:
            shutil.rmtree(local, ignore_errors=True)

    def restore_from(self, paths: list[str], init_checkpoint: str | None = None) -> Position | None:
        """Load the first checkpoint of ``paths`` (newest first) that every worker can read, else
        ``init_checkpoint``, else nothing (a start from step 0); then check that every worker
        loaded the same.

        The workers go through the candidates together (every worker's listing, merged: a store
        whose listing lags on one worker does not make it take an older checkpoint than the
        others). For each, every worker reads and checks what it needs on its own (the files,
        their checksums, a sharded checkpoint's metadata), and the workers vote before loading
        it, and again after: the load of a sharded checkpoint runs collectives, which a worker
        that moved on would leave the others waiting in. Damage any worker sees
        (:class:`~raytrain_loops.checkpoint.files.CheckpointError`) moves every worker on to
        the one before; any other error (out of memory, an I/O error) stops the restore on
        every worker. When every checkpoint is damaged (a first upload cut off by a
        preemption), the run starts again from the beginning, and ``loaded`` says so.
        """
        skipped: list[dict[str, str]] = []
        position, failure = None, None
        try:
            for path in merged_candidates(paths):
                position = self._load_together(path, skipped)
                if position is not None:
                    break
            if position is None:
                self._no_intact_checkpoint(skipped, bool(paths), init_checkpoint)
            if position is None and init_checkpoint:
                position = self._load_together(init_checkpoint, skipped)
                if position is None:
                    raise ckpt_files.CheckpointError(f"{init_checkpoint} is unusable: {skipped[-1]['reason']}")
                self.loaded["init"] = True  # another run's checkpoint: this run starts from it
        except FailedElsewhere:
            pass  # agree() below names the worker(s) and their errors
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

    def _no_intact_checkpoint(self, skipped: list[dict[str, str]], listed: bool, init_checkpoint: str | None) -> None:
        """No checkpoint of the run could be loaded: raise where starting again would lose the
        run's progress for a fixable cause, or the model already holds part of a failed load;
        else warn (rank 0) and go on from ``init_checkpoint`` or the beginning."""
        refused = [s for s in skipped if s["refused"]]
        if refused:
            # Whole files that weights_only refuses (a type in the saved state it does not
            # allow): starting again would throw the run's progress away for a fixable cause.
            raise ckpt_files.CheckpointError(
                f"no checkpoint of {self.run_dir} could be loaded, and {len(refused)} were refused by "
                f"torch.load(weights_only=True) rather than damaged; the newest: {refused[0]['reason']}"
            )
        if self._partial and not init_checkpoint:
            raise ckpt_files.CheckpointError(
                f"no checkpoint of {self.run_dir} could be loaded, and the failed load of {self._partial} had "
                "already written part of its state into the model: it cannot start from the beginning"
            )
        if listed and self.rank == 0:
            start = f"from {init_checkpoint}" if init_checkpoint else "from the beginning"
            print(f"warning: no intact checkpoint in {self.run_dir} ({len(skipped)} damaged); starting {start}", flush=True)

    def _load_together(self, path: str, skipped: list[dict[str, str]]) -> Position | None:
        """Load ``path`` on every worker, or on none (None, and ``skipped`` says why): each worker
        reads and checks it on its own, the workers vote, load it (collectively, when sharded)
        and vote again."""
        with contextlib.ExitStack() as stack:
            read, error = None, None
            try:
                directory = stack.enter_context(self._local_copy(path))
                read = self._read(directory)
            except Exception as err:
                error = err
            if not self._vote(path, error, skipped):
                return self._abandon()
            position, loaded = None, None
            try:
                position, loaded = self._apply(path, directory, *read)
            except Exception as err:
                error = err
                if getattr(err, "partial", False):
                    self._partial = path
            if not self._vote(path, error, skipped):
                return self._abandon()
            self.loaded = {**loaded, "skipped": skipped}
            return position

    def _abandon(self) -> None:
        """A checkpoint given up: the batch source forgets the position it took from it."""
        if self.data is not None:
            self.data.resume(None)

    def _vote(self, path: str, error: Exception | None, skipped: list[dict[str, str]]) -> bool:
        """Every worker's outcome of one step of loading ``path``, gathered: True when every worker
        succeeded. Damage on any worker: False on every worker, and ``skipped`` (identical on every
        worker) names it. Any other error: the worker that met it raises it, the others
        :class:`FailedElsewhere`."""
        damaged = isinstance(error, ckpt_files.CheckpointError)
        mine = {
            "damage": str(error) if damaged else None,
            "refused": damaged and error.refused,
            "failed": error is not None and not damaged,
        }
        everyone = collectives.all_gather_object(mine)
        if mine["failed"]:
            raise error
        if any(o["failed"] for o in everyone):
            raise FailedElsewhere
        damage = {r: o["damage"] for r, o in enumerate(everyone) if o["damage"]}
        if not damage:
            return True
        if len(damage) == len(everyone) and len(set(damage.values())) == 1:
            reason = damage[0]
        else:
            reason = "; ".join(f"worker {r}: {m}" for r, m in damage.items())
        if self.rank == 0:
            print(f"warning: checkpoint {path} is unusable, trying the one before: {reason}", flush=True)
        skipped.append({"checkpoint": path, "reason": reason, "refused": any(o["refused"] for o in everyone)})
        return False

    def _data_record(self, position: Position) -> dict[str, Any]:
        if self.data is None:
            return {"epoch": position.epoch, "batches": position.batches}
        return self.data.record(position)

    def _read(self, d: str) -> tuple[int, dict[str, Any], dict[str, Any], Position]:
        """What this worker reads of a checkpoint on its own (no collectives): its manifests and
        checksums, the shared state, its own files, a sharded checkpoint's metadata, the data
        position. Returns the size of the group that wrote it, the shared state, this worker's
        files (rank 0's for a group of another size, which takes no RNG state) and the loop's
        position (from every writer's record for a group of another size, which re-cuts the
        epoch: before the vote, so that a record no worker can resume from is damage on all)."""
        world = ckpt_files.verify(d)
        shared = ckpt_files.read_file(d, ckpt_files.STATE)
        mine = ckpt_files.read_file(d, ckpt_files.rank_file(self.rank if world == self.world else 0))
        records: list[Any] = [None] * world  # the same size: each worker resumes its own record alone
        records[self.rank if world == self.world else 0] = mine.get("data")
        if world != self.world:
            records[1:] = [ckpt_files.read_file(d, ckpt_files.rank_file(r)).get("data") for r in range(1, world)]
        if ckpt_files.is_sharded(d):
            ckpt_files.check_sharded(d)
        return world, shared, mine, self._position(world, records)

    def _apply(
        self, path: str, d: str, world: int, shared: dict[str, Any], mine: dict[str, Any], position: Position
    ) -> tuple[Position, dict[str, Any]]:
        """Load what :meth:`_read` read into the engine (every worker together); return the data
        position and what was loaded (for ``loaded``)."""
        if ckpt_files.is_sharded(d):
            # Every worker reads the parts of the shards it holds now (any group size).
            targets = self.engine.sharded_targets()
            ckpt_files.read_sharded(d, targets)
            shared, digest = {**shared, **targets}, ckpt_files.sharded_digest(d)
        elif self.engine.sharded:
            # A plain checkpoint (a run that went on under DDP until now): each worker cuts its shards.
            digest = ckpt_files.digest(shared["model"])
            targets = self.engine.sharded_targets()
            ckpt_files.fill_from_plain(targets, shared)
            shared = {**shared, **targets, "layout": "sharded"}
        else:
            digest = ckpt_files.digest(shared["model"])
        state = {**shared, "rng": mine["rng"]} if world == self.world else shared
        try:
            self.engine.load_state_dict(state)
        except RuntimeError as err:
            raise _model_changed(path, err) from None
        return position, {"checkpoint": path, "model_sha256": digest, "world_size": world}

    def _position(self, world: int, records: list[Any]) -> Position:
        """The loop's position from the writers' data ``records``: through the batch source (the
        same group size: this worker's own; another: the epoch re-cut), else rank 0's rescaled.
        A record the source cannot resume from is damage (the vote names the checkpoint)."""
        if self.data is None:
            data = records[self.rank if world == self.world else 0]
            batches = int(data["batches"])
            return Position(int(data["epoch"]), batches * world // self.world if world != self.world else batches)
        try:
            return self.data.resume(records)
        except ValueError as err:
            raise ckpt_files.CheckpointError(f"its data position cannot be resumed: {err}") from None


def _model_changed(path: str, err: RuntimeError) -> Exception:
    """torch's error for weights that do not fit the model (``Error(s) in loading state_dict``)
    as one that says what happened and what to do: the task's model changed since ``path`` was
    written. Any other error as it is."""
    lines = [line.strip().rstrip(".") for line in str(err).splitlines() if line.strip()]
    if not lines or not lines[0].startswith("Error(s) in loading state_dict"):
        return err
    detail = "; ".join(lines[1:3]) + ("; ..." if len(lines) > 3 else "")
    return ConfigError(
        "run.name",
        f"checkpoint {path} holds the weights of another model than the task builds now ({detail}): the task's "
        "model changed since it was written. To train this model anew, give the run a new name (run.name=...)",
    )

