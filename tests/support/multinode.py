"""A Ray cluster of two nodes on this machine that share no files: the suite's multi-node test bed.

- The head: ``ray start --head --block`` with token auth, the dashboard on 127.0.0.1 and every
  port explicit (the suite's own local Ray holds the defaults).
- A second node: ``ray start --address ... --block`` inside its own mount namespace (``unshare
  --mount --propagation private``) with private tmpfs mounts over ``/tmp`` (Ray's temp dir, the
  head's directories, pytest's ``tmp_path``) and over the home cache (``~/.cache/raytrain_loops``):
  it sees none of the head's files, only the checkout and its venv (bound back where ``/tmp``
  hides them). Ray talks over loopback.
- Shared storage: a real S3 API (moto's server) holding the bucket ``runs``; run directories and
  data the second node must read go there.

Each node runs in a process group of its own and is stopped by signalling that group only, so
the suite's other Ray instance is left alone. ``tests/conftest.py`` starts one :class:`Cluster`
for the session (the ``cluster`` fixture); the second node is started, drained and stopped by
the tests that need it.
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
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")
HOME_CACHE = Path.home() / ".cache" / "raytrain_loops"
BUCKET = "runs"
JOIN_S = 90.0  # a node start on 2 busy cores
SECOND_NODE_ENV = "RTL_TESTBED_SECOND_NODE"  # set in the second node's processes (Ray's workers there too)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One ``ray start --block`` process group (``prefix``: what runs it, e.g. ``unshare``)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path, prefix: list[str] | None = None):
        self.log_path = log
        self.log = open(log, "w")  # noqa: SIM115 - the node writes to it until stop()
        self.proc = subprocess.Popen(
            [*(prefix or []), RAY, "start", "--block", *args],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def running(self) -> bool:
        return self.proc.poll() is None

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

    def tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def http_get(url: str, token: str | None) -> tuple[int, bytes]:
    """The status and body of a GET (status 0: nothing listening yet)."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, b""
    except (urllib.error.URLError, OSError):
        return 0, b""


# The second node's start, run by `sh` in its own mount namespace: each directory to keep (before
# the first "--") opened, tmpfs over /tmp and each directory to hide (before the second), the kept
# ones bound back from their open descriptors (their paths now lead into the tmpfs), the token
# written into the new /tmp (the head's copy is hidden), then Ray.
_PRIVATE_MOUNTS = """set -e
fd=3 kept=""
while [ "$1" != "--" ]; do eval "exec $fd<\\"\\$1\\""; kept="$kept$fd $1
"; fd=$((fd + 1)); shift; done
shift
mount -t tmpfs rtl-tmp /tmp
while [ "$1" != "--" ]; do mkdir -p "$1"; mount -t tmpfs rtl-private "$1"; shift; done
shift
printf %s "$kept" | while read -r n path; do mkdir -p "$path"; mount -c --bind "/proc/self/fd/$n" "$path"; done
n=3; while [ "$n" -lt "$fd" ]; do eval "exec $n<&-"; n=$((n + 1)); done
printf %s "$RTL_TOKEN" > /tmp/ray-token
export RAY_AUTH_TOKEN_PATH=/tmp/ray-token
unset RTL_TOKEN
exec "$@"
"""


def kept(paths: list[str | Path], hidden: list[str]) -> list[str]:
    """Of ``paths`` (the checkout, its venv, the interpreter's), those the second node's mounts
    would hide (under ``/tmp`` or a ``hidden`` directory), outermost only: bound back for it."""
    covers = [Path("/tmp"), *map(Path, hidden)]
    found = {Path(p).resolve() for p in paths}
    under = [p for p in found if any(p.is_relative_to(c) for c in covers)]
    return sorted(str(p) for p in under if not any(p != q and p.is_relative_to(q) for q in under))


def private_mounts(keep: list[str], hidden: list[str]) -> list[str]:
    """The command prefix that runs a command in its own mount namespace, ``hidden`` and ``/tmp``
    hidden, ``keep`` still reached."""
    namespace = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _PRIVATE_MOUNTS, "sh"]
    return [*namespace, *keep, "--", *hidden, "--"]


@dataclass
class S3Server:
    """moto's S3 server on a free port with the bucket ``runs``."""

    endpoint: str
    server: object = field(repr=False)

    @classmethod
    def start(cls) -> S3Server:
        import boto3
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint = f"{host}:{port}"
        client = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        return cls(endpoint, server)

    def uri(self, prefix: str | None = None) -> str:
        """A fresh prefix in the bucket (or ``prefix``), as a URI pyarrow and Ray open."""
        key = prefix or uuid.uuid4().hex[:8]
        return f"s3://{BUCKET}/{key}?endpoint_override={self.endpoint}&scheme=http&region=us-east-1"

    def stop(self) -> None:
        self.server.stop()


