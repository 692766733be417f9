"""`ray job submit` end to end on the multi-node test bed (tests/support/multinode.py: a head with token
auth, a second node that shares no files with it, a moto S3 server): runs submitted through the
Jobs API on one node and on two, a preemption notice on the second node, and a refused
unauthenticated request.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from raytrain_loops import storage
from raytrain_loops.checkpoint import files as ckpt
from raytrain_loops.tasks.digits import DigitsTask
from tests.support.multinode import SECOND_NODE_ENV, Cluster, http_get

ROOT = Path(__file__).resolve().parents[2]
PREEMPTION_DEADLINE_S = 10  # the drain's notice: time to see it and save, short for the suite's budget
SLOW_S = 0.2  # what a step costs more on the second node


class SlowSecondNode(DigitsTask):
    """Digits whose criterion takes ``SLOW_S`` more on the test bed's second node: a slower node
    bounds the two-node group's rate whatever this machine's load, so that a run of 140
    steps is still training when the node's deadline passes (and the one-node group that resumes
    it, at full speed, has few steps to train again). The arithmetic is the digits task's."""

    def criterion(self, model, batch, ctx):
        if os.environ.get(SECOND_NODE_ENV):
            time.sleep(SLOW_S)
        return super().criterion(model, batch, ctx)


TASK = "task.name=tests.ray.test_job_submit:SlowSecondNode"


def _submit(
    cluster: Cluster, storage_path: Path, *overrides: str, env: dict[str, str] | None = None, recipe: str = "default"
) -> subprocess.CompletedProcess:
    args = [
        "-m",
        "raytrain_loops.cli",
        "submit",
        recipe,
        "logging.every_steps=4",
        f"run.storage_path={storage_path}",
        f"data.dir={storage_path / 'data'}",
        *overrides,
        "--address",
        cluster.url,
    ]
    return subprocess.run([sys.executable, *args], env=env or cluster.env, capture_output=True, text=True, timeout=300)


@pytest.mark.ray
def test_unauthenticated_requests_are_refused(cluster, tmp_path):
    assert http_get(f"{cluster.url}/api/jobs/", None)[0] == 401
    assert http_get(f"{cluster.url}/api/jobs/", "0" * 32)[0] == 403
    wrong = tmp_path / "wrong-token"
    wrong.write_text("f" * 32)
    out = _submit(cluster, tmp_path, "loop.max_steps=8", env={**cluster.env, "RAY_AUTH_TOKEN_PATH": str(wrong)})
    assert out.returncode != 0
    assert "403" in out.stderr or "uthentica" in out.stderr, out.stderr[-2000:]
    assert not list(tmp_path.glob("*/summary.json"))


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _node_ids(checkpoint: Path) -> set[str]:
    return {torch.load(checkpoint / f"rank{r}.pt", weights_only=True)["node_id"] for r in (0, 1)}


class _Job:
    """A submitted run whose output is read line by line as it comes."""

    def __init__(self, cluster: Cluster, args: list[str]):
        cmd = [sys.executable, "-m", "raytrain_loops.cli", "submit", "default", *args, "--address", cluster.url]
        env = {**cluster.env, "PYTHONUNBUFFERED": "1"}  # each progress line as it comes
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def progress(self) -> list[int]:
        """The steps of the progress lines so far, in order."""
        return [int(m.group(1)) for line in list(self.lines) if (m := re.search(r"\bstep (\d+)/\d+ \(", line))]

    def wait(self, timeout: float) -> str:
        self.proc.wait(timeout)
        self._reader.join(10)
        return "".join(self.lines)


def _preempted_run(cluster: Cluster, tmp_path: Path, common: list[str]) -> tuple[Path, dict]:
    """The elastic run on two nodes, its second node drained as a preemption once the run is
    training, then stopped after the deadline; the run directory (copied from the bucket) and
    what the test saw."""
    cluster.ensure_second()  # started by an earlier multi-node test, or now
    assert not cluster.second_sees(tmp_path) and not cluster.second_sees(cluster.root)
    assert cluster.second_sees(sys.executable)  # the code is installed on every node, the files are not
    bucket = cluster.s3.uri()
    args = [*common, "scaling.cpus_per_worker=2", "run.name=elastic", "scaling.min_workers=1", "run.max_failures=0"]
    job = _Job(cluster, [*args, f"run.storage_path={bucket}", f"data.dir={tmp_path / 'data'}"])
    try:
        deadline = time.monotonic() + 180
        while not [s for s in job.progress() if s >= 8]:
            assert job.proc.poll() is None and time.monotonic() < deadline, "".join(job.lines)[-3000:]
            time.sleep(0.2)
        drained_at = time.time()
        node_deadline = cluster.drain(cluster.second_node_id(), PREEMPTION_DEADLINE_S)
        time.sleep(max(0.0, node_deadline + 1 - time.time()))  # Ray restarts the group at the deadline
        cluster.stop_second()  # the node goes after its deadline, as a cloud takes it
        output = job.wait(timeout=300)
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
        cluster.stop_second()
    assert job.proc.returncode == 0, output[-4000:]
    run_dir = Path(storage.download_dir(storage.join(bucket, "elastic"), str(tmp_path / "elastic")))
    return run_dir, {"output": output, "drained": drained_at, "deadline": node_deadline, "progress": job.progress()}


