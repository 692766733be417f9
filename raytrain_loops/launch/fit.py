"""``fit(config)``: check everything, start (or join) Ray, run a TorchTrainer, write the summary."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from raytrain_loops.config import Config, ConfigError, load_config
from raytrain_loops.engine.length import batches_per_epoch, total_steps
from raytrain_loops.launch import storage
from raytrain_loops.launch.rundir import (
    PRECISION_FILE,
    Finished,
    RunLock,
    check_config,
    checkpoint_dirs,
    finished,
    record_changes,
)
from raytrain_loops.launch.stops import StopBoard, fit_or_stop
from raytrain_loops.launch.tracking import Tracking, open_tracking, tracked
from raytrain_loops.tasks import MapSplit, ParquetSplit, Task, build_task


class DataError(ValueError):
    """A data file, directory or column a task needs is missing."""


class RunInterrupted(KeyboardInterrupt):
    """The driver was interrupted (Ctrl-C, SIGTERM) while its run trained; Ray Train stopped the
    workers. Running the same command again resumes the run from ``checkpoint`` (None: from its
    first step). ``signum``: the signal."""

    def __init__(self, run_dir: str, checkpoint: str | None, signum: int):
        self.run_dir, self.checkpoint, self.signum = run_dir, checkpoint, signum
        where = f"its last checkpoint: {checkpoint}" if checkpoint else "it has no checkpoint yet"
        super().__init__(f"the run in {run_dir} was interrupted ({signal.Signals(signum).name}); {where}")


@contextmanager
def _signals_seen() -> Iterator[set[int] | None]:
    """The signals the process receives in the block, whichever Python handler runs for them:
    Ray Train puts its own SIGINT handler in place for the time of a run (it aborts the run, and
    the driver then ends with a ``SystemExit``), Ray's driver its own for SIGTERM. They are read
    from the wakeup file descriptor (:func:`signal.set_wakeup_fd`), which the C-level handler
    writes for every signal. None, and nothing changed, off the main thread or where a wakeup
    descriptor is already set (an asyncio loop's)."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    try:
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        previous = None
    if previous != -1:
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
        yield None
        return
    seen: set[int] = set()
    try:
        yield seen
    finally:
        signal.set_wakeup_fd(-1)
        with suppress(BlockingIOError):
            seen.update(os.read(read, 4096))
        os.close(read)
        os.close(write)


def last_checkpoint(run_dir: str) -> str | None:
    """The run's newest checkpoint whose workers all wrote their manifests (their files are
    verified when a run resumes from it); None when there is none."""
    for path in reversed(checkpoint_dirs(run_dir)):
        try:
            world = int(json.loads(storage.read_text(storage.join(path, "manifest.rank0.json")) or "{}")["world_size"])
        except (ValueError, KeyError, TypeError):
            continue
        if all(storage.exists(storage.join(path, f"manifest.rank{rank}.json")) for rank in range(1, world)):
            return path
    return None


@dataclass
class FitResult:
    """What a finished run left: its directory, final metrics and last checkpoint (a path)."""

    run_dir: str
    metrics: dict[str, Any]
    checkpoint: str | None
    wall_time: float


def run_name(config: Config, task: Task) -> str:
    """The run's name: ``run.name``, or the task's class name and a hash of everything that
    shapes the result, so the same command maps to the same run directory. The run's length is
    part of the hash: a longer run of the same recipe is a new directory (with ``run.name``, the
    same directory, continued)."""
    if config.run.name:
        return config.run.name
    data = config.to_dict()
    ignored = ("storage_path", "progress", "allow_config_change")
    data["run"] = {k: v for k, v in data["run"].items() if k not in ignored}
    # How the run is shown and where it is tracked are not what it is.
    data["logging"] = {k: v for k, v in data["logging"].items() if k not in ("verbose", "mlflow")}
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:8]
    base = type(task).__name__.removesuffix("Task").lower() or "task"
    return f"{base}-{digest}"


