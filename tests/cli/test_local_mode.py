"""Local mode (``scaling.num_workers=0``, ``train --local``): the loop in the calling process,
without Ray. The run directory a Ray run fills, the task's own errors with their own frames,
refusals of what needs Ray, and a user's task resumed mid-epoch. Where a local run continues on
Ray and the other way round: ``checkpoint/test_continue_local_and_ray.py``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from raytrain_loops import fit
from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.engine.update import precision
from raytrain_loops.tasks import DigitsTask
from tests.support.runfiles import records

ROOT = Path(__file__).resolve().parents[2]

# The CLI in a fresh interpreter; what it printed, then the Ray modules it imported.
CLI = """
import sys
from raytrain_loops.cli import main
code = main(sys.argv[1:])
print("RAY_MODULES", sorted(m for m in sys.modules if m == "ray" or m.startswith("ray.")))
sys.exit(code)
"""


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )


def test_train_local_fills_the_run_directory_keeps_the_newest_and_best_checkpoints_without_importing_ray(
    tmp_path, capsys
):
    out = _cli(
        "train",
        "default",
        "--local",
        "loop.epochs=3",
        "checkpoint.score_metric=eval_accuracy",
        "checkpoint.score_mode=max",
        f"data.dir={tmp_path / 'data'}",
        f"run.storage_path={tmp_path / 'runs'}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RAY_MODULES []" in out.stdout
    (run,) = (tmp_path / "runs").iterdir()
    # One worker: 1347 rows / 32 = 42 steps an epoch, checkpointed and evaluated at each epoch's end.
    steps = [r["step"] for r in records(run / "metrics.jsonl")]
    assert steps == list(range(1, 127))
    evals = records(run / "eval.jsonl")
    assert [e["step"] for e in evals] == [42, 84, 126]
    assert sorted(p.name for p in run.glob("checkpoint_*")) == ["checkpoint_00000084", "checkpoint_00000126"]
    best = json.loads((run / "best" / "best.json").read_text())
    by_score = sorted(evals, key=lambda e: (-e["eval_accuracy"], -e["step"]))[:2]
    assert [b["step"] for b in best] == [e["step"] for e in by_score]
    assert all((run / "best" / b["checkpoint"] / "manifest.rank0.json").exists() for b in best)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["metrics"]["step"] == 126 and summary["checkpoint"].endswith("checkpoint_00000126")
    assert summary["metrics"]["eval_accuracy"] == evals[-1]["eval_accuracy"] > 0.9
    assert (run / "curves.png").stat().st_size > 0 and list((run / "tb").iterdir())
    # The console shows what a Ray run's shows: progress lines, evaluations, checkpoints.
    assert "step 20/126" in out.stdout and "eval at step 126:" in out.stdout
    assert f"checkpoint at step 126: {run / 'checkpoint_00000126'}" in out.stdout
    assert f"run directory: {run}" in out.stdout

    # ``evaluate --local`` of checkpoint 84 (one worker) gives the run's evaluation at step 84.
    result = tmp_path / "eval84.json"
    out = _cli("evaluate", str(run / "checkpoint_00000084"), "--local", "--out", str(result))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RAY_MODULES []" in out.stdout and f"checkpoint {run / 'checkpoint_00000084'} (step 84): " in out.stdout
    again = json.loads(result.read_text())
    at_84 = next(e for e in evals if e["step"] == 84)
    names = {k for k in at_84 if k.startswith("eval_")}
    assert {"eval_loss", "eval_accuracy", "eval_ema_loss", "eval_ema_accuracy"} <= names
    assert {k: again[k] for k in names} == {k: at_84[k] for k in names} and again["step"] == 84
    _export_takes_a_run_directory_its_best_and_the_ema(run, best[0]["checkpoint"], capsys)


def _export_takes_a_run_directory_its_best_and_the_ema(run: Path, best: str, capsys) -> None:
    """``export RUN_DIR``: the newest intact checkpoint (a damaged newer one passed over, named);
    ``--checkpoint best``: best/'s first; ``--ema``: the EMA's weights as ``model``."""
    from raytrain_loops.checkpoint import files as ckpt
    from raytrain_loops.cli import main

    def exported(*args: str) -> tuple[dict, str]:
        out = run.parent / "exported.pt"
        assert main(["export", *args, str(out)]) == 0
        return torch.load(out, weights_only=True), capsys.readouterr().out

    newest = ckpt.read_file(run / "checkpoint_00000126", ckpt.STATE)
    state, said = exported(str(run))
    assert f"exporting {run / 'checkpoint_00000126'} (the run's newest intact checkpoint)" in said
    assert all(torch.equal(state["model"][k], newest["model"][k]) for k in newest["model"])
    state, said = exported(str(run), "--checkpoint", "best")
    assert f"exporting {run / 'best' / best} (the run's best by its score metric)" in said
    assert state["counters"]["step"] == ckpt.step_of(best)
    state, said = exported(str(run / "checkpoint_00000126"), "--ema")
    assert "the EMA's weights as model" in said and all(
        torch.equal(state["model"][k], newest["ema"][k]) for k in newest["ema"]
    )
    torn = run / "checkpoint_00000126" / ckpt.STATE
    torn.write_bytes(torn.read_bytes()[:100])
    state, said = exported(str(run))
    assert (
        f"exporting {run / 'checkpoint_00000084'} (the run's newest intact checkpoint; passed over: checkpoint_00000126"
        in said
    )


class BrokenCriterion(DigitsTask):
    """Digits whose criterion fails as a shape error in a user's task would."""

    def criterion(self, model, batch, ctx):
        x, y = batch
        raise ValueError(f"logits and targets disagree: {tuple(x.shape)} vs {tuple(y.shape)}")