@pytest.mark.ray
def test_submitted_runs_shard_alike_on_one_node_or_two_and_a_preempted_node_costs_only_the_steps_after_its_notice(
    cluster, tmp_path
):
    """Two runs through the Jobs API on the test bed (a node start and two runs fewer than a test
    per point):

    - elastic, preempted: scaling.min_workers=1 of 2 workers of 2 CPUs, so one on the head (3
      CPUs) and one on the second node, which sees none of the head's files (the run directory is
      on the S3 server; the digits travel in the object store). Checkpoints only at the end,
      run.max_failures=0. The second node is drained as a preemption with a deadline once the run
      trains, then stopped after the deadline. The notice is a checkpoint at once, at the step it
      came; the console says so in one line; Ray restarts the group (outside run.max_failures)
      with the one worker the head holds, which resumes from that checkpoint, takes two
      micro-batches per update (the same global batch), trains again only the steps after it, and
      ends close to a fixed-size run;
    - fixed: the recipe as a file in the job's uploaded working directory, both workers on the
      head (1 CPU each, STRICT_PACK), a checkpoint at the notice's step; the job's progress lines
      are followed and its results printed. At that step its weights equal, bit for bit, those
      the elastic run saved on two nodes: which rows a rank gets does not depend on where Ray
      placed it (Parquet shards without node locality, in order)."""
    steps = 140  # the first attempt must still be training when the node's deadline passes
    # Each worker on one thread: the two placements differ in CPUs per worker, not in arithmetic.
    common = [
        f"loop.max_steps={steps}",
        f"eval.every_steps={steps}",
        "checkpoint.keep=20",
        "scaling.threads_per_worker=1",
        "logging.every_steps=4",
        TASK,
    ]
    run_dir, seen = _preempted_run(cluster, tmp_path, [*common, f"checkpoint.every_steps={10 * steps}"])
    output = seen["output"]
    [notice] = [line for line in output.splitlines() if "preempted: node" in line]
    saved = int(re.search(r"checkpoint at step (\d+)", notice).group(1))
    assert "deadline" in notice and "node " in notice, notice
    assert "no retries left" not in output and "failed" not in notice, output[-4000:]
    two_nodes = run_dir / f"checkpoint_{saved:08d}"
    assert len(_node_ids(two_nodes)) == 2
    counted = {s["step"]: s for s in _steps(run_dir)}  # the last record of each step is the one that counted
    # The step saved came after the drain and before the deadline: the notice was not wasted.
    assert seen["drained"] < counted[saved]["time"] < seen["deadline"] - 3, (seen, counted[saved])
    assert f"resumed at step {saved} from " in output, output[-4000:]
    progress = seen["progress"]
    restart = next(i for i in range(1, len(progress)) if progress[i] < progress[i - 1])
    first_attempt_end, resumed_at = progress[restart - 1], progress[restart]
    assert saved < resumed_at <= saved + 4  # no step up to the notice trained again
    assert first_attempt_end < steps  # the first attempt was still training at the deadline
    print(
        f"preemption: notice and checkpoint at step {saved}, first attempt trained to about step "
        f"{first_attempt_end}, {first_attempt_end - saved} steps trained again"
    )

    # examples/job/ as its working directory: its recipe (the default recipe's settings, with a
    # bucket's paths and elastic scaling, overridden here) uploaded with the job.
    workdir = Path(shutil.copytree(ROOT / "examples" / "job", tmp_path / "job"))
    fixed_args = [*common, f"checkpoint.every_steps={saved}", "scaling.cpus_per_worker=1", "scaling.min_workers=0"]
    fixed_args += ["scaling.placement_strategy=STRICT_PACK", "run.name=fixed"]
    out = _submit(
        cluster, tmp_path / "fixed", *fixed_args, "--working-dir", str(workdir), recipe=str(workdir / "recipe.yaml")
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert ": python -m raytrain_loops.cli train recipe.yaml " in out.stdout  # relative to the working dir
    assert f"step 4/{steps}" in out.stdout  # the job's progress lines were followed
    assert "SUCCEEDED; results in " in out.stdout
    fixed_dir = Path(out.stdout.rsplit("results in ", 1)[1].strip())
    summary = json.loads((fixed_dir / "summary.json").read_text())
    assert summary["metrics"]["step"] == steps and "eval_accuracy" in summary["metrics"]

    one_node = fixed_dir / f"checkpoint_{saved:08d}"
    assert len(_node_ids(one_node)) == 1
    a, b = (ckpt.read_file(str(c), ckpt.STATE)["model"] for c in (two_nodes, one_node))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    records = _steps(run_dir)
    assert records[0]["workers"] == 2 and records[-1]["workers"] == 1 and records[-1]["step"] == steps
    # The global batch stayed 64 samples per update on one worker (2 micro-batches of 32).
    assert {s["sample_size"] for s in records} == {64.0}
    assert sorted(counted) == list(range(1, steps + 1))
    assert all(counted[i]["workers"] == (2 if i <= saved else 1) for i in counted)
    reference = {s["step"]: s["loss"] for s in _steps(fixed_dir)}
    late = range(steps - 19, steps + 1)
    elastic_loss = sum(counted[i]["loss"] for i in late) / len(late)
    fixed_loss = sum(reference[i] for i in late) / len(late)
    assert abs(elastic_loss - fixed_loss) < 0.25 * fixed_loss, (elastic_loss, fixed_loss)
