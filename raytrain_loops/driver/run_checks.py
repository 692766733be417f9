"""The driver's hold on a run directory, before Ray starts: one driver at a time (a lock file in the
store) and a finished run recognised, so that running it again trains nothing.

A rerun's config is compared with the one the run was started with; the task's artefacts (a
tokenizer, a model's configuration, a digest of the prepared data) are pinned at the first start and
compared at every resume, and the task's model (its class, its parameters' and buffers' names and
shapes) recorded at the first start and compared at every rerun."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

from raytrain_loops import storage
from raytrain_loops.checkpoint import CheckpointError, checkpoint_dirs, step_of, verify
from raytrain_loops.config import Config, ConfigError
from raytrain_loops.rundir.layout import ARTEFACTS, ARTEFACTS_FILE, CHANGES, LOCK, MODEL_FILE, SUMMARY

if TYPE_CHECKING:
    from torch import nn

    from raytrain_loops.tasks import Task

# What a rerun may change: where and how the run executes (compilation and activation
# checkpointing included: they change how blocks compute, not the state a checkpoint holds), and
# how long it runs. Everything else shapes the state in the checkpoints (model, optimizer, data,
# the step's settings).
RESUMABLE_SECTIONS = ("scaling", "run", "logging", "compile", "checkpointing")
RESUMABLE_KEYS = ("loop.max_steps", "loop.epochs", "accum.micro_batch")  # auto keeps the update


class RunLocked(RuntimeError):
    """Another driver holds the run directory."""


_HELD: set[str] = set()  # the tokens of the locks this process holds


class RunLock:
    """``driver.lock`` in the run directory: the host, pid and time of the driver running it,
    refreshed every ``heartbeat_s`` seconds and removed when the driver exits. A lock is stale,
    and taken over with a warning, when its process is gone (same host) or its heartbeat is
    older than ``stale_after_s`` (any host)."""

    def __init__(self, run_dir: str, heartbeat_s: float = 30.0, stale_after_s: float = 300.0):
        self.path = storage.join(run_dir, LOCK)
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> str:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "token": self.token})

    def acquire(self) -> RunLock:
        """Take the lock, or raise :class:`RunLocked` naming the driver that holds it."""
        for _ in range(3):
            if storage.create_exclusive(self.path, self._body()):
                _HELD.add(self.token)
                self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
                self._thread.start()
                return self
            text = storage.read_text(self.path)
            holder = _parse(text)
            if text is None:
                continue  # released in between
            why = self.stale(holder)
            if why is None:
                raise RunLocked(
                    f"{self.path}: the run is in use by the driver with pid {holder['pid']} on {holder['host']} "
                    f"(heartbeat {time.time() - holder['time']:.0f}s ago); wait for it to end, or use another run.name"
                )
            print(f"warning: taking over {self.path}: {why}", flush=True)
            if storage.read_text(self.path) == text:  # not taken over by another driver meanwhile
                storage.delete(self.path)
        raise RunLocked(f"{self.path}: could not take the lock (other drivers keep taking it)")

    def stale(self, holder: dict[str, Any] | None) -> str | None:
        """Why the lock ``holder`` describes is stale, or None when its driver may be alive."""
        if holder is None:
            return "the lock file is unreadable"
        age = time.time() - holder["time"]
        if age > self.stale_after_s:
            return f"its heartbeat is {age:.0f}s old (pid {holder['pid']} on {holder['host']})"
        if holder["host"] == socket.gethostname():
            if not storage.pid_alive(holder["pid"]):
                return f"its driver (pid {holder['pid']}) is gone"
            if holder["pid"] == os.getpid() and holder.get("token") not in _HELD:
                # This pid, but a lock this process never took: an earlier process with the same
                # pid and host (a container restarted in place, where the driver is pid 1 again).
                return f"it was left by an earlier process with this pid ({holder['pid']})"
        return None

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                holder = _parse(storage.read_text(self.path))
                if holder is None or holder.get("token") != self.token:
                    return  # taken over after a stall longer than the stale limit: not ours to refresh
                storage.write_text(self.path, self._body())
            except Exception as err:  # a transient store error: the next beat tries again
                print(f"warning: could not refresh {self.path}: {type(err).__name__}: {err}", flush=True)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock, if it is still this driver's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        _HELD.discard(self.token)
        try:
            holder = _parse(storage.read_text(self.path))
            if holder is not None and holder.get("token") == self.token:
                storage.delete(self.path)
        except Exception as err:  # must not hide the run's own outcome; the lock goes stale
            print(f"warning: could not remove {self.path}: {type(err).__name__}: {err}", flush=True)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _parse(text: str | None) -> dict[str, Any] | None:
    try:
        data = json.loads(text) if text else None
        return {"host": str(data["host"]), "pid": int(data["pid"]), "time": float(data["time"]), **data}
    except (ValueError, KeyError, TypeError):
        return None


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys to leaf values (lists are leaves)."""
    if not isinstance(data, dict) or (prefix and not data):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def resumable(key: str) -> bool:
    return key.split(".", 1)[0] in RESUMABLE_SECTIONS or key in RESUMABLE_KEYS


