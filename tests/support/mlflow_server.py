"""A local MLflow tracking server for tests of a store that stops answering: the REST endpoints
MLflow's client uses for a run (experiments, runs, params and metrics in ``log-batch``, metric
histories), kept in memory, over real HTTP. After :meth:`TrackingServer.stop_answering` it still
accepts connections and reads requests, but never answers them: what a tracking server that hangs
(an overloaded database, a stalled proxy) looks like to a client. Artifacts go to a local
directory, as the run's ``artifact_uri`` says, without the server."""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

API = "/api/2.0/mlflow/"


class TrackingServer:
    def __init__(self, artifacts: Path):
        self.artifacts = artifacts
        self.experiments: dict[str, dict[str, Any]] = {}
        self.runs: dict[str, dict[str, Any]] = {}
        self.requests: list[str] = []  # every request's endpoint, answered or not
        self.unanswered = 0  # requests received after stop_answering
        self._silent = threading.Event()
        self._released = threading.Event()  # at shutdown: the held requests end, unanswered
        self._lock = threading.Lock()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, name="mlflow-server", daemon=True)

    def __enter__(self) -> TrackingServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._released.set()
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=10)

    def stop_answering(self) -> None:
        self._silent.set()

    def metric_values(self, run_id: str) -> list[tuple[str, int, float]]:
        with self._lock:
            return sorted((m["key"], m["step"], m["value"]) for m in self.runs[run_id]["metrics"])

    # The REST API, as MLflow's REST store calls it.

    def answer(self, method: str, endpoint: str, query: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        with self._lock:
            if (method, endpoint) == ("GET", "experiments/get-by-name"):
                for experiment in self.experiments.values():
                    if experiment["name"] == query["experiment_name"]:
                        return 200, {"experiment": experiment}
                return 404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no such experiment"}
            if (method, endpoint) == ("POST", "experiments/create"):
                experiment_id = str(len(self.experiments) + 1)
                self.experiments[experiment_id] = {
                    "experiment_id": experiment_id,
                    "name": body["name"],
                    "artifact_location": (self.artifacts / experiment_id).as_uri(),
                    "lifecycle_stage": "active",
                }
                return 200, {"experiment_id": experiment_id}
            if (method, endpoint) == ("POST", "runs/create"):
                run_id = uuid.uuid4().hex
                self.runs[run_id] = {
                    "info": {
                        "run_id": run_id,
                        "run_uuid": run_id,
                        "run_name": body.get("run_name", ""),
                        "experiment_id": body["experiment_id"],
                        "status": "RUNNING",
                        "start_time": body.get("start_time", 0),
                        "artifact_uri": (self.artifacts / run_id).as_uri(),
                        "lifecycle_stage": "active",
                    },
                    "params": {},
                    "tags": {t["key"]: t["value"] for t in body.get("tags", [])},
                    "metrics": [],
                }
                return 200, {"run": self._run(run_id)}
            run_id = body.get("run_id") or query.get("run_id", "")
            if run_id not in self.runs:
                return 404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": f"run {run_id!r} not found"}
            run = self.runs[run_id]
            if (method, endpoint) == ("GET", "runs/get"):
                return 200, {"run": self._run(run_id)}
            if (method, endpoint) == ("POST", "runs/update"):
                run["info"]["status"] = body.get("status", run["info"]["status"])
                return 200, {"run_info": run["info"]}
            if (method, endpoint) == ("POST", "runs/log-batch"):
                run["params"].update({p["key"]: p["value"] for p in body.get("params", [])})
                run["metrics"].extend(
                    {"key": m["key"], "value": m["value"], "timestamp": m["timestamp"], "step": int(m.get("step", 0))}
                    for m in body.get("metrics", [])
                )
                return 200, {}
            if (method, endpoint) == ("GET", "metrics/get-history"):
                return 200, {"metrics": [m for m in run["metrics"] if m["key"] == query["metric_key"]]}
        return 404, {"error_code": "ENDPOINT_NOT_FOUND", "message": f"{method} {endpoint} is not served here"}

    def _run(self, run_id: str) -> dict[str, Any]:
        run = self.runs[run_id]
        latest: dict[str, dict[str, Any]] = {}
        for m in run["metrics"]:
            if m["key"] not in latest or m["step"] >= latest[m["key"]]["step"]:
                latest[m["key"]] = m
        return {
            "info": run["info"],
            "data": {
                "metrics": list(latest.values()),
                "params": [{"key": k, "value": v} for k, v in run["params"].items()],
                "tags": [{"key": k, "value": v} for k, v in run["tags"].items()],
            },
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def _serve(self, method: str) -> None:
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}") if length else {}
                endpoint = url.path.removeprefix(API)
                server.requests.append(endpoint)
                if server._silent.is_set():
                    with server._lock:
                        server.unanswered += 1
                    server._released.wait()  # never answered; the connection ends at shutdown
                    self.close_connection = True
                    return
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                status, payload = server.answer(method, endpoint, query, body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler


def wait_for(condition, timeout: float, what: str) -> None:
    """Wait up to ``timeout`` seconds for ``condition()``; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)
