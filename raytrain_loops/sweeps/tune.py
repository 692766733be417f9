"""``tune(config, sweep)``: a Ray Tune search in which every trial is a multi-worker Ray Train run.

Each trial is a small driver function that builds a TorchTrainer for its config and relays the
Train run's reports to Tune: metrics (already averaged over all workers by the loop) and the
checkpoint, so PBT can hand a donor's checkpoint to an exploiting trial, which then starts a new
Train run from it.

One tree: each trial's Train run directory is Tune's directory of the trial
(``<sweep>/trial_00003``, beside Tune's ``params.json`` and ``progress.csv``), and a complete run
directory (``config.yaml``, the logs, checkpoints, ``summary.json``, ``curves.png``); a PBT
trial's continuation from a donor is a run directory of its own beside it
(``trial_00003-from-<hash>``). The console is a run's: the trials' lines, and Ray's own output
(Tune's included) in the sweep's ``ray.log``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from raytrain_loops import storage
from raytrain_loops.callbacks.mlflow_log import TrackedRun
from raytrain_loops.config import Config, load_config, to_dict
from raytrain_loops.config.sweep import SweepConfig, load_sweep, trial_config
from raytrain_loops.console.capture import Console
from raytrain_loops.driver.fit import write_config, write_summary
from raytrain_loops.driver.preflight import planned_steps, prepare
from raytrain_loops.driver.tracking import finish_sweep, open_tracking, tracked
from raytrain_loops.rundir.stops import StopBoard, fit_or_stop
from raytrain_loops.sweeps.resources import DRIVER_CPUS, concurrency, start_ray
from raytrain_loops.sweeps.results import (
    SweepFailed,
    SweepInterrupted,
    SweepResult,
    complete_stopped_runs,
    copy_error,
    failed_trials,
    unended,
    write_outputs,
)
from raytrain_loops.tasks import Task

CLEANER_LINE_S = 1.0  # an actor's last line reaches the driver within this, once the actor has ended


def _space(sweep: SweepConfig) -> dict[str, Any]:
    from ray import tune

    make = {
        "choice": lambda a: tune.choice(a),
        "grid": lambda a: tune.grid_search(a),
        "uniform": lambda a: tune.uniform(*a),
        "loguniform": lambda a: tune.loguniform(*a),
        "randint": lambda a: tune.randint(int(a[0]), int(a[1])),
    }
    return {key: make[kind](args) for key, spec in sweep.space.items() for kind, args in spec.items()}


def trial_base(base: Config, sweep: SweepConfig, sweep_dir: str) -> Config:
    """The recipe as every trial's Train run gets it, before the trial's own values are set: the
    sweep's ``trial`` scaling, no progress lines, runs in ``sweep_dir`` (each in its trial's
    directory), and the metric evaluated and reported (and, for PBT, checkpointed, every report
    sent: a donor hands over its checkpoint of the decision's step) at the scheduler's decision
    points."""
    s = sweep.scheduler
    every = {"asha": s.grace_period, "pbt": s.perturbation_interval}.get(s.name)
    run = replace(
        base.run,
        progress=False,
        name="",
        storage_path=sweep_dir,
        report_every_steps=every or base.run.report_every_steps,
        coalesce_reports=base.run.coalesce_reports and s.name != "pbt",
    )
    changes: dict[str, Any] = {"scaling": sweep.trial, "run": run}
    if every:
        changes["eval"] = replace(base.eval, every_steps=every)
    if s.name == "pbt":
        changes["checkpoint"] = replace(base.checkpoint, every_steps=s.perturbation_interval)
    return replace(base, **changes)


class ForwardReports:
    """Passes each report of a trial's Train run to the trial (its queue); a Ray Train callback as
    ``ForwardReportsCallback``, run in the Train controller."""

    def __init__(self, queue):
        self.queue = queue

    def after_report(self, run_context, metrics, checkpoint) -> None:
        self.queue.put((dict(metrics[0]), checkpoint.path if checkpoint else None))


def _trial(values: dict[str, Any], payload: dict[str, Any]) -> None:
    """Tune's trainable: one Ray Train run with this trial's values."""
    from ray import tune
    from ray.train.v2.api.callback import UserCallback

    class ForwardReportsCallback(ForwardReports, UserCallback):
        pass

    config = trial_config(payload["base"], values)
    trial = tune.get_context().get_trial_name()
    donor = tune.get_checkpoint()
    init = donor.path if donor is not None else None
    # After a PBT exploit the trial starts a new Train run from the donor's checkpoint (reusing
    # its own run name would make Ray Train resume the trial's old state instead).
    name = trial if init is None else f"{trial}-from-{hashlib.sha256(init.encode()).hexdigest()[:8]}"
    run_dir = storage.join(config.run.storage_path, name)
    tags = {"sweep": payload["sweep"], "trial": trial}
    # Tune ends a trial it stops (at an ASHA rung, or at max_t) with SIGTERM: a normal end.
    with tracked(payload["tracking"], run_dir, name, config, tags, stopped="FINISHED") as mlflow_run:
        _run_trial(config, payload, name, run_dir, init, mlflow_run, ForwardReportsCallback)


def _run_trial(
    config: Config,
    payload: dict[str, Any],
    name: str,
    run_dir: str,
    init: str | None,
    mlflow_run: TrackedRun | None,
    forward_reports: type,
) -> None:
    """Run the trial's TorchTrainer on a thread and pass its reports on to Tune; the run directory
    made complete (``config.yaml`` first, ``summary.json`` and ``curves.png`` when the run ends;
    a trial the scheduler stops ends with its actor, and the sweep writes them:
    :func:`~raytrain_loops.sweeps.results.complete_stopped_runs`)."""
    from ray.util.queue import Queue

    from raytrain_loops.driver.trainer import build_trainer

    start = time.time()
    storage.make_dirs(run_dir)
    write_config(run_dir, config)
    queue = Queue(maxsize=4, actor_options={"num_cpus": 0})
    board = StopBoard.new(run_dir, config.scaling.num_workers)
    trainer = build_trainer(
        config,
        payload["task"],
        payload["splits"],
        payload["rows"],
        name,
        run_dir,
        callbacks=[forward_reports(queue)],
        init_checkpoint=init,
        board=board,
        tracking=mlflow_run,
    )
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = fit_or_stop(trainer, board)
        except BaseException as err:  # re-raised in the trial's thread below
            outcome["error"] = err

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    _pass_on(queue, thread, name, payload["hand_over"])
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    write_summary(
        run_dir, dict(result.metrics or {}), result.checkpoint.path if result.checkpoint else None, time.time() - start
    )


def _pass_on(queue, thread: threading.Thread, name: str, hand_over: bool) -> None:
    """The Train run's reports, as its controller relays them, passed on to Tune until the run's
    ``thread`` ends."""
    from ray import tune
    from ray.util.queue import Empty

    while True:
        try:
            metrics, checkpoint = queue.get(timeout=0.5)
        except Empty:
            if not thread.is_alive() and queue.empty():
                return
            continue
        metrics["trial_run"] = name
        # Only PBT needs Tune to hold checkpoints (to hand them over); the Train run keeps its own.
        handed = tune.Checkpoint(checkpoint) if checkpoint and hand_over else None
        tune.report(metrics, checkpoint=handed)


def _trial_name(trial) -> str:
    """``trial_00003``, the trial's index in the sweep: the same names for the same sweep, so a
    rerun or a restore finds its trials' run directories."""
    numbered = re.fullmatch(r"[0-9a-f]+_(\d+)", trial.trial_id)  # random and grid: <sweep id>_<index>
    if numbered:
        return f"trial_{int(numbered.group(1)):05d}"
    # Searchers (Optuna) name trials by random ids; their tag starts with a count from 1.
    return f"trial_{int(trial.experiment_tag.split('_', 1)[0]) - 1:05d}"


def sweep_name(base: Config, sweep: SweepConfig, task: Task) -> str:
    """``sweep.name``, or the task's name and a hash of the recipe (its run section aside) and the
    sweep: the same command maps to the same sweep directory, so a rerun resumes it."""
    if sweep.name:
        return sweep.name
    recipe = {k: v for k, v in base.to_dict().items() if k != "run"}
    del recipe["logging"]["mlflow"]  # where the sweep is tracked is not what it searches
    blob = json.dumps({"base": recipe, "sweep": to_dict(sweep)}, sort_keys=True)
    return f"{type(task).__name__.removesuffix('Task').lower() or 'task'}-sweep-{hashlib.sha256(blob.encode()).hexdigest()[:8]}"


def _scheduler(sweep: SweepConfig, length: int):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    s = sweep.scheduler
    if s.name == "asha":
        return ASHAScheduler(
            time_attr="step", grace_period=s.grace_period, reduction_factor=s.reduction_factor, max_t=s.max_t or length
        )
    if s.name == "pbt":
        mutations = {}
        for key, spec in sweep.space.items():
            ((kind, args),) = spec.items()
            mutations[key] = list(args) if kind == "choice" else _space(SweepConfig(space={key: spec}))[key]
        return PopulationBasedTraining(
            time_attr="step",
            perturbation_interval=s.perturbation_interval,
            hyperparam_mutations=mutations,
            quantile_fraction=s.quantile_fraction,
            resample_probability=s.resample_probability,
            synch=s.synch,
        )
    return FIFOScheduler()


def _search(sweep: SweepConfig, concurrency: int):
    points = sweep.search.points or None
    if sweep.search.algorithm == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(seed=sweep.search.seed, points_to_evaluate=points)
    from ray.tune.search.basic_variant import BasicVariantGenerator

    # Tune applies max_concurrent_trials to a searcher it builds, not to one given to it.
    return BasicVariantGenerator(random_state=sweep.search.seed, max_concurrent=concurrency, points_to_evaluate=points)


class TrialProgress:
    """A Tune callback (on the driver): one line per trial result and per trial's end, saying
    whether it ran its whole length or the scheduler stopped it. Built into a ``tune.Callback``
    by :func:`trial_progress`; pickled with the sweep without its display: a resumed sweep's lines go
    to the display of the sweep running now (``shown_on``)."""

    shown_on = None  # the display of the sweep running in this process
    sweep_dir = None  # where a failed trial's error is copied (its trial's directory)

    def __init__(self, display, metric: str, length: int, sweep_dir: str | None = None):
        self.display, self.metric, self.length, self.sweep_dir = display, metric, length, sweep_dir

    def _line(self, text: str) -> None:
        display = self.display or TrialProgress.shown_on
        if display is None:
            print(text, flush=True)
        else:
            display.line(text)

    def _metric(self, result: dict[str, Any]) -> str:
        value = result.get(self.metric)
        return f"{self.metric} {value:.4g}" if isinstance(value, int | float) else f"{self.metric} ?"

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        self._line(f"{_trial_name(trial)} step {result.get('step')}: {self._metric(result)}")

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        last = trial.last_result or {}
        step = last.get("step")
        how = "finished" if step is None or step >= self.length else "stopped by the scheduler"
        self._line(f"{_trial_name(trial)} {how} at step {step}: {self._metric(last)}")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        name = _trial_name(trial)
        self._line(f"{name} failed; its error: {copy_error(trial.error_file, self.sweep_dir, name)}")

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "display": None}