def check_parquet(split_name: str, split: ParquetSplit) -> int:
    """Check that the Parquet data exists and has the task's columns; return its row count."""
    import pyarrow.dataset as pads

    path = split.path if storage.is_uri(split.path) else os.path.abspath(os.path.expanduser(split.path))
    split.path = path  # workers run in another directory
    if not storage.is_uri(path) and not os.path.exists(path):
        raise DataError(f"split '{split_name}': no such Parquet file or directory: {path}")
    try:
        ds = pads.dataset(path, format="parquet")
    except Exception as err:
        raise DataError(f"split '{split_name}': cannot read Parquet at {path}: {err}") from None
    if not ds.files:
        raise DataError(f"split '{split_name}': no Parquet files under {path}")
    names = set(ds.schema.names)
    missing = [c for c in split.columns if c not in names]
    if missing:
        raise DataError(
            f"split '{split_name}': column '{missing[0]}' not found in {ds.files[0]} (columns there: {', '.join(sorted(names))})"
        )
    return ds.count_rows()


def check_blocks(config: Config, task: Task) -> None:
    """``compile`` and ``checkpointing`` act on the task's blocks: a task that names none is
    refused here, naming the key, rather than on every worker. The model is built on the meta
    device (no memory, no initialisation); a model that cannot be is left to the workers' check."""
    wanted = "compile.enabled" if config.compile.enabled else "checkpointing" if config.checkpointing != "none" else ""
    if not wanted:
        return
    import torch

    try:
        with torch.device("meta"):
            blocks = task.blocks(task.build_model())
    except Exception:  # a model built from data or files: the workers check it
        return
    if not blocks:
        raise ConfigError(
            wanted,
            f"acts on the task's blocks, and task {config.task.name!r} names none: override Task.blocks(model) "
            "to return the model's repeated parts (Transformer blocks)",
        )


def prepare(config: Config, task: Task | None) -> tuple[Task, dict[str, Any], dict[str, int]]:
    """Build the task and check its data on the driver, before any Ray work starts."""
    task = task or build_task(config.task.name, config.task.params)
    check_blocks(config, task)
    data_dir = Path(config.data.dir).expanduser().resolve()  # workers run in another directory
    task.prepare(data_dir)
    splits = task.splits(data_dir)
    if "train" not in splits:
        raise DataError(f"task {config.task.name!r} has no 'train' split (it has: {', '.join(splits) or 'none'})")
    rows = {}
    for name, split in splits.items():
        if isinstance(split, ParquetSplit):
            rows[name] = check_parquet(name, split)
        elif isinstance(split, MapSplit):
            rows[name] = len(split.dataset)
        else:
            raise DataError(f"split '{name}': expected ParquetSplit or MapSplit, got {type(split).__name__}")
        if rows[name] == 0:
            raise DataError(f"split '{name}' holds no rows")
        if name != "train" and getattr(split, "batch_sampler", None) is not None:
            raise DataError(f"task {config.task.name!r}, split '{name}': only the train split takes a batch_sampler")
    if getattr(splits["train"], "batch_sampler", None) is not None:
        check_batch_sampler(config, splits["train"], rows["train"])
    elif rows["train"] // config.scaling.num_workers < config.data.batch_size:
        raise ConfigError(
            "data.batch_size",
            f"{config.data.batch_size} is more than the {rows['train'] // config.scaling.num_workers} training rows per worker",
        )
    planned_steps(config, splits, rows)  # an epoch too short for one update fails here, not on the workers
    return task, splits, rows


def _rank0_sampler(config: Config, split: MapSplit) -> tuple[Any, int]:
    """Rank 0's batch sampler of the train split with all ``scaling.num_workers`` workers, and its
    ``len`` (the same on every rank, by the sampler's contract). Raises :class:`DataError` naming
    the task and split when the task's sampler fails or gives no batch."""
    where = f"task {config.task.name!r}, split 'train'"
    try:
        sampler = split.batch_sampler(config.data.batch_size, 0, config.scaling.num_workers, config.loop.seed)
        batches = len(sampler)
    except Exception as err:  # the task's own code: say whose sampler failed
        raise DataError(f"{where}: batch_sampler: {err}") from err
    if batches < 1:
        raise DataError(
            f"{where}: the batch sampler gives no batch per worker with data.batch_size={config.data.batch_size} "
            f"and {config.scaling.num_workers} workers"
        )
    return sampler, batches


