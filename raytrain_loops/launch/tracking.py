"""MLflow tracking: one MLflow run per run directory.

The driver checks the tracking URI and creates (or, on a rerun, reopens) the MLflow run before Ray
starts, logs the resolved config as its params and keeps the run's id in ``<run_dir>/mlflow_run_id``;
rank 0 of every attempt attaches to that run (:class:`MlflowLog`) and logs the interval metrics and
evaluations, already reduced over all workers, with their step; the driver logs the run's files as
artifacts and ends the run. A restarted group, a resumed run or a rerun continues the same MLflow
run, and steps that a restarted group replays are not logged twice.

A tracking store that stops answering never stalls training: every request is bounded (MLflow's
own defaults retry a request for minutes), the driver gives up on the first failure, and rank 0
logs from a bounded queue that nothing waits on for long.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from raytrain_loops.config import Config, ConfigError
from raytrain_loops.config.tracking import MlflowConfig
from raytrain_loops.engine.loop import Callback
from raytrain_loops.launch import storage
from raytrain_loops.launch.rundir import flatten

KEY = "logging.mlflow.tracking_uri"
RUN_ID_FILE = "mlflow_run_id"
ARTIFACTS = ("summary.json", "config.yaml", "curves.png", "config_changes.jsonl")
# MLflow's limits: a param value's length, and entries per log_batch request.
MAX_PARAM_VALUE = 6000
PARAMS_PER_CALL = 100
METRICS_PER_CALL = 1000
# MLflow's HTTP settings (its defaults: 120 s a request, 7 retries with backoff; minutes in all).
# One retry each, so that a blip neither fails a run's start nor loses metrics or its end; the
# driver's requests wait longer for an answer than rank 0's. A value the user set in the
# environment wins.
DRIVER_HTTP = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}
WORKER_HTTP = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}
MAX_PENDING = 1000  # rank 0's batches waiting to be sent; more are dropped and counted
SETTLE_S = 5.0  # how long an evaluation or a checkpoint waits for the metrics before it, while the store keeps up
CLOSE_S = 30.0  # how long an attempt's end waits for the metrics still queued, while the store answers


@dataclass(frozen=True)
class Tracking:
    """Where runs are tracked: the tracking URI as the driver resolved it (absolute local paths,
    so that workers running in other directories reach the same store) and the experiment's id."""

    tracking_uri: str
    experiment_id: str


@dataclass(frozen=True)
class TrackedRun:
    """The MLflow run that a run directory's attempts log to."""

    tracking_uri: str
    run_id: str


def resolve_uri(uri: str) -> str:
    """``uri`` with local paths made absolute: a directory, ``file:`` and ``sqlite:///``."""
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///") :]
        if path == ":memory:" or not path:
            raise ConfigError(KEY, f"{uri!r} is private to one process; name a database file (sqlite:///path.db)")
        return "sqlite:///" + os.path.abspath(os.path.expanduser(path))
    if uri.startswith("file:"):
        path = uri[len("file:") :]
        path = path[2:] if path.startswith("//") else path
        return "file://" + os.path.abspath(os.path.expanduser(path))
    if "://" not in uri:
        return os.path.abspath(os.path.expanduser(uri))
    return uri


def client(uri: str):
    """An ``MlflowClient`` for ``uri``; a ConfigError naming the key when MLflow is not installed."""
    try:
        from mlflow import MlflowClient
    except ImportError:
        raise ConfigError(KEY, "needs MLflow: pip install 'raytrain-loops[mlflow]'") from None
    if uri.startswith("file:") or "://" not in uri:
        # A directory is what the user asked for: MLflow keeps this store in maintenance mode
        # and refuses it unless told otherwise.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=uri)


def _set_defaults(settings: dict[str, str]) -> list[str]:
    """Set the environment variables of ``settings`` that are unset; the names set."""
    added = [k for k in settings if k not in os.environ]
    for k in added:
        os.environ[k] = settings[k]
    return added


def _unset(names: list[str]) -> None:
    for k in names:
        os.environ.pop(k, None)


@contextmanager
def _http_limits(settings: dict[str, str] = DRIVER_HTTP) -> Iterator[None]:
    """MLflow's requests in the block bounded by ``settings`` (the user's own values win)."""
    added = _set_defaults(settings)
    try:
        yield
    finally:
        _unset(added)