def trial_progress(display, metric: str, length: int, sweep_dir: str | None = None):
    """:class:`TrialProgress` as a ``ray.tune.Callback`` (``TrialProgressCallback``)."""
    from ray import tune as rt

    class TrialProgressCallback(TrialProgress, rt.Callback):
        pass

    return TrialProgressCallback(display, metric, length, sweep_dir)


class _Decisions(logging.Handler):
    """PBT's exploit decisions (logged by Ray at INFO), one line each on the display."""

    def __init__(self, display):
        super().__init__(logging.INFO)
        self.display = display

    def emit(self, record: logging.LogRecord) -> None:
        text = " ".join(record.getMessage().split())
        if "[Exploit]" in text:
            self.display.line(text)


def _cleaners_done(timeout_s: float = 15.0) -> None:
    """Wait, at most ``timeout_s``, for the placement-group cleaners of this sweep's Train runs to
    end. Ray Train starts one beside each run's controller; when Tune ends a trial, the trial takes
    its controller with it, and the cleaner says so in a line of its own a second or two later:
    said while the console still takes Ray's output to ``ray.log``, not after the sweep's table.
    Nothing to wait for where Ray's State API does not answer."""
    import ray
    from ray.util.state import list_actors

    job = ray.get_runtime_context().get_job_id()
    alive = [("class_name", "=", "PlacementGroupCleaner"), ("state", "=", "ALIVE"), ("job_id", "=", job)]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if not list_actors(filters=alive, timeout=5, raise_on_missing_output=False):
                break
        except Exception:  # the State API unreachable (no dashboard): nothing to wait for
            return
        time.sleep(0.5)
    time.sleep(CLEANER_LINE_S)  # its last line, on its way from the actor's log file


