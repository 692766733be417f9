"""The driver's hold on a run directory, all before Ray starts: a rerun with another config, two
drivers at once, and a rerun of a finished run. ``fit`` runs for real up to the point where it
would start Ray, which the tests replace with a stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from examples.custom_task import CONFIG, SpiralTask
from raytrain_loops import ConfigError, fit
from raytrain_loops.checkpoint import files as ckpt
from raytrain_loops.config import load_config
from raytrain_loops.driver import fit as fit_module
from raytrain_loops.driver.run_checks import RunLock, RunLocked
from tests.support.run_dirs import RayWouldStart, spiral_config, started_run


@pytest.fixture
def no_ray(monkeypatch):
    def stop(*args, **kwargs):
        raise RayWouldStart

    monkeypatch.setattr(fit_module, "ensure_ray", stop)


def test_a_rerun_that_changes_the_trained_state_is_refused_naming_every_key(tmp_path, no_ray):
    run = started_run(tmp_path, spiral_config(tmp_path))
    changed = spiral_config(tmp_path, optim={"name": "sgd"}, data={"batch_size": 32}, loop={"max_steps": 12})
    with pytest.raises(ConfigError) as info:
        fit(changed, task=SpiralTask())
    message = str(info.value)
    assert info.value.key == "data.batch_size"
    assert "Changed: data.batch_size (64 -> 32), optim.name ('adamw' -> 'sgd')" in message
    assert "run.allow_config_change=true" in message and "loop.max_steps" not in message
    assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["name"] == "adamw"  # untouched

    allowed = spiral_config(tmp_path, optim={"name": "sgd"}, run={**changed["run"], "allow_config_change": True})
    with pytest.raises(RayWouldStart):
        fit(allowed, task=SpiralTask())
    record = json.loads((run / "config_changes.jsonl").read_text().splitlines()[-1])
    assert record["changes"]["optim.name"] == {"old": "adamw", "new": "sgd"}
    assert record["allowed_by_run.allow_config_change"] is True
    assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["name"] == "sgd"


def test_a_rerun_may_change_scaling_logging_run_and_length_and_says_so(tmp_path, no_ray, capsys):
    run = started_run(tmp_path, spiral_config(tmp_path))
    longer = spiral_config(tmp_path, loop={"epochs": 3}, scaling={"num_workers": 1}, logging={"every_steps": 7})
    with pytest.raises(RayWouldStart):
        fit(longer, task=SpiralTask())
    assert (
        "with a changed config: logging.every_steps (10 -> 7), loop.epochs (1 -> 3), scaling.num_workers (2 -> 1)"
        in capsys.readouterr().out
    )
    record = json.loads((run / "config_changes.jsonl").read_text())
    assert set(record["changes"]) == {"logging.every_steps", "loop.epochs", "scaling.num_workers"}
    assert record["allowed_by_run.allow_config_change"] is False
    with pytest.raises(RayWouldStart):  # the same command again: nothing changed, nothing recorded
        fit(longer, task=SpiralTask())
    assert len((run / "config_changes.jsonl").read_text().splitlines()) == 1


def test_a_hashed_run_name_ignores_allow_config_change_and_scaling_and_keeps_the_length():
    from raytrain_loops.driver.preflight import run_name

    base = load_config(CONFIG)
    same = load_config(CONFIG, ["run.allow_config_change=true", "run.progress=false", "run.max_preemptions=3"])
    local = load_config(CONFIG, ["scaling.num_workers=0"])
    wider = load_config(CONFIG, ["scaling.num_workers=8", "scaling.strategy=fsdp"])
    longer = load_config(CONFIG, ["loop.epochs=31"])
    names = {run_name(c, SpiralTask()) for c in (base, same, local, wider)}
    assert len(names) == 1 and run_name(longer, SpiralTask()) not in names


def test_a_second_driver_on_the_same_run_directory_is_refused(tmp_path, no_ray):
    config = spiral_config(tmp_path)
    with RunLock(str(tmp_path / "r")):
        holder = json.loads((tmp_path / "r" / "driver.lock").read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(RunLocked, match=rf"in use by the driver with pid {os.getpid()} on {socket.gethostname()}"):
            fit(config, task=SpiralTask())
    assert not (tmp_path / "r" / "driver.lock").exists()  # released
    with pytest.raises(RayWouldStart):  # free again; and released when fit fails, too
        fit(config, task=SpiralTask())
    assert not (tmp_path / "r" / "driver.lock").exists()


def test_a_lock_whose_driver_is_gone_or_silent_is_taken_over(tmp_path, capsys):
    run = str(tmp_path / "r")
    # A driver killed with SIGKILL while it held the lock.
    code = f"from raytrain_loops.driver.run_checks import RunLock; RunLock({run!r}).acquire(); print('held', flush=True); import time; time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    with pytest.raises(RunLocked):
        RunLock(run).acquire()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    lock = RunLock(run).acquire()
    assert f"its driver (pid {proc.pid}) is gone" in capsys.readouterr().out
    lock.release()

    # A driver on another host: alive while its heartbeat is fresh, stale after the limit.
    path = tmp_path / "r" / "driver.lock"
    path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "time": time.time(), "token": "x"}))
    with pytest.raises(RunLocked, match="on elsewhere"):
        RunLock(run, stale_after_s=5).acquire()
    path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "time": time.time() - 10, "token": "x"}))
    RunLock(run, stale_after_s=5).acquire().release()
    assert "its heartbeat is 10s old (pid 1 on elsewhere)" in capsys.readouterr().out


def test_a_lock_left_by_an_earlier_process_with_the_same_pid_is_taken_over(tmp_path, capsys):
    # A container restarted in place: same host name, and the driver is pid 1 again.
    run = str(tmp_path / "r")
    path = tmp_path / "r" / "driver.lock"
    path.parent.mkdir()
    body = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "token": "earlier"}
    path.write_text(json.dumps(body))
    lock = RunLock(run).acquire()
    assert f"left by an earlier process with this pid ({os.getpid()})" in capsys.readouterr().out
    with pytest.raises(RunLocked):  # but a lock this process holds is not taken over by it
        RunLock(run).acquire()
    lock.release()


@pytest.mark.deadline
def test_a_held_lock_keeps_its_heartbeat(tmp_path):
    lock = RunLock(str(tmp_path), heartbeat_s=0.05).acquire()
    first = json.loads((tmp_path / "driver.lock").read_text())["time"]
    time.sleep(0.5)
    assert json.loads((tmp_path / "driver.lock").read_text())["time"] > first
    lock.release()
    assert not (tmp_path / "driver.lock").exists()


def test_rerunning_a_finished_run_trains_nothing_and_returns_its_summary(tmp_path, no_ray, capsys):
    config = spiral_config(tmp_path)
    final = 16  # 2048 rows / 2 workers / 64 per batch, one epoch
    run = started_run(tmp_path, config, steps=(8, final))
    summary = {"run_dir": str(run), "wall_time_s": 12.5, "checkpoint": str(run / "checkpoint_00000016")}
    summary["metrics"] = {"step": final, "done": 1.0, "eval_accuracy": 0.75}
    (run / "summary.json").write_text(json.dumps(summary))
    before = sorted(p.name for p in run.iterdir())

    result = fit(config, task=SpiralTask())
    assert result.metrics == summary["metrics"] and result.checkpoint == summary["checkpoint"]
    out = capsys.readouterr().out
    assert result.wall_time == 12.5 and f"already finished at step 16: eval_accuracy=0.75 (every metric: {run}/summary.json)" in out
    assert "done=" not in out and "To train anew, give it another run.name; to train it further, raise loop.max_steps" in out
    assert sorted(p.name for p in run.iterdir()) == before  # nothing written
    # The same run at another scale (local mode plans 32 steps for the epoch) is finished too.
    local = fit(spiral_config(tmp_path, scaling={"num_workers": 0}), task=SpiralTask())
    assert local.metrics == summary["metrics"] and sorted(p.name for p in run.iterdir()) == before

    with pytest.raises(RayWouldStart):  # a longer run of it trains on, and is not finished until it ends
        fit(spiral_config(tmp_path, loop={"epochs": 2}), task=SpiralTask())
    assert not (run / "summary.json").exists()
    (run / "summary.json").write_text(json.dumps(summary))
    state = run / "checkpoint_00000016" / ckpt.STATE
    state.write_bytes(state.read_bytes()[:10])
    with pytest.raises(RayWouldStart):  # so does one whose final checkpoint is damaged
        fit(config, task=SpiralTask())


def _finished_run(tmp_path: Path, config: dict, final: int = 16) -> Path:
    """A run directory as a run of ``config`` that finished at step ``final`` left it."""
    run = started_run(tmp_path, config, steps=(8, final))
    summary = {"run_dir": str(run), "wall_time_s": 1.0, "checkpoint": str(run / f"checkpoint_{final:08d}")}
    summary["metrics"] = {"step": final, "done": 1.0}
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_a_finished_run_made_longer_then_interrupted_trains_on_when_rerun_at_another_scale(tmp_path, no_ray, capsys):
    config = spiral_config(tmp_path)
    run = _finished_run(tmp_path, config)
    longer = spiral_config(tmp_path, loop={"epochs": 3})
    with pytest.raises(RayWouldStart):  # the longer run, interrupted before its first new checkpoint
        fit(longer, task=SpiralTask())
    assert yaml.safe_load((run / "config.yaml").read_text())["loop"]["epochs"] == 3
    capsys.readouterr()
    # Rerun with only its scale changed: its config says 3 epochs, and the run has trained one.
    with pytest.raises(RayWouldStart):
        fit(spiral_config(tmp_path, loop={"epochs": 3}, scaling={"num_workers": 1}), task=SpiralTask())
    assert "already finished" not in capsys.readouterr().out


def test_a_file_uri_storage_path_is_the_local_directory_it_names(tmp_path, no_ray, monkeypatch):
    from raytrain_loops import storage

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    config = spiral_config(tmp_path, run={"storage_path": f"file://{tmp_path}/store"})
    with pytest.raises(RayWouldStart):
        fit(config, task=SpiralTask())
    assert (tmp_path / "store" / "r" / "config.yaml").exists() and not list(cwd.iterdir())
    assert storage.join("file://localhost/a/b", "c") == "/a/b/c" and storage.join("file:///a%20b") == "/a b"
    elsewhere = spiral_config(tmp_path, run={"storage_path": "file://host/a"})
    with pytest.raises(ConfigError, match="run.storage_path: .*file://host/a.* not on host 'host'"):
        fit(elsewhere, task=SpiralTask())  # another host's file system is not this one's


def test_a_hashed_run_name_leaves_out_retries_and_defaults_so_a_new_key_renames_nothing():
    from dataclasses import dataclass, fields

    from raytrain_loops.config.base import opt
    from raytrain_loops.config.run import LoopConfig
    from raytrain_loops.driver.preflight import run_name

    base = load_config(CONFIG)
    name = run_name(base, SpiralTask())
    local = load_config(CONFIG, ["scaling.num_workers=0"])  # local mode requires run.max_failures=0
    retries = load_config(CONFIG, ["run.max_failures=3", "run.max_preemptions=2"])
    assert run_name(local, SpiralTask()) == run_name(retries, SpiralTask()) == name  # one directory
    # The value a key takes by default is not hashed: written out or left to its default, one name.
    assert run_name(load_config(CONFIG, [f"optim.name={base.optim.name}"]), SpiralTask()) == name
    assert run_name(load_config(CONFIG, ["loop.seed=1"]), SpiralTask()) != name

    @dataclass(kw_only=True, slots=True)
    class LoopWithANewKey(LoopConfig):  # a release that adds loop.new_key, default 7
        new_key: int = opt(7, "A key added later.")

    def with_new_key(config, value):
        config.loop = LoopWithANewKey(**{f.name: getattr(config.loop, f.name) for f in fields(LoopConfig)})
        config.loop.new_key = value
        return config

    assert run_name(with_new_key(load_config(CONFIG), 7), SpiralTask()) == name  # renames nothing
    assert run_name(with_new_key(load_config(CONFIG), 8), SpiralTask()) != name  # set, it is hashed
    assert run_name(load_config(CONFIG, ["run.name=mine", "run.max_failures=3"]), SpiralTask()) == "mine"