def _reason(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def open_tracking(cfg: MlflowConfig, default_experiment: str = "raytrain-loops") -> Tracking | None:
    """Check the tracking URI on the driver, before Ray starts, and find (or create) the
    experiment. None when tracking is off; a ConfigError naming the key when the URI is unusable."""
    if not cfg.tracking_uri:
        return None
    uri = resolve_uri(cfg.tracking_uri)
    name = cfg.experiment or default_experiment
    with _http_limits():
        try:
            mlflow_client = client(uri)
            experiment = mlflow_client.get_experiment_by_name(name)
            if experiment is None:
                experiment_id = _create_experiment(mlflow_client, name)
            else:
                experiment_id = experiment.experiment_id
        except ConfigError:
            raise
        except Exception as err:
            raise ConfigError(
                KEY, f"cannot use {cfg.tracking_uri!r} as an MLflow tracking store: {_reason(err)}"
            ) from None
    if experiment is not None and experiment.lifecycle_stage == "deleted":
        raise ConfigError(
            "logging.mlflow.experiment", f"experiment {name!r} is deleted in {uri}: restore it, or name another"
        )
    return Tracking(uri, experiment_id)


def _artifact_location(uri: str) -> str | None:
    """Where a new experiment of a sqlite store keeps its artifacts: ``mlartifacts/`` beside the
    database. MLflow's default, ``./mlruns``, is the current directory of whichever process
    happens to create the experiment."""
    if not uri.startswith("sqlite:///"):
        return None
    return "file://" + os.path.join(os.path.dirname(uri[len("sqlite:///") :]), "mlartifacts")


def _create_experiment(mlflow_client, name: str) -> str:
    from mlflow.exceptions import MlflowException

    try:
        return mlflow_client.create_experiment(name, artifact_location=_artifact_location(mlflow_client.tracking_uri))
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":  # another driver created it meanwhile
            raise
        return mlflow_client.get_experiment_by_name(name).experiment_id


def _recorded_run(mlflow_client, run_dir: str) -> str | None:
    """The id in ``mlflow_run_id`` when that run is still in the store (and not deleted)."""
    from mlflow.exceptions import MlflowException

    text = storage.read_text(storage.join(run_dir, RUN_ID_FILE))
    if not text or not text.strip():
        return None
    run_id = text.strip()
    try:
        run = mlflow_client.get_run(run_id)
    except MlflowException as err:
        if err.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise
        print(f"the MLflow run {run_id} of {run_dir} is not in this tracking store: starting a new one", flush=True)
        return None
    if run.info.lifecycle_stage == "deleted":
        print(f"the MLflow run {run_id} of {run_dir} was deleted: starting a new one", flush=True)
        return None
    return run_id


def start_run(
    tracking: Tracking, run_dir: str, name: str, config: Config, tags: dict[str, str] | None = None
) -> TrackedRun:
    """Reopen the run directory's MLflow run, or create it and record its id there; log the
    config's keys the run does not have yet as params (MLflow never changes a param: a rerun's
    accepted changes are in the ``config_changes.jsonl`` and ``config.yaml`` artifacts). Each
    request is bounded (``DRIVER_HTTP``); a failure ends the run before Ray starts."""
    with _http_limits():
        return _start_run(tracking, run_dir, name, config, tags)


def _start_run(tracking: Tracking, run_dir: str, name: str, config: Config, tags: dict[str, str] | None) -> TrackedRun:
    mlflow_client = client(tracking.tracking_uri)
    run_id = _recorded_run(mlflow_client, run_dir)
    if run_id is None:
        run = mlflow_client.create_run(tracking.experiment_id, run_name=name, tags={"run_dir": run_dir, **(tags or {})})
        run_id = run.info.run_id
        storage.write_text(storage.join(run_dir, RUN_ID_FILE), run_id + "\n")
        present: dict[str, str] = {}
    else:
        mlflow_client.update_run(run_id, status="RUNNING")
        present = mlflow_client.get_run(run_id).data.params
    print(f"MLflow run {run_id} in {tracking.tracking_uri}", flush=True)
    log_params(mlflow_client, run_id, flatten(config.to_dict()), present)
    return TrackedRun(tracking.tracking_uri, run_id)


def log_params(mlflow_client, run_id: str, params: dict[str, Any], present: dict[str, str]) -> None:
    """Log ``params`` (dotted keys) missing from ``present``, at most ``PARAMS_PER_CALL`` a request."""
    from mlflow.entities import Param

    todo = [Param(k, str(v)[:MAX_PARAM_VALUE]) for k, v in sorted(params.items()) if k not in present]
    for i in range(0, len(todo), PARAMS_PER_CALL):
        mlflow_client.log_batch(run_id, params=todo[i : i + PARAMS_PER_CALL])


def end_run(run: TrackedRun, run_dir: str, status: str) -> None:
    """Log the run directory's files as artifacts and end the MLflow run with ``status``. A
    failure here is a warning: it must not hide the run's own outcome. Each request is bounded
    (``DRIVER_HTTP``) and the first failure ends the attempt, so a store that stopped answering
    costs one request's timeout."""
    try:
        with _http_limits():
            _end_run(run, run_dir, status)
    except Exception as err:
        print(f"warning: could not end the MLflow run {run.run_id}: {_reason(err)}", flush=True)


def _end_run(run: TrackedRun, run_dir: str, status: str) -> None:
    mlflow_client = client(run.tracking_uri)
    with tempfile.TemporaryDirectory(prefix="raytrain-mlflow-") as tmp:
        for name in ARTIFACTS:
            path = _local_copy(storage.join(run_dir, name), tmp)
            if path is not None:
                mlflow_client.log_artifact(run.run_id, path)
    mlflow_client.set_terminated(run.run_id, status)


def _local_copy(path: str, tmp: str) -> str | None:
    if not storage.is_uri(path):
        return path if os.path.isfile(path) else None
    data = storage.read_bytes(path)
    if data is None:
        return None
    local = os.path.join(tmp, storage.name(path))
    with open(local, "wb") as f:
        f.write(data)
    return local


@contextmanager
def tracked(
    tracking: Tracking | None,
    run_dir: str,
    name: str,
    config: Config,
    tags: dict[str, str] | None = None,
    stopped: str = "KILLED",
) -> Iterator[TrackedRun | None]:
    """The MLflow run of the block: started before it, FINISHED after it, FAILED when it raises,
    ``stopped`` when the process is interrupted or terminated (SIGTERM is a SystemExit under
    Ray). Nothing when tracking is off."""
    if tracking is None:
        yield None
        return
    run = start_run(tracking, run_dir, name, config, tags)
    status = "FAILED"
    try:
        yield run
        status = "FINISHED"
    except (KeyboardInterrupt, SystemExit):
        status = stopped
        raise
    finally:
        end_run(run, run_dir, status)


def finish_sweep(tracking: Tracking, sweep: str, failed: set[str]) -> None:
    """End the runs of a sweep's trials that a scheduler stopped before they could end their own
    (their actors are killed): FAILED for the trials in ``failed``, FINISHED for the others."""
    with _http_limits():
        mlflow_client = client(tracking.tracking_uri)
        runs = mlflow_client.search_runs(
            [tracking.experiment_id], filter_string=f"tags.sweep = '{sweep}' and attributes.status = 'RUNNING'"
        )
        for run in runs:
            trial = run.data.tags.get("trial", "")
            mlflow_client.set_terminated(run.info.run_id, "FAILED" if trial in failed else "FINISHED")


class MlflowLog(Callback):
    """Rank 0's metrics in the MLflow run: each logging interval's metrics (averaged over all
    workers) and each evaluation, at their step.

    The requests go out from a background thread, fed by a queue of at most ``max_pending``
    batches, so the training thread never waits on the tracking store: a batch that finds the
    queue full is dropped and counted, and batches that waited behind a slow request go out
    together. An evaluation and a checkpoint wait up to ``SETTLE_S`` for the metrics before them
    (the report that carries them may end the process: Tune stops a trial on it), but only while
    the store keeps up: not after a failed request, nor after such a wait ran out, until the
    queue drains again. The attempt's end waits up to ``CLOSE_S``, and not once a request failed.
    Requests are bounded by ``WORKER_HTTP``. What was not logged is reported once, at the end.

    Before the first batch, the thread reads which steps the run already has: a restarted group
    replays the steps since its checkpoint, and those the failed attempt had logged are left out,
    so every metric has one value per step.
    """

    def __init__(self, run: TrackedRun | None, rank: int, max_pending: int = MAX_PENDING):
        self.enabled = run is not None and rank == 0
        if not self.enabled:
            return
        self.run = run
        self.logged: dict[str, int] = {}
        self.client = None
        self.max_pending = max_pending
        self.failures = 0  # requests that failed
        self.dropped = 0  # metric values dropped with the queue full
        self.unsent = 0  # metric values of failed requests, and those still waiting at the end
        # All of the below is shared with the thread, under this condition.
        self._changed = threading.Condition()
        self._pending: deque[tuple[dict[str, float], int, int]] = deque()
        self._in_flight = 0  # metric values in the request under way
        self._submitted = self._done = 0  # batches queued, and batches the thread is through with
        self._failing = False  # the last request failed
        self._behind = False  # a wait at an evaluation or a checkpoint ran out; until the queue drains
        self._closing = self._abandoned = False
        self._env = _set_defaults(WORKER_HTTP)
        self._thread = threading.Thread(target=self._work, name="mlflow-log", daemon=True)
        self._thread.start()

    def on_interval(self, metrics: dict[str, float], step: int) -> None:
        if self.enabled:
            self._submit({k: v for k, v in metrics.items() if k != "step"}, step)

    def on_eval(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        if self.enabled:
            self._submit(metrics, step)
            self._settle()

    def before_checkpoint(self) -> None:
        if self.enabled:
            self._settle()

    def _submit(self, metrics: dict[str, float], step: int) -> None:
        with self._changed:
            if len(self._pending) < self.max_pending:
                self._pending.append((dict(metrics), step, int(time.time() * 1000)))
                self._submitted += 1
                self._changed.notify_all()
                return
            first = not self.dropped
            self.dropped += len(metrics)
        if first:
            print(
                f"warning: MLflow is {self.max_pending} batches behind: metrics are dropped from step {step} "
                "until it catches up (counted; training goes on)",
                flush=True,
            )

    def _settle(self) -> None:
        if not (self._failing or self._behind) and not self._wait(SETTLE_S) and not self._failing:
            self._behind = True

    def _wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the batches queued so far to be through, and not
        once a request fails; whether they are."""
        deadline = time.monotonic() + timeout
        with self._changed:
            target = self._submitted
            while self._done < target and not self._failing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return self._done >= target

    def _work(self) -> None:
        self._attach()
        while True:
            with self._changed:
                while not (self._pending or self._closing or self._abandoned):
                    self._changed.wait()
                if self._abandoned or not self._pending:
                    return
                # The batches that waited behind a slow request go out with it, in one request.
                items = [self._pending.popleft()]
                while self._pending and _values(items) + len(self._pending[0][0]) <= METRICS_PER_CALL:
                    items.append(self._pending.popleft())
                self._in_flight = _values(items)
            self._log(items)
            with self._changed:
                self._done += len(items)
                self._in_flight = 0
                if not self._pending:
                    self._behind = False
                self._changed.notify_all()

    def _attach(self) -> None:
        try:
            self.client = client(self.run.tracking_uri)
            keys = self.client.get_run(self.run.run_id).data.metrics
            for key in keys:
                history = self.client.get_metric_history(self.run.run_id, key)
                self.logged[key] = max((m.step for m in history), default=-1)
        except Exception as err:
            self._failed(err, 0)

    def _log(self, items: list[tuple[dict[str, float], int, int]]) -> None:
        from mlflow.entities import Metric

        batch = [
            Metric(k, float(v), timestamp, step)
            for metrics, step, timestamp in items
            for k, v in metrics.items()
            if step > self.logged.get(k, -1)
        ]
        for i in range(0, len(batch), METRICS_PER_CALL):
            try:
                self.client.log_batch(self.run.run_id, metrics=batch[i : i + METRICS_PER_CALL])
            except Exception as err:
                self._failed(err, len(batch) - i)
                return
            with self._changed:
                self._failing = False

    def _failed(self, err: Exception, values: int) -> None:
        with self._changed:
            self.failures += 1
            if not self._abandoned:  # else counted by close
                self.unsent += values
            self._failing = True
            self._changed.notify_all()
        if self.failures == 1:  # the rest are counted, not printed: the store may be down for long
            print(f"warning: MLflow logging failed (training goes on): {_reason(err)}", flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        drained = self._wait(CLOSE_S)
        with self._changed:
            if not drained:  # the request under way ends within its timeout; none follows it
                self._abandoned = True
                self.unsent += self._in_flight + _values(self._pending)
                self._pending.clear()
                self._changed.notify_all()
        if drained:
            self._thread.join(timeout=1.0)
        _unset(self._env)
        parts = [f"{self.failures} requests failed"] if self.failures else []
        if self.dropped:
            parts.append(f"{self.dropped} metric values dropped with {self.max_pending} batches waiting")
        if self.unsent:
            parts.append(f"{self.unsent} metric values not sent (failed, or waiting at the end)")
        if parts:
            print(f"warning: MLflow logging of this attempt: {', '.join(parts)}", flush=True)


def _values(items) -> int:
    """The metric values in queued batches."""
    return sum(len(metrics) for metrics, _, _ in items)