def _tuner(
    trainable, sweep: SweepConfig, name: str, root: str, length: int, at_once: int, callbacks=None, verbose=False
):
    from ray import tune as rt
    from ray.tune.search.basic_variant import BasicVariantGenerator

    search = _search(sweep, at_once)
    return rt.Tuner(
        trainable,
        param_space=_space(sweep),
        tune_config=rt.TuneConfig(
            metric=sweep.metric,
            mode=sweep.mode,
            num_samples=sweep.num_samples,
            scheduler=_scheduler(sweep, length),
            search_alg=search,
            max_concurrent_trials=None if isinstance(search, BasicVariantGenerator) else at_once,
            # A stopped trial's actor must go, taking its Ray Train run (which it owns) with it;
            # a reused actor would keep that run's workers and their resources.
            reuse_actors=False,
            trial_name_creator=_trial_name,
            trial_dirname_creator=_trial_name,
        ),
        # PBT hands over a trial's latest checkpoint; keeping a few lets an exploit that was
        # decided on a slightly older one still find it.
        run_config=rt.RunConfig(
            name=name,
            storage_path=root,
            checkpoint_config=rt.CheckpointConfig(num_to_keep=4),
            callbacks=callbacks,
            verbose=None if verbose else 0,  # Tune's status tables; the trial lines replace them
        ),
    )