def test_an_error_in_the_criterion_is_raised_here_with_the_criterions_frame_on_top(tmp_path):
    config = {"task": {"name": "digits"}, "scaling": {"num_workers": 0}, "run": {"storage_path": str(tmp_path)}}
    with pytest.raises(ValueError, match="logits and targets disagree") as raised:
        fit(config, task=BrokenCriterion())
    top = raised.traceback[-1]
    assert top.name == "criterion" and Path(top.path) == Path(__file__)

    out = _cli(
        "train", "default", "--local", "task.name=tests.cli.test_local_mode:BrokenCriterion", f"run.storage_path={tmp_path}"
    )
    assert out.returncode == 1
    trace = out.stderr.strip().splitlines()
    assert trace[-1].startswith("raytrain-loops: train failed: ValueError: logits and targets disagree")
    frames = [line for line in trace if line.lstrip().startswith('File "')]
    assert 'cli/test_local_mode.py", line' in frames[-1] and frames[-1].endswith("in criterion")  # the task's frame, last


class BareLoss(DigitsTask):
    """Digits whose criterion returns the loss tensor itself."""

    def criterion(self, model, batch, ctx):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)


class BareMetrics(DigitsTask):
    """Digits whose evaluation returns a metric without its count."""

    def evaluate(self, model, batch):
        x, y = batch
        return {"accuracy": (model(x).argmax(1) == y).float().mean()}


def test_a_criterion_or_evaluation_returning_the_wrong_thing_is_named_at_its_first_call(tmp_path):
    config = {
        "task": {"name": "digits"},
        "scaling": {"num_workers": 0},
        "loop": {"max_steps": 2},
        "eval": {"every_steps": 1},
        "run": {"storage_path": str(tmp_path)},
    }
    line = BareLoss.criterion.__code__.co_firstlineno
    with pytest.raises(TypeError) as raised, warnings.catch_warnings():
        warnings.simplefilter("error")  # the FLOP count before the first step raises it, not a warning
        fit(config, task=BareLoss())
    assert str(raised.value) == (
        f"BareLoss.criterion ({__file__}:{line}) returned a Tensor of shape () (float32); "
        "a criterion must return raytrain_loops.LossOutput(loss=..., sample_size=...), e.g. LossOutput(loss=loss, "
        "sample_size=len(targets)) (loss: the micro-batch's mean under loss.reduction=mean, its sum under sum; "
        "sample_size: the samples or tokens it covers)"
    )
    line = BareMetrics.evaluate.__code__.co_firstlineno
    with pytest.raises(TypeError) as raised:
        fit(config, task=BareMetrics())
    assert re.fullmatch(
        rf"BareMetrics\.evaluate \({re.escape(__file__)}:{line}\) returned a dict \(\{{'accuracy': tensor\(0\.\d+\)\}}\), "
        r"whose 'accuracy' is a Tensor of shape \(\) \(float32\), not a \(value, count\) pair; evaluate must return a "
        r"mapping of metric name to \(value, count\), e.g\. \{'accuracy': \(correct / n, n\)\}",
        str(raised.value),
    ), str(raised.value)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["scaling.num_workers=0", "scaling.min_workers=1"], "scaling.min_workers"),
        (["scaling.num_workers=0", "run.max_failures=2"], "run.max_failures"),
        (["scaling.num_workers=0", "fault.plan=[{step: 3, kind: kill}]"], "fault.plan[0]"),
        (["scaling.num_workers=0", "fault.plan=[{step: 3, rank: 1}]"], "fault.plan[0]"),
    ],
)
def test_what_needs_ray_is_refused_in_local_mode_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match="^" + re.escape(key) + ": .*local mode"):
        load_config(None, overrides)


