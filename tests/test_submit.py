"""`ray job submit` end to end: a local head started with `ray start --head` (token auth on,
dashboard on 127.0.0.1), runs submitted through the Jobs API, a two-node cluster, and a refused
unauthenticated request.

Each node runs `ray start --block` in its own session and is stopped by signalling that session
only, so the suite's other Ray instance is left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from raytrain_loops.engine import checkpoint as ckpt
from raytrain_loops.recipes import resolve

VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One `ray start --block` process group."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        self.log = open(log, "w")  # noqa: SIM115 - the node writes to it until stop()
        self.proc = subprocess.Popen(
            [RAY, "start", "--block", *args],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def stop(self) -> None:
        """SIGTERM (``--block`` then stops what it started), then SIGKILL for anything left in
        the process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()


def _get(url: str, token: str | None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code
    except urllib.error.URLError:
        return 0  # not listening yet


@pytest.fixture(scope="module")
def head():
    root = Path(tempfile.mkdtemp(prefix="rtl-head-"))  # short: Ray's socket paths have a length limit
    token = secrets.token_hex(16)
    (root / "token").write_text(token)
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(root / "token"),
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    }
    env.pop("RAY_ADDRESS", None)
    gcs, dashboard = _free_port(), _free_port()
    # Ray Train's placement-group cleaner finds the State API through this; without it, it would
    # look for the cluster `ray start` last recorded on this machine, which may be another one.
    env["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{dashboard}"
    # A group start that cannot be satisfied (a node just left) gives up after 20 s, not 60.
    env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "20"
    # Every port explicit: another Ray on this machine (the suite's own) holds the defaults.
    ports = [
        f"--port={gcs}",
        f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={_free_port()}",
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--dashboard-agent-grpc-port={_free_port()}",
        f"--metrics-export-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}",
    ]
    node = Node(["--head", "--dashboard-host=127.0.0.1", "--num-cpus=3", *ports], env, root / "head.log")
    url = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 90
        while _get(f"{url}/api/version", token) != 200:
            if time.monotonic() > deadline or node.proc.poll() is not None:
                raise AssertionError(f"the head did not come up:\n{(root / 'head.log').read_text()[-2000:]}")
            time.sleep(1)
    except BaseException:
        node.stop()
        raise
    yield {"url": url, "gcs": f"127.0.0.1:{gcs}", "env": env, "token": token, "root": root}
    node.stop()


def _submit(
    head, storage: Path, *overrides: str, env: dict[str, str] | None = None, recipe: str = "default"
) -> subprocess.CompletedProcess:
    args = [
        "-m",
        "raytrain_loops.cli",
        "submit",
        recipe,
        "logging.every_steps=4",
        f"run.storage_path={storage}",
        f"data.dir={storage / 'data'}",
        *overrides,
        "--address",
        head["url"],
    ]
    return subprocess.run([sys.executable, *args], env=env or head["env"], capture_output=True, text=True, timeout=300)


def _second_node(head, log_name: str) -> Node:
    """A node with 2 CPUs joining the head, every port of its own explicit."""
    names = (
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "metrics-export-port",
        "runtime-env-agent-port",
    )
    ports = [f"--{name}={_free_port()}" for name in names]
    return Node([f"--address={head['gcs']}", "--num-cpus=2", *ports], head["env"], head["root"] / log_name)


@pytest.mark.ray
def test_unauthenticated_requests_are_refused(head, tmp_path):
    assert _get(f"{head['url']}/api/jobs/", None) == 401
    assert _get(f"{head['url']}/api/jobs/", "0" * 32) == 403
    wrong = tmp_path / "wrong-token"
    wrong.write_text("f" * 32)
    out = _submit(head, tmp_path, "loop.max_steps=8", env={**head["env"], "RAY_AUTH_TOKEN_PATH": str(wrong)})
    assert out.returncode != 0
    assert "403" in out.stderr or "uthentica" in out.stderr, out.stderr[-2000:]
    assert not list(tmp_path.glob("*/summary.json"))


def _cluster_cpus(head) -> float:
    out = subprocess.run(
        [RAY, "status", f"--address={head['gcs']}"], env=head["env"], capture_output=True, text=True, timeout=60
    )
    for line in out.stdout.splitlines():
        if line.strip().endswith(" CPU") and "/" in line:
            return float(line.split("/")[1].split()[0])
    return 0.0


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _node_ids(checkpoint: Path) -> set[str]:
    return {torch.load(checkpoint / f"rank{r}.pt", weights_only=True)["node_id"] for r in (0, 1)}


@pytest.mark.ray
def test_submitted_runs_shard_alike_on_one_node_or_two_and_an_elastic_run_goes_on_when_a_node_goes(head, tmp_path):
    """Two runs through the Jobs API on one cluster (a node start and two runs fewer than a test
    per point):

    - elastic: scaling.min_workers=1 of 2 workers of 2 CPUs, so one on the head (3 CPUs) and one
      on a second node. The second node is stopped mid-run (SIGTERM, as a preemption notice
      would); Ray Train restarts the group with the one worker the head holds, which takes two
      micro-batches per update (the same global batch), and the run ends close to a fixed-size
      run;
    - fixed: the recipe as a file in the job's uploaded working directory, both workers on the
      head (1 CPU each, STRICT_PACK); the job's progress lines are followed and its results
      printed. At step 10 its weights equal, bit for bit, those the elastic run had on two nodes:
      which rows a rank gets does not depend on where Ray placed it (Parquet shards without node
      locality, in order)."""
    # Each worker on one thread: the two placements differ in CPUs per worker, not in arithmetic.
    # Every checkpoint kept: the two runs are compared at step 10.
    common = [
        "loop.max_steps=60",
        "checkpoint.every_steps=5",
        "checkpoint.keep=20",
        "eval.every_steps=60",
        "scaling.threads_per_worker=1",
    ]
    worker = _second_node(head, "worker.log")
    try:
        deadline = time.monotonic() + 60
        while _cluster_cpus(head) < 5:  # the head's 3 and the node's 2
            assert time.monotonic() < deadline, "the second node did not join"
            time.sleep(1)
        elastic_args = [*common, "scaling.cpus_per_worker=2", "run.name=elastic", "scaling.min_workers=1"]
        run_dir = tmp_path / "elastic" / "elastic"
        job = subprocess.Popen(
            [sys.executable, "-m", "raytrain_loops.cli", "submit", "default", *elastic_args, "run.max_failures=3"]
            + [f"run.storage_path={tmp_path / 'elastic'}", f"data.dir={tmp_path / 'data'}", "--address", head["url"]],
            env=head["env"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 180
        two_nodes = run_dir / "checkpoint_00000010"
        # Past checkpoint 10 on 2 workers, both of its workers' files written.
        while not ((two_nodes / "manifest.rank1.json").exists() and [s for s in _steps(run_dir) if s["step"] >= 12]):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-3000:]
            time.sleep(0.2)
        worker.stop()  # the node goes, and its worker with it
        output = job.communicate(timeout=300)[0]
        assert job.returncode == 0, output[-3000:]
    finally:
        worker.stop()

    workdir = tmp_path / "job"
    workdir.mkdir()
    (workdir / "digits.yaml").write_text(resolve("default").read_text())
    fixed_args = [*common, "scaling.cpus_per_worker=1", "scaling.placement_strategy=STRICT_PACK", "run.name=fixed"]
    out = _submit(
        head, tmp_path / "fixed", *fixed_args, "--working-dir", str(workdir), recipe=str(workdir / "digits.yaml")
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert ": python -m raytrain_loops.cli train digits.yaml " in out.stdout  # relative to the working dir
    assert "step 4/60" in out.stdout  # the job's progress lines were followed
    assert "SUCCEEDED; results in " in out.stdout
    fixed_dir = Path(out.stdout.rsplit("results in ", 1)[1].strip())
    summary = json.loads((fixed_dir / "summary.json").read_text())
    assert summary["metrics"]["step"] == 60 and "eval_accuracy" in summary["metrics"]

    one_node = fixed_dir / "checkpoint_00000010"
    assert len(_node_ids(two_nodes)) == 2 and len(_node_ids(one_node)) == 1
    a, b = (ckpt.read_file(str(c), ckpt.STATE)["model"] for c in (two_nodes, one_node))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    steps = _steps(run_dir)
    assert steps[0]["workers"] == 2 and steps[-1]["workers"] == 1 and steps[-1]["step"] == 60
    # The global batch stayed 64 samples per update on one worker (2 micro-batches of 32).
    assert {s["sample_size"] for s in steps} == {64.0}
    counted = {s["step"]: s for s in steps}  # the last record of each step is the one that counted
    assert sorted(counted) == list(range(1, 61))
    reference = {s["step"]: s["loss"] for s in _steps(fixed_dir)}
    late = range(41, 61)
    elastic_loss = sum(counted[i]["loss"] for i in late) / len(late)
    fixed_loss = sum(reference[i] for i in late) / len(late)
    assert abs(elastic_loss - fixed_loss) < 0.25 * fixed_loss, (elastic_loss, fixed_loss)