def tune(
    config: Config | dict | str | Path,
    sweep: SweepConfig | dict | str | Path,
    task: Task | None = None,
    overrides: list[str] | None = None,
) -> SweepResult:
    """Run the sweep over the recipe ``config``. The same sweep run again resumes where it stopped
    (its failed trials too). A sweep whose trials failed, or whose trials all ended without a
    finite metric (no best trial), raises :class:`SweepFailed` once its results are written."""
    if not isinstance(config, Config):
        config = load_config(config, overrides)
    elif overrides:
        config = load_config(config.to_dict(), overrides)
    sweep = sweep if isinstance(sweep, SweepConfig) else load_sweep(sweep, config)
    root = storage.join(sweep.storage_path)
    task, splits, rows = prepare(trial_base(config, sweep, root), task)  # the data, for the trials' workers
    sweep_dir = storage.join(root, sweep_name(config, sweep, task))
    base = trial_base(config, sweep, sweep_dir)
    print(f"sweep directory: {sweep_dir}", flush=True)
    tracking = open_tracking(config.logging.mlflow, default_experiment=storage.name(sweep_dir))

    # Trials share the cluster: a trial's workers may wait for those of a trial that just ended.
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "600")
    verbose = config.logging.verbose
    with Console(sweep_dir, verbose) as console:
        per_trial = start_ray(base, sweep, task, splits)
        console.divert_forwarded()
        from ray import tune as rt

        payload = {"base": base.to_dict(), "task": task, "splits": splits, "rows": rows}
        payload["hand_over"] = sweep.scheduler.name == "pbt"
        payload["tracking"], payload["sweep"] = tracking, storage.name(sweep_dir)
        trainable = rt.with_resources(rt.with_parameters(_trial, payload=payload), {"CPU": DRIVER_CPUS})
        length = planned_steps(base, splits, rows)
        decisions = _Decisions(console.display)
        pbt_logger = logging.getLogger("ray.tune.schedulers.pbt")
        pbt_logger.addHandler(decisions)
        TrialProgress.shown_on = console.display
        try:
            if rt.Tuner.can_restore(sweep_dir):
                print(f"resuming the sweep in {sweep_dir}", flush=True)
                tuner = rt.Tuner.restore(sweep_dir, trainable=trainable, resume_unfinished=True, resume_errored=True)
            else:
                lines = [trial_progress(console.display, sweep.metric, length, sweep_dir)]
                at_once = concurrency(sweep, per_trial)
                tuner = _tuner(trainable, sweep, storage.name(sweep_dir), root, length, at_once, lines, verbose)
            with console.prints_to_log():
                results = tuner.fit()
                _cleaners_done()
        finally:
            pbt_logger.removeHandler(decisions)
            TrialProgress.shown_on = None
    return _ended(results, sweep, base, config.run, sweep_dir, tracking)


def _ended(results, sweep: SweepConfig, base: Config, user_run, sweep_dir: str, tracking) -> SweepResult:
    """What a sweep's end leaves: its trials' MLflow runs ended; then, for a sweep that was not
    interrupted, its stopped trials' run directories completed and its outputs written; its failed
    trials, if any, or its want of a best trial (none ended with a finite metric), raised as
    :class:`SweepFailed` once everything is written."""
    interrupted = unended(results)
    failed = failed_trials(results, sweep_dir)
    if tracking is not None:
        finish_sweep(tracking, storage.name(sweep_dir), set(failed), interrupted)
    if interrupted:
        raise SweepInterrupted(sweep_dir, sorted(interrupted))
    complete_stopped_runs(results, sweep_dir)
    written = write_outputs(results, sweep, base, user_run, sweep_dir)
    if failed or written.best_values is None:
        raise SweepFailed(written, failed, len(results), sweep.metric)
    return written
