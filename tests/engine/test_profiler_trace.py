"""``logging.profile``: a torch.profiler trace of the steps asked for, from the loop without Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrain_loops.callbacks.profiler import Profile
from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.engine import Engine
from raytrain_loops.engine.length import total_steps
from raytrain_loops.engine.loop import Loop, LoopSettings
from tests.support import fakes
from tests.support.fakes import RecordingReporter
from tests.support.loops import FakeSource, evaluate_mse


def _run(run_dir: Path, *overrides: str, state=None) -> tuple[Profile, Engine]:
    cfg = fakes.config("schedules.lr.value=0.05", "loop.max_steps=6", "logging.profile.enabled=true", *overrides)
    source = FakeSource(7)
    engine = Engine(fakes.make_model(), fakes.mean_loss, cfg.engine, total_steps=total_steps(cfg.loop, cfg.accum, 7))
    if state is not None:
        engine.load_state_dict(state)
    profile = Profile(cfg.logging.profile, str(run_dir), 0, engine.device)
    reporter = RecordingReporter(engine)
    Loop(engine, source, reporter, LoopSettings.of(cfg), evaluate_mse, [profile]).run()
    return profile, reporter


def _steps_in(trace: Path) -> list[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})


def test_the_profile_writes_a_trace_of_the_steps_asked_for(tmp_path):
    profile, _ = _run(tmp_path, "logging.profile.start_step=2", "logging.profile.steps=3")
    trace = tmp_path / "profile" / "rank0.5.pt.trace.json"  # recorded steps 3, 4 and 5
    assert profile.traces == [str(trace)] and sorted(p.name for p in (tmp_path / "profile").iterdir()) == [trace.name]
    assert _steps_in(trace) == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]  # calls 0 and 1 not
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "aten::addmm" for e in events)  # the model's own operators
    assert any(e.get("name", "").startswith("Optimizer.step") for e in events)


def test_a_run_that_ends_inside_the_window_writes_what_it_recorded_and_a_resumed_run_past_it_none(tmp_path):
    profile, reporter = _run(tmp_path / "a", "logging.profile.start_step=4", "logging.profile.steps=10")
    # Calls 4 and 5, then what ran after the last step (#6: the final evaluation and checkpoint).
    trace = tmp_path / "a" / "profile" / "rank0.6.pt.trace.json"
    assert _steps_in(trace) == ["ProfilerStep#4", "ProfilerStep#5", "ProfilerStep#6"]
    saved = reporter.saved[6][0]
    profile, _ = _run(tmp_path / "b", "loop.max_steps=8", "logging.profile.start_step=2", state=saved)
    assert profile.traces == [] and not (tmp_path / "b" / "profile").exists()


def test_bad_profile_settings_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^logging\.profile\.steps: must be >= 1; got 0"):
        load_config(None, ["logging.profile.steps=0"])
    with pytest.raises(ConfigError, match=r"^logging\.profile\.start_step: must be >= 0; got -1"):
        load_config(None, ["logging.profile.start_step=-1"])