_ABSENT = "<absent>"


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (old value, new value) for every key whose value differs."""
    a, b = flatten(old), flatten(new)
    keys = sorted(set(a) | set(b))
    return {k: (a.get(k, _ABSENT), b.get(k, _ABSENT)) for k in keys if a.get(k, _ABSENT) != b.get(k, _ABSENT)}


def _shown(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} ({old!r} -> {new!r})" for k, (old, new) in changes.items())


def check_config(run_dir: str, config: Config) -> dict[str, tuple[Any, Any]]:
    """Compare ``config`` with the ``config.yaml`` of a run directory that holds checkpoints.

    A change to what the checkpoints' state depends on (anything but ``scaling``, ``run``,
    ``logging``, ``compile``, ``checkpointing``, ``accum.micro_batch`` and the run's length) raises :class:`ConfigError` naming every such key, unless
    ``run.allow_config_change`` is true. Returns every change (all of them accepted by then);
    empty for a new run directory.
    """
    previous = storage.read_text(storage.join(run_dir, "config.yaml"))
    if previous is None or not checkpoint_dirs(run_dir):
        return {}
    changes = config_changes(yaml.safe_load(previous) or {}, config.to_dict())
    refused = {k: v for k, v in changes.items() if not resumable(k)}
    if refused and not config.run.allow_config_change:
        raise ConfigError(
            next(iter(refused)),
            f"the run in {run_dir} was started with another value, and its checkpoints hold the state of that "
            f"config. Changed: {_shown(refused)}. Use another run.name, or set run.allow_config_change=true to "
            "resume it with the new values anyway",
        )
    return changes


def record_changes(run_dir: str, changes: dict[str, tuple[Any, Any]], allowed: bool) -> None:
    """Print the accepted changes and append them to ``config_changes.jsonl``."""
    if not changes:
        return
    print(f"resuming {run_dir} with a changed config: {_shown(changes)}", flush=True)
    path = storage.join(run_dir, CHANGES)
    entry = {
        "time": time.time(),
        "changes": {k: {"old": old, "new": new} for k, (old, new) in changes.items()},
        "allowed_by_run.allow_config_change": allowed and any(not resumable(k) for k in changes),
    }
    storage.write_text(path, (storage.read_text(path) or "") + json.dumps(entry, default=str) + "\n")


def _pinned_state(task: Task, splits: dict[str, Any] | None) -> tuple[dict[str, bytes], dict[str, Any]]:
    from raytrain_loops.tasks import Task

    files = task.artefacts()
    digests = {n: hashlib.sha256(b).hexdigest() for n, b in sorted(files.items())}
    own = getattr(type(task), "data_digest", Task.data_digest) is not Task.data_digest
    data = task.data_digest() if own or splits is None else {"splits": split_identities(splits)}
    return files, {"files": digests, "data": data}


def split_identities(splits: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each split's identity, the default of :meth:`Task.data_digest`: a Parquet split's files
    (named from the split's root), their sizes and row counts; a map-style split's dataset type and
    length. No modification times: a bundled set regenerated identically is the same data."""
    from raytrain_loops.tasks import MapSplit, ParquetSplit

    out: dict[str, dict[str, Any]] = {}
    for name, split in sorted(splits.items()):
        if isinstance(split, ParquetSplit) and split.index is not None:
            out[name] = _parquet_identity(split.index)
        elif isinstance(split, MapSplit) and hasattr(split.dataset, "__len__"):
            kind = type(split.dataset)
            out[name] = {"type": f"{kind.__module__}.{kind.__qualname__}", "rows": len(split.dataset)}
    return out


def _parquet_identity(index: Any) -> dict[str, Any]:
    import pyarrow.fs as pafs

    fs, files = index.filesystem, list(index.files)
    base = os.path.dirname(files[0]) if len(files) == 1 else os.path.commonpath(files)
    listed = fs.get_file_info(pafs.FileSelector(base, recursive=True)) if len(files) > 1 else fs.get_file_info(files)
    sizes = {i.path: i.size for i in listed}
    rows = [int(sum(groups)) for groups in index.row_groups]
    named = sorted((f[len(base) :].lstrip("/"), int(sizes.get(f, -1)), n) for f, n in zip(files, rows, strict=True))
    return {
        "files": len(named),
        "rows": sum(rows),
        "bytes": sum(size for _, size, _ in named),
        "digest": hashlib.sha256(json.dumps(named).encode()).hexdigest(),
    }