def check_batch_sampler(config: Config, split: MapSplit, rows: int) -> None:
    """Build the train split's batch sampler as rank 0 does and read its first epoch, so a
    sampler that fails or names rows the dataset lacks stops the run before Ray starts."""
    sampler, _ = _rank0_sampler(config, split)
    sampler.set_epoch(0)
    outside = [i for batch in sampler for i in batch if not 0 <= i < rows]
    if outside:
        raise DataError(
            f"task {config.task.name!r}, split 'train': the batch sampler names row {outside[0]}, "
            f"but the dataset holds {rows} rows"
        )


def planned_steps(config: Config, splits: dict[str, Any], rows: dict[str, int]) -> int:
    """The run's length in optimizer steps with all ``scaling.num_workers`` workers, as the loop
    will count it on every worker."""
    train = splits["train"]
    if getattr(train, "batch_sampler", None) is not None:
        per_worker = _rank0_sampler(config, train)[1]
    else:
        per_worker = batches_per_epoch(
            rows["train"], config.scaling.num_workers, config.data.batch_size, padded=isinstance(train, MapSplit)
        )
    return total_steps(config.loop, config.accum, per_worker)


def ensure_ray(config: Config, num_cpus: float = 0) -> None:
    """Join the cluster in ``RAY_ADDRESS`` (as under ``ray job submit``), or start a local one
    with CPU left over for Ray Data beside the training workers (``num_cpus``: at least this
    many logical CPUs)."""
    import ray
    import ray.data

    # Ray Data's per-dataset progress bars would interleave with the training progress lines.
    ray.data.DataContext.get_current().enable_progress_bars = False
    # One line per print on the driver (Ray Train otherwise also logs every print).
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
        return
    s = config.scaling
    needed = max(num_cpus, s.num_workers * s.cpus_per_worker + 1)  # + 1 for Ray Data's read tasks
    start_local_ray(max(os.cpu_count() or 1, math.ceil(needed)))


def start_local_ray(num_cpus: int, **kwargs: Any) -> None:
    """A new local Ray instance whose dashboard (on 127.0.0.1) every process of it can find, with
    its workers at the priority of its own services (``RAY_worker_niceness``, 0 unless set) and
    Ray Train's controller polling its workers every 0.5 s (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``).

    Ray Train cleans up after a controller that died (a stopped Tune trial, a killed driver)
    through the State API, which it finds through the dashboard's address. Without
    ``RAY_API_SERVER_ADDRESS`` it would look for the cluster ``ray start`` last recorded on this
    machine, which is not this instance (or no longer exists), and the dead controller's
    placement groups would hold their CPUs forever.
    """
    import socket

    import ray

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Set before ray.init: the raylet and every worker inherit the driver's environment.
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    # Ray starts its workers at nice 15, below its own services. On a machine that this run has
    # to itself, the training workers are the work: at nice 15 every wake-up of a Ray service
    # preempts them (measured: ~190 preemptions/s of the training thread, steps ~5% slower).
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Ray Train's controller takes one report per poll of its workers, every 2 s by default; a run
    # that reports more often than that (every epoch of a small recipe) ends waiting for the
    # backlog. Polled every 0.5 s, the default recipe's last step is followed by its summary in
    # 1-2 s, not 22 s (the whole command: 70.2 s instead of 92.7 s, medians of 3 runs).
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    ray.init(
        address="local",  # a new instance, even when `ray start` left one running on this machine
        num_cpus=num_cpus,
        dashboard_host="127.0.0.1",
        dashboard_port=port,
        log_to_driver=True,
        **kwargs,
    )


