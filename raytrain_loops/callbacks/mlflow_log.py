"""Rank 0's MLflow logging, a loop callback; runs on every worker (logging on rank 0 only), or in
the calling process. Ray-free.

Rank 0 of every attempt attaches to the MLflow run the driver created (``<run_dir>/mlflow_run_id``,
:mod:`raytrain_loops.driver.tracking`) and logs the interval metrics and evaluations, already
reduced over all workers, with their step; steps that a restarted group replays are not logged
twice. A tracking store that stops answering never stalls training: every request is bounded
(MLflow's own defaults retry a request for minutes), and rank 0 logs from a bounded queue that
nothing waits on for long. The MLflow client and its request bounds live here; the driver uses
them too.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from raytrain_loops.callbacks.series import series
from raytrain_loops.config import ConfigError
from raytrain_loops.engine.loop import Callback

KEY = "logging.mlflow.tracking_uri"


METRICS_PER_CALL = 1000


WORKER_HTTP = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}


MAX_PENDING = 1000  # rank 0's batches waiting to be sent; more are dropped and counted


SETTLE_S = 5.0  # how long an evaluation or a checkpoint waits for the metrics before it, while the store keeps up


CLOSE_S = 30.0  # how long an attempt's end waits for the metrics still queued, while the store answers



@dataclass(frozen=True)
class TrackedRun:
    """The MLflow run that a run directory's attempts log to."""

    tracking_uri: str
    run_id: str



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
    # A new SQL store announces its tables at INFO on the console ("Creating initial MLflow database
    # tables...", "Updating database tables"): set-up of the store, not news about the run.
    for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)
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
def http_limits(settings: dict[str, str]) -> Iterator[None]:
    """MLflow's requests in the block bounded by ``settings`` (the user's own values win)."""
    added = _set_defaults(settings)
    try:
        yield
    finally:
        _unset(added)



def failure_reason(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"



class MlflowLog(Callback):
    """Rank 0's metrics in the MLflow run: each logging interval's metrics (averaged over all
    workers), each epoch's averages (``train_<name>``) and each evaluation, at their step, under
    the names the console and the files use (:func:`~raytrain_loops.callbacks.series.series`:
    the system figures with ``system_series``).

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

    def __init__(self, run: TrackedRun | None, rank: int, max_pending: int = MAX_PENDING, system_series: bool = False):
        self.enabled = run is not None and rank == 0
        self.system_series = system_series
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
            self._submit(series(metrics, self.system_series), step)

    def on_epoch(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        if self.enabled:
            self._submit(series(metrics, self.system_series), step)

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
                # Once the attempt is ending, a failed request is the last: close() stops waiting at
                # the failure, and a request sent after it would outlive close() by its timeout.
                if self._abandoned or not self._pending or (self._closing and self._failing):
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
            print(f"warning: MLflow logging failed (training goes on): {failure_reason(err)}", flush=True)

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