def test_a_sweep_of_local_trials_and_a_submitted_local_run_are_refused_before_anything_starts(tmp_path):
    from raytrain_loops.config.sweep import load_sweep
    from raytrain_loops.jobs.submit import entrypoint

    sweep = {"space": {"optim.lr": {"choice": [1e-3]}}, "trial": {"num_workers": 0}}
    with pytest.raises(ConfigError, match=r"^trial\.num_workers: .*local mode"):
        load_sweep(sweep, load_config(None))
    with pytest.raises(ConfigError, match=r"^scaling\.num_workers: .*local mode"):
        entrypoint("default", ["scaling.num_workers=0"], None)
    out = _cli("submit", "default", "--local")
    assert out.returncode == 2 and "unrecognized arguments: --local" in out.stderr


def test_a_users_own_task_trains_locally_and_its_run_name_continues_mid_epoch(tmp_path):
    from examples.custom_task import CONFIG, SpiralTask

    # One worker: 32 steps per epoch (2048 rows / 64 per batch); the first run stops at step 48,
    # half-way through epoch 1, and the same run name carries it on to the end of 6 epochs.
    # precision.dtype=auto resolves on this CPU at the first start and is recorded; the rerun
    # keeps the recorded dtype, even where this CPU would resolve to another one.
    threads, draw = torch.get_num_threads(), torch.random.get_rng_state()
    base = {
        **CONFIG,
        "loop": {"max_steps": 48, "epochs": 6},
        "precision": {"dtype": "auto"},
        "checkpoint": {"every_steps": 16},
        "scaling": {"num_workers": 0},
        "run": {"name": "resume-me", "storage_path": str(tmp_path), "progress": False},
    }
    first = fit(base, task=SpiralTask())
    # The run's thread count and random generators are its own: the caller's come back unchanged.
    assert torch.get_num_threads() == threads and torch.equal(torch.random.get_rng_state(), draw)
    assert first.metrics["step"] == 48 and first.checkpoint.endswith("checkpoint_00000048")
    state = torch.load(Path(first.checkpoint) / "rank0.pt", weights_only=True)
    deal = {"world": 1, "recuts": []}  # epoch 1 as dealt for one worker: 16 batches of 64 rows
    assert state["data"] == {"epoch": 1, "batches": 16, "rows": 1024, "deal": deal} and state["world_size"] == 1
    here = precision.resolve("auto", precision.hardware(torch.device("cpu")))[0]
    record_file = Path(first.run_dir) / "precision.json"
    record = json.loads(record_file.read_text())
    assert (record["requested"], record["dtype"]) == ("auto", here)
    assert json.loads((Path(first.run_dir) / "summary.json").read_text())["precision"] == here
    assert "precision:\n  dtype: auto\n" in (Path(first.run_dir) / "config.yaml").read_text()  # the config keeps auto
    other = "bf16" if here != "bf16" else "fp32"  # as if the first start had been on other hardware
    record_file.write_text(json.dumps({**record, "dtype": other}) + "\n")

    second = fit({**base, "loop": {"max_steps": 0, "epochs": 6}}, task=SpiralTask())
    assert json.loads((Path(second.run_dir) / "summary.json").read_text())["precision"] == other
    assert json.loads(record_file.read_text())["dtype"] == other
    logged = records(Path(second.run_dir) / "metrics.jsonl")
    assert [r["step"] for r in logged] == list(range(1, 6 * 32 + 1))  # 1-48, then 49-192: nothing redone
    assert [r["epoch"] for r in logged][47:50] == [1, 1, 1]  # the second run resumed inside epoch 1
    assert logged[48]["loss"] < 0.8 * logged[0]["loss"]  # with the trained weights, not fresh ones
    evals = records(Path(second.run_dir) / "eval.jsonl")
    assert evals[-1]["step"] == second.metrics["step"] == 6 * 32
    assert second.metrics["eval_accuracy"] > 0.9 > evals[0]["eval_accuracy"], [e["eval_accuracy"] for e in evals]


def test_a_sigterm_stops_a_local_run_naming_its_last_checkpoint(tmp_path):
    import signal
    import time

    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "raytrain_loops.cli", "train", "default", "--local", "loop.epochs=200"]
    proc = subprocess.Popen(
        [*cmd, f"data.dir={tmp_path / 'data'}", f"run.storage_path={runs}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while not list(runs.glob("*/checkpoint_*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "was interrupted (SIGTERM); its last checkpoint:" in err and "resume it with the same command" in err
    assert not list(runs.glob("*/.checkpoint_*.partial"))