def _data_changes(before: Any, now: Any) -> dict[str, tuple[Any, Any]]:
    if before is None or before == now:  # nothing pinned in the run directory yet: pinned now
        return {}
    if not (isinstance(before, dict) and isinstance(now, dict)):
        short = [v[:12] if isinstance(v, str) else v for v in (before, now)]
        return {"artefacts.data": (short[0], short[1])}
    old, new = before.get("splits", {}), now.get("splits", {})
    return {f"artefacts.data.{n}": (_summary(old.get(n)), _summary(new.get(n))) for n in sorted(set(old) | set(new)) if old.get(n) != new.get(n)}


def _summary(ident: dict[str, Any] | None) -> str:
    """A split's identity as the error shows it."""
    if ident is None:
        return _ABSENT
    if "type" in ident:
        return f"{ident['type']} of {ident['rows']:,} rows"
    files = f"{ident['files']} file{'s' if ident['files'] != 1 else ''}"
    return f"{files}, {ident['rows']:,} rows, {ident['bytes']:,} bytes (digest {ident['digest'][:12]})"


def artefact_changes(before: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``artefacts.<name>`` (``artefacts.data`` for the task's data digest, ``artefacts.data.<split>``
    for a split's identity) -> (old, new), short, for every pinned file or data that differs."""
    old, new = before.get("files", {}), now["files"]
    changes = {f"artefacts.{n}": (old.get(n, _ABSENT), new.get(n, _ABSENT)) for n in sorted(set(old) | set(new))}
    changed = {k: tuple(v[:12] if v else v for v in pair) for k, pair in changes.items() if pair[0] != pair[1]}
    return {**changed, **_data_changes(before.get("data"), now["data"])}


def pin_artefacts(
    run_dir: str, task: Task, allowed: bool, splits: dict[str, Any] | None = None
) -> dict[str, tuple[Any, Any]]:
    """Copy the task's :meth:`~raytrain_loops.tasks.Task.artefacts` into ``artefacts/`` of the
    run directory and record their digests and the data's identity in ``artefacts.json``, at the
    run's first start: the task's :meth:`~raytrain_loops.tasks.Task.data_digest`, or by default
    each of ``splits``' (:func:`split_identities`). Later starts compare: when the run holds
    checkpoints, a difference is refused (:class:`ConfigError` naming every changed file, or the
    split and what changed) unless ``allowed`` (``run.allow_config_change``), and then pinned anew.
    Returns the accepted changes."""
    files, now = _pinned_state(task, splits)
    if not files and now["data"] is None:
        return {}
    text = storage.read_text(storage.join(run_dir, ARTEFACTS_FILE))
    before = json.loads(text) if text else None
    if before == now or (before is None and not files and checkpoint_dirs(run_dir)):
        return {}  # unchanged, or a run that pinned nothing at its first start: nothing to compare, nothing written
    changes = artefact_changes(before, now) if before is not None and checkpoint_dirs(run_dir) else {}
    if changes and not allowed:
        raise ConfigError(
            "task",
            f"the run in {run_dir} was trained with other artefacts than the task's now (its tokenizer, model "
            f"configuration or prepared data, pinned in {ARTEFACTS}/ at its first start). Changed: {_shown(changes)}. "
            "Use another run.name, or set run.allow_config_change=true to resume it with the new ones anyway",
        )
    for name in set((before or {}).get("files", {})) - set(files):
        storage.delete(storage.join(run_dir, ARTEFACTS, *name.split("/")))
    for name, data in files.items():
        storage.write_bytes(storage.join(run_dir, ARTEFACTS, *name.split("/")), data)
    storage.write_text(storage.join(run_dir, ARTEFACTS_FILE), json.dumps(now, indent=2) + "\n")
    return changes


def read_pinned(run_dir: str, prefix: str) -> dict[str, bytes]:
    """The run's pinned artefacts under ``prefix`` (``tokenizer/``), by name without it, each
    checked against its digest in ``artefacts.json``."""
    text = storage.read_text(storage.join(run_dir, ARTEFACTS_FILE))
    if text is None:
        raise FileNotFoundError(f"{run_dir} has no {ARTEFACTS_FILE}: its task pinned no artefacts at its first start")
    out = {}
    for name, sha in json.loads(text)["files"].items():
        if not name.startswith(prefix):
            continue
        data = storage.read_bytes(storage.join(run_dir, ARTEFACTS, *name.split("/")))
        if data is None or hashlib.sha256(data).hexdigest() != sha:
            raise CheckpointError(f"{run_dir}: {ARTEFACTS}/{name} is missing or differs from its digest")
        out[name[len(prefix) :]] = data
    return out


def meta_model(task: Task) -> nn.Module | None:
    """The task's model built on the meta device (shapes only: no memory, no initialisation), or
    None for a model that cannot be built there (one built from data or files): the workers
    build it for real."""
    import torch

    try:
        with torch.device("meta"):
            return task.build_model()
    except Exception:
        return None


def model_fingerprint(task: Task) -> dict[str, Any] | None:
    """What the run's checkpoints hold weights for: the task's class (``module:qualname``) and
    its model's parameter and buffer names and shapes (:func:`meta_model`); None when the model
    cannot be built on the meta device (then no rerun is checked against it)."""
    model = meta_model(task)
    if model is None:
        return None
    cls = type(task)
    return {
        "task": f"{cls.__module__}:{cls.__qualname__}",
        "parameters": {n: list(p.shape) for n, p in model.named_parameters()},
        "buffers": {n: list(b.shape) for n, b in model.named_buffers()},
    }


def _first(changes: dict[str, tuple[Any, Any]], shown: int = 6) -> str:
    """:func:`_shown` of the first ``shown`` changes, and how many more there are."""
    rest = len(changes) - shown
    return _shown(dict(list(changes.items())[:shown])) + (f", and {rest} more" if rest > 0 else "")


def check_model(run_dir: str, config: Config, fingerprint: dict[str, Any] | None) -> dict[str, tuple[Any, Any]]:
    """Compare the task's model now (``fingerprint``, :func:`model_fingerprint`) with the one
    ``model.json`` recorded at the run's first start, before anything loads or trains: the run
    name hashes the config, not the task's code, so an edited model reruns under the same name.
    When the run holds checkpoints (a finished run's too), a difference is refused
    (:class:`ConfigError` naming the changes and both ways on) unless ``run.allow_config_change``.
    Returns the accepted changes, ``model.<key>`` -> (old, new)."""
    text = storage.read_text(storage.join(run_dir, MODEL_FILE))
    if fingerprint is None or text is None or not checkpoint_dirs(run_dir):
        return {}
    changes = {f"model.{k}": v for k, v in config_changes(json.loads(text), fingerprint).items()}
    if changes and not config.run.allow_config_change:
        raise ConfigError(
            "task",
            f"the run in {run_dir} was trained with another model than task {config.task.name!r} builds now, and "
            f"its checkpoints hold that model's weights ({MODEL_FILE} records it). Changed: {_first(changes)}. "
            "To train this model anew, give it a new name (run.name=...); to go on with this run anyway, "
            "set run.allow_config_change=true",
        )
    return changes


def pin_model(run_dir: str, fingerprint: dict[str, Any] | None) -> None:
    """Record the model the run trains (:func:`model_fingerprint`) in ``model.json``."""
    if fingerprint is not None:
        storage.write_text(storage.join(run_dir, MODEL_FILE), json.dumps(fingerprint, indent=1) + "\n")


@dataclass
class FinishedRun:
    """A run that already reached its last step: its summary and final checkpoint."""

    summary: dict[str, Any]
    checkpoint: str


def finished_run(run_dir: str, final_step: int | None) -> FinishedRun | None:
    """The run's summary when it finished: ``summary.json`` says done, and its newest checkpoint
    is intact and at ``final_step`` (None: at the summary's step, for a rerun that changed no key
    of the run's length: only its scale, whose steps per epoch differ). None when there is
    training left to do. The summary is the last start's: :func:`remove_summary` removes it when the run
    trains again, so a longer rerun interrupted before it ends leaves no summary to trust."""
    text = storage.read_text(storage.join(run_dir, SUMMARY))
    summary = json.loads(text) if text else None
    if not summary or not summary.get("metrics", {}).get("done"):
        return None
    if final_step is None:
        final_step = summary["metrics"].get("step")
    paths = checkpoint_dirs(run_dir)
    if not paths or step_of(storage.name(paths[-1])) != final_step:
        return None
    with tempfile.TemporaryDirectory(prefix="raytrain-verify-") as tmp:
        try:
            verify(storage.download_dir(paths[-1], tmp))
        except CheckpointError:
            return None  # the workers will redo the last steps from the checkpoint before
    return FinishedRun(summary, paths[-1])


def remove_summary(run_dir: str) -> None:
    """Remove the summary of an earlier start before the run trains again: until this start
    writes its own, the run is not finished (its ``config.yaml`` may now ask for more steps)."""
    storage.delete(storage.join(run_dir, SUMMARY))
