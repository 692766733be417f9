"""MLflow tracking against real local MLflow stores (a directory, sqlite): the URI checked before
Ray starts, the config as params, reduced metrics with their step, one MLflow run per run
directory through restarts and reruns; and against a local tracking server over HTTP that stops
answering mid-run (tests/support/mlflow_server.py). The Ray run whose killed and crashed workers log to
one MLflow run is in ray/test_fault_recovery.py (its runs serve both)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from raytrain_loops import fit
from raytrain_loops.callbacks.mlflow_log import SETTLE_S, MlflowLog, TrackedRun
from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.driver import fit as fit_module
from raytrain_loops.driver.run_checks import flatten
from raytrain_loops.driver.tracking import RUN_ID_FILE, end_run, open_tracking, start_run
from raytrain_loops.recipes import resolve
from tests.support.mlflow_server import TrackingServer

mlflow = pytest.importorskip("mlflow")


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.fixture
def closed_port():
    """A port that refuses connections, which no other process can take while the test runs: a
    socket bound to it that never listens (a port bound and released could be bound again by one
    of Ray's processes in between)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.mark.deadline
@pytest.mark.parametrize("uri", ["nosuchstore://somewhere", "http://127.0.0.1:{port}"])
def test_an_unusable_tracking_uri_is_an_error_naming_the_key_before_ray_starts(tmp_path, monkeypatch, closed_port, uri):
    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(fit_module, "ensure_ray", no_ray)
    uri = uri.format(port=closed_port)
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        fit(
            resolve("default"),
            overrides=[
                f"logging.mlflow.tracking_uri={uri}",
                f"data.dir={tmp_path / 'data'}",
                f"run.storage_path={tmp_path / 'runs'}",
            ],
        )
    assert info.value.key == "logging.mlflow.tracking_uri" and uri in str(info.value)
    assert time.monotonic() - started < 30  # no minutes of HTTP retries against a closed port
    assert not (tmp_path / "data").exists() and not (tmp_path / "runs").exists()  # nothing prepared


def test_the_callback_logs_each_step_once_across_a_restart_and_a_rerun_reopens_the_run(tmp_path):
    store = tmp_path / "mlruns"  # a directory store
    config = load_config(resolve("default"), [f"logging.mlflow.tracking_uri={store}", "logging.mlflow.experiment=e"])
    tracking = open_tracking(config.logging.mlflow)
    run_dir = str(tmp_path / "run")
    run = start_run(tracking, run_dir, "digits-x", config)
    client = mlflow.MlflowClient(tracking.tracking_uri)
    params = client.get_run(run.run_id).data.params
    assert params["optim.name"] == "adamw" and params["logging.mlflow.experiment"] == "e"
    assert set(params) == set(flatten(config.to_dict()))
    assert (Path(run_dir) / RUN_ID_FILE).read_text().strip() == run.run_id

    def attempt(steps: list[int]) -> None:
        logs = [MlflowLog(run, rank=0), MlflowLog(run, rank=1)]  # only rank 0 logs
        for step in steps:
            for log in logs:
                log.on_interval({"loss": 1.0 / step, "lr": 0.1, "step": float(step)}, step)
                if step % 4 == 0:
                    log.on_eval({"eval_accuracy": step / 100}, step, epoch=0)
        for log in logs:
            log.close()

    attempt([2, 4, 6])  # killed after step 6: the checkpoint was at step 2
    attempt([4, 6, 8])  # the restarted group replays steps 4 and 6
    assert _history(client, run.run_id, "loss") == [(2, 0.5), (4, 0.25), (6, 1 / 6), (8, 0.125)]
    assert _history(client, run.run_id, "eval_accuracy") == [(4, 0.04), (8, 0.08)]
    assert "step" not in client.get_run(run.run_id).data.metrics  # the step is the axis

    # A rerun of the run directory (a resumed run, or a changed run length) continues it.
    longer = load_config(config.to_dict(), ["loop.max_steps=99"])
    again = start_run(open_tracking(longer.logging.mlflow), run_dir, "digits-x", longer)
    assert again.run_id == run.run_id
    assert client.get_run(run.run_id).data.params["loop.max_steps"] == "0"  # MLflow keeps the first value
    assert len(client.search_runs([tracking.experiment_id])) == 1


def test_a_failing_tracking_store_is_a_warning_and_the_loop_goes_on(tmp_path, capsys):
    store = tmp_path / "mlruns"
    open_tracking(load_config(None, [f"logging.mlflow.tracking_uri={store}"]).logging.mlflow)
    log = MlflowLog(TrackedRun(str(store), "0123456789abcdef0123456789abcdef"), rank=0)  # no such run
    for step in (1, 2, 3):
        log.on_interval({"loss": 1.0}, step)
    log.close()
    out = capsys.readouterr().out
    assert out.count("warning: MLflow logging failed (training goes on)") == 1
    assert log.failures >= 1 and log.unsent == 3 and log.dropped == 0  # each value failed or was left at the end
    (summary,) = [line for line in out.splitlines() if line.startswith("warning: MLflow logging of this attempt: ")]
    assert f"{log.failures} requests failed" in summary and "3 metric values not sent" in summary


@pytest.fixture
def tracking_server(tmp_path, monkeypatch):
    for name in (
        "MLFLOW_HTTP_REQUEST_TIMEOUT",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
    ):
        monkeypatch.delenv(name, raising=False)  # this project's bounds, not a setting of the machine
    with TrackingServer(tmp_path / "artifacts") as server:
        yield server


def _timed(call, limit: float):
    """Run ``call`` on a thread and return (its seconds, its result or exception), failing when it
    takes longer than ``limit`` seconds: a test of a hanging server must not hang itself."""
    box: dict = {}

    def run():
        try:
            box["result"] = call()
        except Exception as err:
            box["result"] = err

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"still waiting on the tracking server after {limit} s"
    return time.monotonic() - started, box["result"]


@pytest.mark.deadline
def test_a_tracking_server_that_stops_answering_holds_up_no_evaluation_checkpoint_or_end(
    tracking_server, tmp_path, capsys
):
    server = tracking_server
    config = load_config(resolve("default"), [f"logging.mlflow.tracking_uri={server.url}"])
    run = start_run(open_tracking(config.logging.mlflow), str(tmp_path / "run"), "r", config)
    log = MlflowLog(run, rank=0, max_pending=4)
    log.on_interval({"loss": 1.0, "lr": 0.1}, 1)
    log.on_eval({"eval_accuracy": 0.5}, 1, epoch=0)  # the store keeps up: the evaluation is in before the report
    assert server.metric_values(run.run_id) == [("eval_accuracy", 1, 0.5), ("loss", 1, 1.0), ("lr", 1, 0.1)]

    server.stop_answering()
    waited = {}
    for step in range(2, 31):
        log.on_interval({"loss": 1 / step, "lr": 0.1}, step)
        if step % 10 == 0:
            started = time.monotonic()
            log.on_eval({"eval_accuracy": step / 100}, step, epoch=0)
            log.before_checkpoint()
            waited[step] = time.monotonic() - started
    # The first evaluation waits its few seconds for a request that hangs; the next ones do not.
    assert waited[10] < SETTLE_S + 1 and waited[20] < 0.5 and waited[30] < 0.5, waited
    # The end waits for the request under way: a 5 s timeout and one retry (MLflow's own
    # defaults: 120 s and 7 retries with backoff), and sends nothing after it. A switch interval
    # of 0.5 s lets the logging thread run on from its failed request before the end's thread
    # sees the failure: the interleaving in which a thread that sent the next batch is caught,
    # here every time (CI saw it once in a run at the default interval).
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    try:
        closing, _ = _timed(log.close, 60)
        log._thread.join(2.0)  # ends at the failure, not after another request's timeout
    finally:
        sys.setswitchinterval(interval)
    assert closing < 12 and server.unanswered == 2 and not log._thread.is_alive(), (closing, server.unanswered)

    # Every value sent after the server stopped is counted, dropped at the full queue or not sent.
    sent = 29 * 2 + 3
    assert log.failures == 1 and log.dropped > 0 and log.dropped + log.unsent == sent
    assert len(server.metric_values(run.run_id)) == 3
    out = capsys.readouterr().out
    assert out.count("warning: MLflow is 4 batches behind: metrics are dropped from step ") == 1
    assert out.count("warning: MLflow logging failed (training goes on): ") == 1 and "Read timed out" in out
    (summary,) = [line for line in out.splitlines() if line.startswith("warning: MLflow logging of this attempt: ")]
    assert summary == (
        "warning: MLflow logging of this attempt: 1 requests failed, "
        f"{log.dropped} metric values dropped with 4 batches waiting, "
        f"{log.unsent} metric values not sent (failed, or waiting at the end)"
    )


@pytest.mark.deadline
def test_the_drivers_requests_to_a_tracking_server_that_stops_answering_end_in_seconds(
    tracking_server, tmp_path, capsys, monkeypatch
):
    from mlflow.exceptions import MlflowException

    server = tracking_server
    config = load_config(resolve("default"), [f"logging.mlflow.tracking_uri={server.url}"])
    tracking = open_tracking(config.logging.mlflow)
    run = start_run(tracking, str(tmp_path / "run"), "r", config)
    (tmp_path / "run" / "summary.json").write_text("{}")
    server.stop_answering()

    # The run's end: one request (a 10 s timeout and one retry), nothing after the first failure.
    ending, _ = _timed(lambda: end_run(run, str(tmp_path / "run"), "FINISHED"), 60)
    assert ending < 24 and server.unanswered == 2, (ending, server.unanswered)
    assert f"warning: could not end the MLflow run {run.run_id}: MlflowException: " in capsys.readouterr().out
    # A run's set-up fails as surely, before Ray starts; a timeout the user set wins.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    starting, error = _timed(lambda: start_run(tracking, str(tmp_path / "other"), "r2", config), 60)
    assert starting < 5 and server.unanswered == 4 and isinstance(error, MlflowException), (starting, error)


def test_the_stores_run_id_is_recorded_and_a_missing_run_is_replaced(tmp_path):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = load_config(resolve("default"), [f"logging.mlflow.tracking_uri={store}"])
    tracking = open_tracking(config.logging.mlflow)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / RUN_ID_FILE).write_text("0123456789abcdef0123456789abcdef\n")  # from another store
    run = start_run(tracking, str(run_dir), "r", config)
    assert run.run_id != "0123456789abcdef0123456789abcdef"
    assert (run_dir / RUN_ID_FILE).read_text().strip() == run.run_id
    client = mlflow.MlflowClient(store)
    assert client.get_run(run.run_id).info.run_name == "r"
    # Artifacts beside the database, not in the current directory of the process that created it.
    assert client.get_experiment(tracking.experiment_id).artifact_location == f"file://{tmp_path}/mlartifacts"
    assert isinstance(run, TrackedRun) and run.tracking_uri == store


def test_a_new_sql_store_is_opened_without_mlflows_table_messages(tmp_path):
    """MLflow announces a new SQL store's tables at INFO on stderr; a run's console does not show them."""
    code = (
        "from raytrain_loops.config import load_config; from raytrain_loops.recipes import resolve; "
        "from raytrain_loops.driver.tracking import open_tracking; "
        f"open_tracking(load_config(resolve('default'), ['logging.mlflow.tracking_uri=sqlite:///{tmp_path}/m.db'])"
        ".logging.mlflow); print('opened')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "opened", out.stderr[-2000:]
    assert "database tables" not in out.stderr and "alembic" not in out.stderr, out.stderr
    assert (tmp_path / "m.db").is_file()
