"""MLflow tracking on the driver: one MLflow run per run directory.

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
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from raytrain_loops import storage
from raytrain_loops.callbacks.mlflow_log import KEY, TrackedRun, client, failure_reason, http_limits
from raytrain_loops.config import Config, ConfigError
from raytrain_loops.config.tracking import MlflowConfig
from raytrain_loops.driver.run_checks import flatten

RUN_ID_FILE = "mlflow_run_id"
ARTIFACTS = ("summary.json", "config.yaml", "curves.png", "config_changes.jsonl")
# MLflow's limits: a param value's length, and entries per log_batch request.
MAX_PARAM_VALUE = 6000
PARAMS_PER_CALL = 100
# MLflow's HTTP settings (its defaults: 120 s a request, 7 retries with backoff; minutes in all).
# One retry each, so that a blip neither fails a run's start nor loses metrics or its end; the
# driver's requests wait longer for an answer than rank 0's. A value the user set in the
# environment wins.
DRIVER_HTTP = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}


@dataclass(frozen=True)
class Tracking:
    """Where runs are tracked: the tracking URI as the driver resolved it (absolute local paths,
    so that workers running in other directories reach the same store) and the experiment's id."""

    tracking_uri: str
    experiment_id: str


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


def open_tracking(cfg: MlflowConfig, default_experiment: str = "raytrain-loops") -> Tracking | None:
    """Check the tracking URI on the driver, before Ray starts, and find (or create) the
    experiment. None when tracking is off; a ConfigError naming the key when the URI is unusable."""
    if not cfg.tracking_uri:
        return None
    uri = resolve_uri(cfg.tracking_uri)
    name = cfg.experiment or default_experiment
    with http_limits(DRIVER_HTTP):
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
                KEY, f"cannot use {cfg.tracking_uri!r} as an MLflow tracking store: {failure_reason(err)}"
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
    with http_limits(DRIVER_HTTP):
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
        with http_limits(DRIVER_HTTP):
            _end_run(run, run_dir, status)
    except Exception as err:
        print(f"warning: could not end the MLflow run {run.run_id}: {failure_reason(err)}", flush=True)


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


def finish_sweep(tracking: Tracking, sweep: str, failed: set[str], interrupted: Collection[str] = ()) -> None:
    """End the runs of a sweep's trials that a scheduler stopped before they could end their own
    (their actors are killed): FAILED for the trials in ``failed``, FINISHED for the others. The
    latest run of each trial in ``interrupted`` (running when the sweep was stopped, resumed with
    it) ends KILLED, as an interrupted run does, whatever its trial's actor said: Tune ends such a
    trial as it ends one that a scheduler stops."""
    with http_limits(DRIVER_HTTP):
        mlflow_client = client(tracking.tracking_uri)
        runs = mlflow_client.search_runs(
            [tracking.experiment_id], filter_string=f"tags.sweep = '{sweep}' and attributes.status = 'RUNNING'"
        )
        killed = {
            run.info.run_id
            for trial in sorted(interrupted)
            for run in mlflow_client.search_runs(
                [tracking.experiment_id],
                filter_string=f"tags.sweep = '{sweep}' and tags.trial = '{trial}'",
                order_by=["attributes.start_time DESC"],
                max_results=1,
            )
        }
        for run_id in killed:
            mlflow_client.set_terminated(run_id, "KILLED")
        for run in runs:
            if run.info.run_id not in killed:
                trial = run.data.tags.get("trial", "")
                mlflow_client.set_terminated(run.info.run_id, "FAILED" if trial in failed else "FINISHED")