def fit(config: Config | dict | str | Path, task: Task | None = None, overrides: list[str] | None = None) -> FitResult:
    """Train ``config`` (a Config, a dict, or a YAML path with ``overrides``) on Ray Train.

    ``task`` replaces ``config.task`` with your own :class:`~raytrain_loops.tasks.Task` object.
    Raises ConfigError or DataError before Ray starts when the config or data is wrong, and
    :class:`RunInterrupted` when a Ctrl-C or a SIGTERM stops the run (the same call resumes it).
    """
    if not isinstance(config, Config):
        config = load_config(config, overrides)
    elif overrides:
        config = load_config(config.to_dict(), overrides)
    tracking = open_tracking(config.logging.mlflow)  # an unusable tracking URI fails before any work
    task, splits, rows = prepare(config, task)
    name = run_name(config, task)
    run_dir = storage.join(config.run.storage_path, name)
    try:
        storage.make_dirs(run_dir)
    except (OSError, ValueError) as err:
        raise ConfigError("run.storage_path", f"cannot create the run directory {run_dir}: {err}") from None
    print(f"run directory: {run_dir}", flush=True)
    with RunLock(run_dir):
        changes = check_config(run_dir, config)
        done = finished(run_dir, planned_steps(config, splits, rows))
        if done is not None:
            return _finished_result(run_dir, done)
        storage.write_text(storage.join(run_dir, "config.yaml"), yaml.safe_dump(config.to_dict(), sort_keys=False))
        record_changes(run_dir, changes, config.run.allow_config_change)
        with _signals_seen() as seen:
            try:
                return _train(config, task, splits, rows, name, run_dir, tracking)
            except (KeyboardInterrupt, SystemExit) as err:
                stop = err
        if seen is not None and not seen & {signal.SIGINT, signal.SIGTERM}:
            raise stop  # no signal's: not an interruption
        signum = signal.SIGTERM if seen and signal.SIGTERM in seen else signal.SIGINT
        raise RunInterrupted(run_dir, last_checkpoint(run_dir), signum) from None


def warn_emulated_bf16(config: Config) -> bool:
    """Before a local Ray starts (its workers run on this CPU), warn once of an explicit
    ``precision.dtype=bf16`` that this CPU emulates; whether it warned. Joined to a cluster, the
    workers' rank 0 warns instead: this machine's CPU is not theirs."""
    if config.precision.dtype != "bf16" or config.scaling.use_gpu or os.environ.get("RAY_ADDRESS"):
        return False
    import sys

    import torch

    from raytrain_loops.engine import precision

    hw = precision.hardware(torch.device("cpu"))
    if hw.native_bf16:
        return False
    print(precision.emulated_warning(hw), file=sys.stderr, flush=True)
    return True


def _precision(run_dir: str) -> str | None:
    """The dtype the run trained in, as its workers recorded it."""
    text = storage.read_text(storage.join(run_dir, PRECISION_FILE))
    return json.loads(text).get("dtype") if text else None


def _finished_result(run_dir: str, done: Finished) -> FitResult:
    """What a rerun of a finished run returns: its summary, unchanged, and nothing trained."""
    metrics = done.summary.get("metrics", {})
    shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()) if isinstance(v, int | float))
    print(f"the run already finished at step {metrics.get('step')}: {shown}", flush=True)
    wall = float(done.summary.get("wall_time_s", 0.0))
    return FitResult(run_dir, metrics, done.summary.get("checkpoint") or done.checkpoint, wall)


def _train(
    config: Config,
    task: Task,
    splits: dict[str, Any],
    rows: dict[str, int],
    name: str,
    run_dir: str,
    tracking: Tracking | None = None,
) -> FitResult:
    from raytrain_loops.launch.console import Announcer, Console

    start = time.time()
    warned = warn_emulated_bf16(config)
    with Console(run_dir, config.logging.verbose) as console, tracked(tracking, run_dir, name, config) as mlflow_run:
        ensure_ray(config)
        from raytrain_loops.launch.trainer import build_trainer

        sender = console.start()
        board = StopBoard.new(run_dir, config.scaling.num_workers)
        announcer = Announcer(sender, config.run.max_failures)
        trainer = build_trainer(
            config,
            task,
            splits,
            rows,
            name,
            run_dir,
            callbacks=[announcer],
            board=board,
            console=sender,
            tracking=mlflow_run,
            precision_warned=warned,
        )
        result = fit_or_stop(trainer, board)
        wall = time.time() - start
        metrics = dict(result.metrics or {})
        checkpoint = result.checkpoint.path if result.checkpoint else None
        summary = {
            "run_dir": run_dir,
            "wall_time_s": round(wall, 2),
            "checkpoint": checkpoint,
            "precision": _precision(run_dir),
            "metrics": metrics,
        }
        storage.write_text(storage.join(run_dir, "summary.json"), json.dumps(summary, indent=2, default=float) + "\n")
        if not storage.is_uri(run_dir):
            from raytrain_loops.launch.plots import plot_run

            plot_run(run_dir)
    return FitResult(run_dir, metrics, checkpoint, wall)