@dataclass
class Cluster:
    """The running head, its S3 server and (while started) the second node."""

    root: Path
    token: str
    env: dict[str, str]
    gcs: str
    url: str
    head: Node
    s3: S3Server
    second: Node | None = None
    hidden: list[str] = field(default_factory=list)  # what the second node gets a private tmpfs over

    def nodes(self) -> list[dict]:
        """The alive nodes (the State API's records: ``node_id``, ``is_head_node``, ...)."""
        status, body = http_get(f"{self.url}/api/v0/nodes?limit=100&detail=true", self.token)
        if status != 200:
            return []
        records = json.loads(body)["data"]["result"]["result"]
        return [n for n in records if n.get("state") == "ALIVE"]

    def wait_nodes(self, count: int, timeout: float = JOIN_S) -> None:
        """Wait until ``count`` nodes are alive (a joining node, or one going away)."""
        deadline = time.monotonic() + timeout
        while len(self.nodes()) != count:
            if self.second is not None and count == 2 and not self.second.running():
                raise AssertionError(f"the second node exited:\n{self.second.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"not {count} nodes after {timeout:.0f} s: {self.nodes()}")
            time.sleep(1)

    def second_node_id(self) -> str:
        [node] = [n["node_id"] for n in self.nodes() if not n["is_head_node"]]
        return node

    def start_second(self, cpus: int = 2, log_name: str = "second.log") -> Node:
        """Start the second node (in its own mount namespace) and wait until it has joined."""
        assert self.second is None or not self.second.running(), "the second node is running"
        names = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port")
        args = [f"--address={self.gcs}", f"--num-cpus={cpus}", f"--runtime-env-agent-port={free_port()}"]
        args += ["--temp-dir=/tmp/ray", *(f"--{name}={free_port()}" for name in names)]
        env = {**self.env, "RTL_TOKEN": self.token, SECOND_NODE_ENV: "1"}
        env.pop("RAY_AUTH_TOKEN_PATH")
        keep = kept([ROOT, sys.prefix, sys.base_prefix], self.hidden)
        self.second = Node(args, env, self.root / log_name, prefix=private_mounts(keep, self.hidden))
        self.wait_nodes(2)
        return self.second

    def ensure_second(self) -> Node:
        """The second node, started unless it is running: tests that only need it up share one
        start (about 30 s on 2 cores) and leave it running for the next."""
        if self.second is not None and self.second.running():
            return self.second
        return self.start_second()

    def cli(self, *args: str, timeout: float = 420, home: Path | None = None) -> subprocess.CompletedProcess:
        """``raytrain-loops ARGS`` run on the head's machine as a driver of this cluster (``home``:
        its home directory, where the caches and staging directories of ``~/.cache`` go)."""
        env = {**self.env, "RAY_ADDRESS": self.gcs, **({"HOME": str(home)} if home else {})}
        return subprocess.run(
            [sys.executable, "-m", "raytrain_loops.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def second_sees(self, path: Path | str) -> bool:
        """Whether ``path`` exists as the second node's processes see it (through its mount
        namespace: ``/proc/<pid>/root``)."""
        assert self.second is not None and self.second.running(), "the second node is not running"
        return Path(f"/proc/{self.second.proc.pid}/root{Path(path).resolve()}").exists()

    def stop_second(self) -> None:
        if self.second is not None and self.second.running():
            self.second.stop()
        self.second = None

    def drain(self, node_id: str, deadline_s: int, reason: str = "DRAIN_NODE_REASON_PREEMPTION") -> float:
        """``ray drain-node`` as a cloud's preemption notice would come; the deadline (epoch s; at
        the latest: the command sets it from its own clock, seconds after it starts)."""
        cmd = [RAY, "drain-node", f"--address={self.gcs}", f"--node-id={node_id}", f"--reason={reason}"]
        cmd += ["--reason-message=test", f"--deadline-remaining-seconds={deadline_s}"]
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        return time.time() + deadline_s


def _head_env(root: Path, dashboard: int) -> dict[str, str]:
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(root / "token"),
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
        # The nodes' workers at the priority of the suite's own local Ray's (start_local_ray's), not at
        # Ray's default nice 15: near the tests without Ray (nice 19 in scripts/test.sh), which still
        # run beside the first multi-node tests (at nice 10 they ran below those tests).
        "RAY_worker_niceness": "0",
        # Ray Train's preemption watcher on (the suite's local Ray turns it off), polling every
        # second instead of 5.
        "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "1",
        "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1",
        # Ray Train's placement-group cleaner finds the State API through this; without it, it
        # would look for the cluster `ray start` last recorded on this machine, which may be another.
        "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dashboard}",
        # A group start that cannot be satisfied (a node just left) gives up after 20 s, not 60.
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20",
    }
    env.pop("RAY_ADDRESS", None)
    return env


@contextlib.contextmanager
def running_cluster(head_cpus: int = 3) -> Iterator[Cluster]:
    """The head and the S3 server, stopped (with any second node) on leaving."""
    root = Path(tempfile.mkdtemp(prefix="rtl-head-"))  # short: Ray's socket paths have a length limit
    token = secrets.token_hex(16)
    (root / "token").write_text(token)
    gcs, dashboard = free_port(), free_port()
    env = _head_env(root, dashboard)
    # Every port explicit: another Ray on this machine (the suite's own) holds the defaults.
    ports = [f"--port={gcs}", f"--dashboard-port={dashboard}", f"--ray-client-server-port={free_port()}"]
    names = (
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "metrics-export-port",
        "runtime-env-agent-port",
    )
    ports += [f"--{name}={free_port()}" for name in names]
    head = Node(["--head", "--dashboard-host=127.0.0.1", f"--num-cpus={head_cpus}", *ports], env, root / "head.log")
    s3 = None
    cluster = None
    try:
        url = f"http://127.0.0.1:{dashboard}"
        deadline = time.monotonic() + JOIN_S
        while http_get(f"{url}/api/version", token)[0] != 200:
            if time.monotonic() > deadline or not head.running():
                raise AssertionError(f"the head did not come up:\n{head.tail()}")
            time.sleep(1)
        s3 = S3Server.start()
        hidden = sorted({str(HOME_CACHE), *_outside_tmp(tempfile.gettempdir())})
        cluster = Cluster(root, token, env, f"127.0.0.1:{gcs}", url, head, s3, hidden=hidden)
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop_second()
        head.stop()
        if s3 is not None:
            s3.stop()


def _outside_tmp(path: str) -> list[str]:
    """``path`` when the second node's tmpfs over ``/tmp`` does not already hide it."""
    return [] if Path(path).resolve().is_relative_to("/tmp") else [path]
