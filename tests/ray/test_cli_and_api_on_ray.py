"""The Ray layer: the CLI end to end, the Python API with a user's own task, and failures that
must happen before Ray starts."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_loops import ConfigError, ParquetSplit, fit
from raytrain_loops.driver.preflight import DataError
from raytrain_loops.recipes import resolve
from raytrain_loops.tasks import DigitsTask
from tests.support.runfiles import records

CLI = [sys.executable, "-m", "raytrain_loops.cli"]


def _cli(*args: str, timeout: int = 300, cwd: Path | None = None, cli=CLI, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([*cli, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


# The command a user types: the installed script, whose path (unlike python -m's) does not start
# with the current directory.
SCRIPT = [str(Path(sys.executable).parent / "raytrain-loops")]


def _joined(ray_session) -> dict[str, str]:
    """The environment of a command joined to the session's Ray (``RAY_ADDRESS``, as on a
    cluster), not starting a local Ray of its own: that start costs seconds."""
    return {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}


@pytest.mark.ray
def test_cli_trains_the_default_recipe_and_fills_the_run_directory(ray_session, tmp_path):
    """The run, then ``evaluate`` of one of its checkpoints, both joined to the session's Ray. A
    command that starts its own local Ray is the Ctrl-C test's."""
    joined = _joined(ray_session)
    out = _cli(
        "train",
        "default",
        "loop.epochs=3",
        f"run.storage_path={tmp_path}",
        f"data.dir={tmp_path / 'data'}",
        "logging.every_steps=5",
        "checkpoint.keep=2",
        "logging.profile.enabled=true",
        "logging.profile.start_step=5",
        "logging.profile.steps=2",
        # Every epoch's checkpoint, whatever the load: coalescing could skip checkpoint 42 (the one
        # evaluated below) while 21 is still in flight; it is checked in the Ctrl-C test.
        "run.coalesce_reports=false",
        env=joined,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = Path(out.stdout.strip().splitlines()[-1].removeprefix("run directory: "))
    assert run_dir.parent == tmp_path
    console = out.stdout + out.stderr
    assert "step 5/63" in console  # progress lines on the driver
    line = next(x for x in console.splitlines() if "step 25/63" in x)
    for part in ("| epoch 1 | loss ", " acc ", "| lr ", "| data ", "s batch ", "| eta "):
        assert part in line, line  # the criterion's terms, the lr, waiting for data against the step
    assert "epoch 2 ended at step 63, averages over the epoch (train_*): loss " in console
    _assert_a_clean_console(console, run_dir)
    assert "Connected to Ray cluster." in (run_dir / "ray.log").read_text()  # ray.init's lines, joining

    steps = records(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps if s["applied"]] == list(range(1, 64))  # 3 epochs x 21 steps
    evals = records(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [21, 42, 63]
    accuracy = [e["eval_accuracy"] for e in evals]
    assert accuracy[-1] > accuracy[0] and accuracy[-1] >= 0.8, accuracy
    assert "eval_ema_accuracy" in evals[-1]

    epochs = records(run_dir / "epochs.jsonl")
    assert [(e["epoch"], e["step"]) for e in epochs] == [(0, 21), (1, 42), (2, 63)]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"] and 0 < epochs[-1]["train_acc"] <= 1

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["metrics"]["eval_accuracy"] == accuracy[-1] and summary["metrics"]["step"] == 63
    assert summary["metrics"]["train_loss"] == epochs[-1]["train_loss"]  # the last epoch's averages
    assert summary["checkpoint"].endswith("checkpoint_00000063")
    # Throughput and memory of both workers, through the interval's all-reduce (steps 61-63).
    m = summary["metrics"]
    assert m["samples_per_s"] == pytest.approx(m["samples_per_s/rank0"] + m["samples_per_s/rank1"])
    assert m["flops_per_sample"] > 0 and m["gflops_per_s"] > 0 and m["cpu_peak_rss_gib"] > 0.1
    for rank in (0, 1):  # a trace per worker of steps 6 and 7
        trace = json.loads((run_dir / "profile" / f"rank{rank}.7.pt.trace.json").read_text())
        assert {"ProfilerStep#5", "ProfilerStep#6"} <= {e.get("name") for e in trace["traceEvents"]}
    checkpoints = sorted(p.name for p in run_dir.glob("checkpoint_0*"))
    assert checkpoints == ["checkpoint_00000042", "checkpoint_00000063"]  # checkpoint.keep=2
    assert {p.name for p in (run_dir / "checkpoint_00000063").iterdir()} >= {
        "state.pt",
        "rank0.pt",
        "rank1.pt",
        "manifest.rank0.json",
        "manifest.rank1.json",
    }
    assert "loop:\n  max_steps: 0\n  epochs: 3" in (run_dir / "config.yaml").read_text()
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # ``evaluate`` of checkpoint 42 on 2 Ray workers, as a group resumed there would: the run's
    # evaluation at step 42, figure for figure (every worker evaluated with rank 0's BatchNorm
    # statistics, which the checkpoint holds).
    out = _cli("evaluate", str(run_dir / "checkpoint_00000042"), "--out", str(tmp_path / "eval42.json"), env=joined)
    assert out.returncode == 0, out.stderr[-3000:]
    again = json.loads((tmp_path / "eval42.json").read_text())
    names = {k for k in evals[1] if k.startswith("eval_")}
    assert {"eval_loss", "eval_accuracy", "eval_ema_loss", "eval_ema_accuracy"} <= names
    assert {k: again[k] for k in names} == {k: evals[1][k] for k in names} and again["step"] == 42


def _assert_a_clean_console(console: str, run_dir: Path) -> None:
    """The console holds this project's lines; Ray's output (every report, the controller's lines,
    deprecation warnings) went to ray.log: alike on a local Ray and joined to a
    cluster."""
    for ray_only in (
        "TrainingReport(",
        "RayDeprecationWarning",
        "PreemptionWatcher",
        "(RayTrainWorker",
        "(TrainController",
    ):
        assert ray_only not in console, console[-3000:]
    lines = console.splitlines()
    assert [line for line in lines if line.startswith("eval at step ")][0].startswith("eval at step 21: eval_accuracy")
    assert "checkpoint at step 21: " in console
    ours = ("run directory: ", "step ", "epoch ", "eval at step ", "checkpoint at step ", "finished in ")
    assert [line for line in lines if not line.startswith(ours)] == []
    ray_log = (run_dir / "ray.log").read_text()
    assert "TrainingReport(" in ray_log and "(TrainController pid=" in ray_log


@pytest.mark.ray
def test_a_failing_run_names_each_failure_and_the_error_on_a_clean_console(ray_session, tmp_path):
    """Joined to the session's Ray (a local Ray's start is the Ctrl-C test's)."""
    out = _cli(
        "train",
        "default",
        "loop.max_steps=6",
        "run.max_failures=1",
        "fault.plan=[{step: 2, rank: 1, kind: kill}, {step: 4, kind: raise}]",
        f"run.storage_path={tmp_path}",
        f"data.dir={tmp_path / 'data'}",
        env=_joined(ray_session),
    )
    console = out.stdout + out.stderr
    assert out.returncode == 1, console[-3000:]
    # The killed worker: one short line (which worker, its node, how, what next), not Ray's text.
    (death,) = [line for line in console.splitlines() if line.startswith("worker 1 ")]
    assert re.fullmatch(
        r"worker 1 on node [\d.]+ \([0-9a-f]{8}\) was killed or crashed \(its process ended at once: a signal such "
        r"as SIGKILL or SIGSEGV\); restarting from the newest checkpoint \(retry 1 of 1\)",
        death,
    ), death
    for raw in ("A worker died or was killed", "Worker exit type", "WorkerHealthCheckFailedError", "ActorDiedError"):
        assert raw not in console, console[-3000:]
    assert "worker 0 failed: " in console and "fault.plan[1] after step 4; no retries left" in console
    assert "Traceback (most recent call last)" in out.stderr and 'faults.py", line' in out.stderr  # the worker's
    assert (
        "raytrain-loops: train failed: " in out.stderr and "fault.plan[1] after step 4" in out.stderr.splitlines()[-1]
    )
    assert "TrainingReport(" not in console and "(TrainController" not in console
    (run_dir,) = [p for p in tmp_path.iterdir() if p.name != "data"]
    ray_log = (run_dir / "ray.log").read_text()
    assert "fault.plan[1]" in ray_log
    assert "Connected to Ray cluster" in ray_log and "Connected to Ray cluster" not in console  # ray.init's own lines
    # Ray's whole text of the death after the line: the controller's failed health check with the
    # actor's death cause (the other worker's broken collective, when Ray reports it, may come between).
    after = ray_log[ray_log.index(death) :]
    assert "\nworker 1: WorkerHealthCheckFailedError: A worker health check failed." in after
    assert "Worker exit type: SYSTEM_ERROR" in ray_log


def test_invalid_config_fails_before_ray_starts_naming_the_key():
    start = time.perf_counter()
    out = _cli("train", "default", "precision.dtype=fp8")
    assert out.returncode == 2
    assert "precision.dtype: must be one of 'fp32', 'bf16', 'fp16', 'auto'; got 'fp8'" in out.stderr
    assert "Ray" not in out.stderr + out.stdout and time.perf_counter() - start < 30
    unknown = _cli("train", "default", "optim.lr=0.1")
    assert unknown.returncode == 2 and "optim.lr: unknown key; for optim.lr use schedules.lr.value" in unknown.stderr
    missing = _cli("train", "no_such_recipe")
    assert missing.returncode == 2 and "no_such_recipe: not a built-in recipe (" in missing.stderr
    assert "default" in missing.stderr.split("not a built-in recipe (")[1]
    # Refused before torch or Ray is imported (2-3 s of a process's start here), by each verb that
    # takes a recipe.
    probe = (
        "import sys; from raytrain_loops import cli; "
        "codes = [cli.main([*verb, 'default', 'precision.dtype=fp8']) "
        "for verb in (['train'], ['tune', '--sweep', 'sweep.yaml'], ['plan'])]; "
        "print(codes, sorted({'torch', 'ray'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[2, 2, 2] []", out.stdout + out.stderr[-2000:]


def test_a_storage_path_that_cannot_be_created_is_an_error_naming_the_key_before_ray_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a file where the path needs a directory (refused to root as well)
    out = _cli("train", "default", f"run.storage_path={blocker / 'runs'}", f"data.dir={tmp_path / 'data'}")
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"raytrain-loops: error: run.storage_path: cannot create the run directory {blocker / 'runs'}/" in out.stderr
    assert "Ray" not in out.stdout + out.stderr


def _descendants(pid: int) -> set[int]:
    """The processes under ``pid`` (Linux's /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@pytest.mark.ray
def test_ctrl_c_ends_the_run_naming_its_last_checkpoint_and_the_command_that_resumes_it(tmp_path):
    """The command as a user types it (``raytrain-loops``, run from the directory of the user's
    own task module), on a local Ray of its own: the driver and that Ray's workers import the
    module. Also checkpoints asked for faster than Ray's controller takes reports (every step): a
    periodic one is skipped while the one before is in flight, and the console says so once."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "mytask.py").write_text(
        "from raytrain_loops.tasks import DigitsTask\n\n\nclass MyDigits(DigitsTask):\n    pass\n"
    )
    args = [
        "train",
        "default",
        "task.name=mytask:MyDigits",
        "checkpoint.every_steps=1",
        f"run.storage_path={tmp_path}",
        f"data.dir={tmp_path / 'data'}",
    ]
    proc = subprocess.Popen(
        [*SCRIPT, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=code,
    )
    try:
        deadline = time.monotonic() + 240
        while len(list(tmp_path.glob("*/checkpoint_0*/manifest.rank1.json"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=60)
            time.sleep(0.2)
        ray_processes = _descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends a terminal's foreground process group
        interrupted = time.monotonic()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ended = time.monotonic() - interrupted
    assert proc.returncode == 130 and ended < 60, (proc.returncode, ended, out[-2000:], err[-3000:])
    (run_dir,) = [p for p in tmp_path.iterdir() if p.name not in ("data", "code")]
    assert "mytask:MyDigits" in (run_dir / "config.yaml").read_text()
    assert f"raytrain-loops: the run in {run_dir} was interrupted (SIGINT); its last checkpoint: " in err
    named = Path(err.split("its last checkpoint: ")[1].split()[0])
    assert named.parent == run_dir and (named / "manifest.rank1.json").is_file()
    assert f"resume it with the same command: raytrain-loops {shlex.join(args)}" in err
    assert "Traceback" not in err
    assert "Started a local Ray" in (run_dir / "ray.log").read_text() and "Started a local Ray" not in out + err
    (note,) = [line for line in out.splitlines() if "was still on its way to Ray's controller" in line]
    assert re.fullmatch(
        r"the checkpoint due at step (\d+) was skipped: the one of step (\d+) was still on its way to Ray's "
        r"controller, which takes one report per 0\.5 s\. While one is in flight, a periodic report, evaluation's "
        r"or checkpoint's, is skipped \(the next one due goes out; the final one and a preemption's never are\); "
        r"this is said once \(run\.coalesce_reports=false keeps them all\)",
        note,
    ), note
    deadline = time.monotonic() + 30  # nothing of the run left running
    while ray_processes & {int(p.name) for p in Path("/proc").glob("[0-9]*")}:
        assert time.monotonic() < deadline, "processes of the interrupted run still run"
        time.sleep(0.5)


def test_a_sigterm_while_the_run_trains_is_an_interruption_naming_its_last_complete_checkpoint(tmp_path, monkeypatch):
    import raytrain_loops.driver.fit as fit_module
    from raytrain_loops.driver.fit import RunInterrupted

    def trains_until(signum: int, code: int):
        def train(config, task, splits, rows, name, run_dir, tracking):
            for step, ranks in ((4, (0, 1)), (8, (0, 1)), (12, (0,))):  # 12: rank 1 was still writing
                for rank in ranks:
                    path = Path(run_dir) / f"checkpoint_{step:08d}" / f"manifest.rank{rank}.json"
                    path.parent.mkdir(exist_ok=True)
                    path.write_text(json.dumps({"rank": rank, "world_size": 2, "files": {}}))
            # Ray's driver ends on SIGTERM with sys.exit(SIGTERM); a SystemExit of no signal is no interruption.
            if signum:
                os.kill(os.getpid(), signum)
                time.sleep(10)  # the handler raises here
            raise SystemExit(code)

        return train

    def interrupted_mid_write(config, task, splits, rows, name, run_dir, tracking):
        handler = signal.signal(signal.SIGINT, lambda signum, frame: None)  # the signal seen, then:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
        finally:
            signal.signal(signal.SIGINT, handler)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")  # torch.save's

    def interrupted_mid_write_without_a_signal(config, task, splits, rows, name, run_dir, tracking):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
    try:
        overrides = [f"run.storage_path={tmp_path / 'runs'}", f"data.dir={tmp_path / 'data'}"]
        monkeypatch.setattr(fit_module, "_train", trains_until(signal.SIGTERM, 0))
        with pytest.raises(RunInterrupted) as info:
            fit(resolve("default"), overrides=overrides)
        monkeypatch.setattr(fit_module, "_train", trains_until(0, 3))
        with pytest.raises(SystemExit) as plain:
            fit(resolve("default"), overrides=overrides)
        monkeypatch.setattr(fit_module, "_train", interrupted_mid_write)
        with pytest.raises(RunInterrupted) as mid_write:
            fit(resolve("default"), overrides=overrides)
        monkeypatch.setattr(fit_module, "_train", interrupted_mid_write_without_a_signal)
        with pytest.raises(RuntimeError, match="unexpected pos"):
            fit(resolve("default"), overrides=overrides)
    finally:
        signal.signal(signal.SIGTERM, previous)
    # A Ctrl-C that torch.save, mid-write, turned into its own error is the interruption it is.
    assert mid_write.value.signum == signal.SIGINT and mid_write.value.checkpoint == info.value.checkpoint
    run_dir = Path(info.value.run_dir)
    assert info.value.signum == signal.SIGTERM and Path(info.value.checkpoint) == run_dir / "checkpoint_00000008"
    assert (
        str(info.value)
        == f"the run in {run_dir} was interrupted (SIGTERM); its last checkpoint: {info.value.checkpoint}"
    )
    assert type(plain.value) is SystemExit and plain.value.code == 3
    assert not (run_dir / "driver.lock").exists()


def test_recipes_lists_the_built_ins_each_with_its_whole_first_sentence():
    out = _cli("recipes")
    names = [line.split()[0] for line in out.stdout.splitlines()]
    assert out.returncode == 0 and "default" in names and names == sorted(names)
    described = {line.split()[0]: line.split(None, 1)[1] for line in out.stdout.splitlines()}
    # default's first sentence runs over two comment lines of its recipe
    assert described["default"] == (
        "The default run: a small CNN on scikit-learn's bundled 8x8 digits, read from Parquet by each worker, "
        "on 2 CPU workers with DDP, AdamW on a cosine schedule, and an EMA of the weights."
    )
    assert all(text.endswith(".") for text in described.values()), described


class _PointedDigits(DigitsTask):
    """The digits task reading its training split from a Parquet path given in the test."""

    def __init__(self, path: str, columns: list[str]):
        super().__init__()
        self.path, self.columns = path, columns

    def prepare(self, data_dir):
        pass

    def splits(self, data_dir):
        return {"train": ParquetSplit(self.path, self.columns)}


def test_missing_parquet_file_or_column_is_named_before_ray_starts(tmp_path, monkeypatch):
    import raytrain_loops.driver.fit as fit_module

    def ray_must_not_start(*args, **kwargs):
        raise AssertionError("Ray was started before the data was checked")

    # Other tests may have started the session's Ray already: watch the one call that starts or joins it.
    monkeypatch.setattr(fit_module, "ensure_ray", ray_must_not_start)

    missing = tmp_path / "nope.parquet"
    with pytest.raises(DataError, match=f"split 'train': no such Parquet file or directory: {missing}"):
        fit({"run": {"storage_path": str(tmp_path)}}, task=_PointedDigits(str(missing), ["image", "label"]))
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"image": [[0.0] * 64] * 4, "target": [1, 2, 3, 4]}), table)
    with pytest.raises(DataError, match=r"column 'label' not found in .*t.parquet \(columns there: image, target\)"):
        fit({"run": {"storage_path": str(tmp_path)}}, task=_PointedDigits(str(table), ["image", "label"]))
    with pytest.raises(ConfigError, match="data.batch_size: 64 is more than the 2 training rows per worker"):
        fit({"run": {"storage_path": str(tmp_path)}}, task=_PointedDigits(str(table), ["image", "target"]))


@pytest.mark.ray
def test_the_local_rays_train_controller_polls_its_workers_every_half_second(ray_session):
    """It takes one report per poll: at Ray's 2 s the default recipe ended 22 s after its last
    step, waiting for its reports' backlog. Every process of the local Ray has the setting."""

    @ray_session.remote(num_cpus=0)
    def interval() -> str | None:
        return os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")

    assert ray_session.get(interval.remote()) == "0.5"
