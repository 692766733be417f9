"""``fit(config)``; runs on the driver: check everything (:mod:`raytrain_loops.driver.preflight`),
hold the run directory, start (or join) Ray (:mod:`raytrain_loops.driver.ray_start`), run a
TorchTrainer, write the summary; an interruption names the checkpoint that resumes the run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from raytrain_loops import storage
from raytrain_loops.checkpoint import last_checkpoint
from raytrain_loops.config import Config, ConfigError, load_config
from raytrain_loops.driver.preflight import planned_steps, prepare, run_name, warn_emulated_bf16
from raytrain_loops.driver.ray_start import ensure_ray
from raytrain_loops.driver.run_checks import (
    FinishedRun,
    RunLock,
    check_config,
    check_model,
    finished_run,
    model_fingerprint,
    pin_artefacts,
    pin_model,
    record_changes,
    remove_summary,
)
from raytrain_loops.driver.tracking import Tracking, open_tracking, tracked
from raytrain_loops.rundir.layout import PRECISION_FILE, SUMMARY
from raytrain_loops.rundir.stops import StopBoard, fit_or_stop
from raytrain_loops.tasks import Task


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


@dataclass
class FitResult:
    """What a finished run left: its directory, final metrics and last checkpoint (a path);
    ``trained``: False for a rerun of a finished run (its summary's figures, nothing trained now)."""

    run_dir: str
    metrics: dict[str, Any]
    checkpoint: str | None
    wall_time: float
    trained: bool = True


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
    try:
        run_dir = storage.join(config.run.storage_path, name)
        storage.make_dirs(run_dir)
    except (OSError, ValueError) as err:
        where = f"{config.run.storage_path.rstrip('/')}/{name}"
        raise ConfigError("run.storage_path", f"cannot create the run directory {where}: {err}") from None
    print(f"run directory: {run_dir}", flush=True)
    with RunLock(run_dir):
        changes = check_config(run_dir, config)
        model = model_fingerprint(task)
        changes.update(check_model(run_dir, config, model))  # an edited task: refused before anything loads
        length_changed = any(k.startswith(("loop.", "accum.")) for k in changes) or not changes
        # The tokenizer, the data, ...: a changed data set is seen before a finished run is.
        changes.update(pin_artefacts(run_dir, task, config.run.allow_config_change, splits))
        done = finished_run(run_dir, planned_steps(config, splits, rows) if length_changed else None)
        if done is not None:
            return _finished_result(run_dir, done, changes)
        remove_summary(run_dir)
        pin_model(run_dir, model)
        write_config(run_dir, config)
        record_changes(run_dir, changes, config.run.allow_config_change)
        with _signals_seen() as seen:
            try:
                return _train(config, task, splits, rows, name, run_dir, tracking)
            except (KeyboardInterrupt, SystemExit, Exception) as err:
                stop = err
        interrupted = seen is None or bool(seen & {signal.SIGINT, signal.SIGTERM})
        # A Ctrl-C inside C++ code comes out as that code's error (torch.save, interrupted mid-write:
        # "RuntimeError: [enforce fail at inline_container.cc] ..."): after a SIGINT or SIGTERM, it
        # is the interruption. The torn write is no checkpoint: one is written under a hidden name
        # and renamed when complete.
        if not interrupted or (seen is None and isinstance(stop, Exception)):
            raise stop  # no signal's (or, off the main thread, an error): not an interruption
        signum = signal.SIGTERM if seen and signal.SIGTERM in seen else signal.SIGINT
        raise RunInterrupted(run_dir, last_checkpoint(run_dir), signum) from None


def _precision(run_dir: str) -> str | None:
    """The dtype the run trained in, as its workers recorded it."""
    text = storage.read_text(storage.join(run_dir, PRECISION_FILE))
    return json.loads(text).get("dtype") if text else None


def write_config(run_dir: str, config: Config) -> None:
    """``config.yaml``: the run's resolved config, a recipe ``raytrain-loops train`` accepts."""
    storage.write_text(storage.join(run_dir, "config.yaml"), yaml.safe_dump(config.to_dict(), sort_keys=False))


def write_summary(run_dir: str, metrics: dict[str, Any], checkpoint: str | None, wall: float) -> None:
    """What a run that ended leaves beside its logs: ``summary.json`` (its last metrics, its last
    checkpoint, the dtype it trained in) and, for a local run directory, ``curves.png``."""
    summary = {
        "run_dir": run_dir,
        "wall_time_s": round(wall, 2),
        "checkpoint": checkpoint,
        "precision": _precision(run_dir),
        "metrics": metrics,
    }
    storage.write_text(storage.join(run_dir, SUMMARY), json.dumps(summary, indent=2, default=float) + "\n")
    if not storage.is_uri(run_dir):
        from raytrain_loops.driver.plots import plot_run

        plot_run(run_dir)


def _finished_result(run_dir: str, done: FinishedRun, changes: dict[str, tuple[Any, Any]]) -> FitResult:
    """What a rerun of a finished run returns: its summary, unchanged, and nothing trained. A
    rerun at another scale (``--local``, then Ray workers) is told that the scale makes no new run."""
    metrics = done.summary.get("metrics", {})
    evals = {k: v for k, v in sorted(metrics.items()) if k.startswith("eval_") and isinstance(v, int | float)}
    shown = ", ".join(f"{k}={v:.4g}" for k, v in evals.items())
    scaled = ", ".join(f"{k}={old}" for k, (old, _) in changes.items() if k.startswith("scaling."))
    why = f" (it trained with {scaled}: a run is the same run at any scale)" if scaled else ""
    print(
        f"the run already finished at step {metrics.get('step')}{': ' + shown if shown else ''} (every metric: "
        f"{storage.join(run_dir, 'summary.json')}); nothing trained{why}. To train anew, give it another run.name; "
        "to train it further, raise loop.max_steps or loop.epochs",
        flush=True,
    )
    wall = float(done.summary.get("wall_time_s", 0.0))
    return FitResult(run_dir, metrics, done.summary.get("checkpoint") or done.checkpoint, wall, trained=False)


def _train(
    config: Config,
    task: Task,
    splits: dict[str, Any],
    rows: dict[str, int],
    name: str,
    run_dir: str,
    tracking: Tracking | None = None,
) -> FitResult:
    start = time.time()
    warned = warn_emulated_bf16(config)
    console = contextlib.nullcontext() if config.scaling.local else _ray_console(config, run_dir)
    with console as console, tracked(tracking, run_dir, name, config) as mlflow_run:
        if config.scaling.local:
            from raytrain_loops.runtime.local import train_local
            from raytrain_loops.runtime.wiring import WorkerPayload

            payload = WorkerPayload(config, task, splits, rows, run_dir, None, None, None, mlflow_run, warned)
            metrics, checkpoint = train_local(payload)
        else:
            metrics, checkpoint = _train_on_ray(config, task, splits, rows, name, run_dir, console, mlflow_run, warned)
        wall = time.time() - start
        write_summary(run_dir, metrics, checkpoint, wall)
    return FitResult(run_dir, metrics, checkpoint, wall)


def _ray_console(config: Config, run_dir: str):
    from raytrain_loops.console.capture import Console

    return Console(run_dir, config.logging.verbose)


def _train_on_ray(
    config: Config,
    task: Task,
    splits: dict[str, Any],
    rows: dict[str, int],
    name: str,
    run_dir: str,
    console: Any,
    mlflow_run: Any,
    warned: bool,
) -> tuple[dict[str, Any], str | None]:
    """Start (or join) Ray and run the TorchTrainer; the last reported metrics and checkpoint."""
    from raytrain_loops.controller.announcer import Announcer

    s = config.scaling  # a local Ray is sized for a preprocessing task beside the workers
    ensure_ray(config, s.num_workers * s.cpus_per_worker + config.data.preprocess.num_cpus)
    from raytrain_loops.driver.nodes import check_cluster
    from raytrain_loops.driver.trainer import build_trainer

    check_cluster(config, task, splits)  # every node reaches the data; CPUs for preprocessing

    sender = console.start()
    board = StopBoard.new(run_dir, config.scaling.num_workers)
    announcer = Announcer(sender, config.run.max_failures, config.run.max_preemptions)
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
    return dict(result.metrics or {}), result.checkpoint.path if result.checkpoint else None
