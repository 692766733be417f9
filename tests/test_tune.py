"""The sweep file of Tune sweeps: every key checked against the recipe before Ray starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.config.sweep import load_sweep
from raytrain_loops.recipes import resolve


@pytest.mark.parametrize(
    "sweep,key,fragment",
    [
        ({"space": {"optim.lr": {"choice": [0.1]}}}, "space.optim.lr", "unknown key"),
        (
            {"space": {"schedules.lr.value": {"normal": [0, 1]}}},
            "space.schedules.lr.value",
            "must be one of {choice, uniform",
        ),
        (
            {"space": {"schedules.lr.value": {"loguniform": [0, 1]}}},
            "space.schedules.lr.value.loguniform",
            "needs low > 0",
        ),
        ({"space": {"precision.dtype": {"choice": ["fp8"]}}}, "space.precision.dtype", "'fp8' is not a valid value"),
        ({"space": {"accum.steps": {"randint": [0, 3]}}}, "space.accum.steps", "must be >= 1"),
        (
            {"space": {"accum.steps": {"grid": [1, 2]}}, "scheduler": {"name": "pbt"}},
            "scheduler.name",
            "cannot use grid",
        ),
        ({"space": {"accum.steps": {"grid": [1]}}, "mode": "maximum"}, "mode", "one of 'max', 'min'"),
        ({"space": {}}, "space", "is empty"),
        (
            {"space": {"accum.steps": {"choice": [1, 2]}}, "search": {"points": [{"accum.step": 1}]}},
            "search.points[0]",
            "must give a value for each key of the space (accum.steps)",
        ),
        (
            {"space": {"accum.steps": {"choice": [1, 2]}}, "search": {"points": [{"accum.steps": 0}]}},
            "search.points[0]",
            "must be >= 1",
        ),
    ],
)
def test_an_invalid_sweep_names_the_key(sweep, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_sweep(sweep, load_config(resolve("default")))
    assert info.value.key == key and fragment in str(info.value)


def _sweep(tmp_path, **fields):
    return {
        "metric": "eval_accuracy",
        "mode": "max",
        "max_concurrent_trials": 2,
        "trial": {"num_workers": 1, "cpus_per_worker": 0.5},  # one worker: what is tested is Tune's part
        "storage_path": str(tmp_path / "sweeps"),
        **fields,
    }


TINY = ["schedules.lr.warmup_steps=0", "logging.every_steps=5"]


@pytest.mark.ray
def test_asha_sweep_stops_a_trial_early_and_writes_a_usable_best_recipe(ray_session, tmp_path, capfd):
    from raytrain_loops import tune

    sweep = _sweep(
        tmp_path,
        name="asha",
        num_samples=1,
        # One trial at a time, the good rate first (a grid runs in its order): the good trial is
        # the rung's first result and goes on; the poor one, compared with it at the rung, stops.
        max_concurrent_trials=1,
        space={"schedules.lr.value": {"grid": [3.0e-3, 1.0e-5]}},
        # The first rung at step 30: before it, evaluation in eval mode is at chance for both rates on
        # one worker (0.10-0.11 at steps 10 and 20, BatchNorm's running statistics still settling);
        # at 30, 0.44 against 0.10.
        scheduler={"name": "asha", "grace_period": 30, "reduction_factor": 2},
    )
    store = tmp_path / "mlruns"  # an MLflow directory store
    overrides = [*TINY, "loop.max_steps=60", f"data.dir={tmp_path / 'data'}", f"logging.mlflow.tracking_uri={store}"]
    result = tune(resolve("default"), sweep, overrides=overrides)

    table = pd.read_csv(Path(result.sweep_dir) / "results.csv")
    assert len(table) == 2 and (table["error"].isna()).all(), table
    assert sorted(table["trial"]) == ["trial_00000", "trial_00001"]
    # ASHA stopped the poor trial at its rung (step 30); the best ran to the end.
    steps = dict(zip(table["schedules.lr.value"], table["steps"], strict=True))
    assert steps[1.0e-5] < 60 and steps[3.0e-3] == 60, table
    best = table.loc[table["eval_accuracy"].idxmax()]
    assert best["schedules.lr.value"] == 3.0e-3 and best["steps"] == 60
    assert result.best_values == {"schedules.lr.value": 3.0e-3}
    # best.yaml is a recipe `train` accepts, with the best value in it.
    recipe = load_config(Path(result.sweep_dir) / "best.yaml")
    assert recipe.schedules["lr"].value == 3.0e-3 and recipe.scaling.num_workers == 1  # the sweep's trial section
    assert recipe.run.storage_path == load_config(resolve("default")).run.storage_path
    assert (Path(result.sweep_dir) / "metric_per_trial.png").read_bytes()[:4] == b"\x89PNG"
    # Each trial's Train run is its trial's directory, one tree under the sweep, and a complete run
    # directory: the one ASHA stopped too (its summary written by the sweep, from its last report).
    sweep_dir = Path(result.sweep_dir)
    assert sorted(p.name for p in sweep_dir.glob("trial*")) == list(table["trial"].sort_values())
    for _, row in table.iterrows():
        run_dir = sweep_dir / row["trial"]
        assert (run_dir / "params.json").is_file() and (run_dir / "metrics.jsonl").is_file()  # Tune's and ours
        assert load_config(run_dir / "config.yaml").schedules["lr"].value == row["schedules.lr.value"]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["metrics"]["step"] == row["steps"] and "trial_id" not in summary["metrics"]
        assert summary["metrics"]["eval_accuracy"] == pytest.approx(row["eval_accuracy"])
        if row["steps"] == 60:  # the run that ended its own way: its final checkpoint
            assert Path(summary["checkpoint"]) == run_dir / "checkpoint_00000060"
        assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"
    # The console is a run's: the trials' lines; Ray's own output, Tune's box and its TensorBoard
    # hint into Ray's temporary directory among it, in the sweep's ray.log.
    out, err = capfd.readouterr()
    assert "trial_00001 stopped by the scheduler at step " in out, out[-3000:]
    for ray_only in ("Configuration for experiment", "tensorboard --logdir", "PlacementGroupCleaner", "\x1b["):
        assert ray_only not in out + err, (ray_only, out[-3000:], err[-3000:])
    assert "Configuration for experiment" in (sweep_dir / "ray.log").read_text()

    # One MLflow run per trial in the sweep's experiment, ended even when ASHA stopped the trial.
    from mlflow import MlflowClient

    client = MlflowClient(str(store))
    runs = client.search_runs([client.get_experiment_by_name("asha").experiment_id])
    assert sorted(r.data.tags["trial"] for r in runs) == sorted(table["trial"])
    assert {r.data.tags["sweep"] for r in runs} == {"asha"} and {r.info.status for r in runs} == {"FINISHED"}
    by_trial = {r.data.tags["trial"]: r for r in runs}
    best_run = by_trial[best["trial"]]
    assert best_run.data.params["schedules.lr.value"] == "0.003"
    assert best_run.data.metrics["eval_accuracy"] == pytest.approx(best["eval_accuracy"])


@pytest.mark.ray
def test_pbt_exploit_continues_from_the_donors_weights(ray_session, tmp_path):
    from raytrain_loops import tune
    from raytrain_loops.engine.checkpoint import files as ckpt

    sweep = _sweep(
        tmp_path,
        name="pbt",
        num_samples=2,
        space={"schedules.lr.value": {"choice": [1.0e-5, 3.0e-3]}},
        # A population of a poor and a good learning rate: the poor one is exploited.
        search={"points": [{"schedules.lr.value": 1.0e-5}, {"schedules.lr.value": 3.0e-3}]},
        # synch: the decision at step 10 waits for both trials, however fast each one starts.
        scheduler={"name": "pbt", "perturbation_interval": 10, "quantile_fraction": 0.5, "synch": True},
    )
    # One decision, at step 10: the poor trial takes the good one's weights and goes on to step 20.
    overrides = [*TINY, "loop.max_steps=20", "checkpoint.keep=10", f"data.dir={tmp_path / 'data'}"]
    result = tune(resolve("default"), sweep, overrides=overrides)

    trials = Path(result.sweep_dir)
    handed = sorted(trials.glob("*-from-*/init.json"))
    assert handed, sorted(p.name for p in trials.iterdir())
    sources = {}
    for init in handed:
        loaded = json.loads(init.read_text())["model_sha256"]
        # Each continuation loaded the weights of a checkpoint some trial's own Train run wrote.
        sources[init.parent.name] = {
            d.parent.name
            for d in trials.glob("*/checkpoint_0*")
            if ckpt.digest(ckpt.read_file(d, ckpt.STATE)["model"]) == loaded
        }
    assert all(sources.values()), sources
    for continued in {init.parent for init in handed}:  # each a complete run directory of its own
        assert json.loads((continued / "summary.json").read_text())["metrics"]["step"] == 20
        assert (continued / "config.yaml").is_file() and (continued / "curves.png").is_file()
    # An exploit: a trial continued from another trial's weights (a paused trial resumes from its own).
    assert any(src - {name.split("-from-")[0]} for name, src in sources.items()), sources


@pytest.mark.ray
def test_an_interrupted_optuna_sweep_resumes_when_run_again(ray_session, tmp_path):
    """`raytrain-loops tune` with Optuna's TPE, stopped by Ctrl-C mid-sweep; the same command
    finishes it without rerunning the trial that had finished. Both commands join the session's
    Ray (``RAY_ADDRESS``, as on a cluster): the trials of the interrupted one end with its job."""
    # examples/sweep.yaml's space and search, at a reduced size.
    example = yaml.safe_load((Path(__file__).resolve().parents[1] / "examples" / "sweep.yaml").read_text())
    assert example["search"]["algorithm"] == "optuna"
    sweep_file = tmp_path / "sweep.yaml"
    sweep = _sweep(tmp_path, name="resumable", max_concurrent_trials=1, num_samples=2)
    sweep_file.write_text(yaml.safe_dump({**sweep, "space": example["space"], "search": example["search"]}))
    command = [
        sys.executable, "-m", "raytrain_loops.cli", "tune", "default", *TINY, "loop.max_steps=20",
        f"data.dir={tmp_path / 'data'}", "--sweep", str(sweep_file),
    ]  # fmt: skip
    trials = tmp_path / "sweeps" / "resumable"
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 240
    # Interrupt once the first trial has written its final checkpoint and the second has started.
    while not ((trials / "trial_00000" / "checkpoint_00000020").exists() and (trials / "trial_00001").exists()):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
        time.sleep(0.5)
    first.send_signal(signal.SIGINT)
    interrupted = first.communicate(timeout=120)[0]

    second = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming the sweep" in second.stdout
    # A sweep's console is a run's (Ray's output in the sweep's ray.log); a resumed one's trial
    # lines too.
    assert "trial_00000 finished at step 20: eval_accuracy " in interrupted, interrupted[-3000:]
    assert "trial_00001 finished at step 20: eval_accuracy " in second.stdout, second.stdout[-3000:]
    for console in (interrupted, second.stdout + second.stderr):
        for ray_only in ("Configuration for experiment", "tensorboard --logdir", "PlacementGroupCleaner", "\x1b["):
            assert ray_only not in console, (ray_only, console[-3000:])
    sweep_dir = tmp_path / "sweeps" / "resumable"
    table = pd.read_csv(sweep_dir / "results.csv")
    assert sorted(table["trial"]) == ["trial_00000", "trial_00001"] and (table["steps"] == 20).all(), table
    # Optuna proposed both trials inside the space, and its study was saved with the sweep.
    assert table["schedules.lr.value"].between(1.0e-4, 1.0e-2).all() and table["data.batch_size"].isin([16, 32]).all()
    assert table["schedules.lr.value"].nunique() == 2 and list(sweep_dir.glob("searcher-state-*.pkl"))
    # The finished trial was not run again: each of its steps was logged once.
    steps = [json.loads(line)["step"] for line in (trials / "trial_00000" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))


def test_each_trial_gets_the_sweeps_scaling_and_storage_as_typed_values(tmp_path):
    from raytrain_loops.sweeps.tune import trial_base

    base = load_config(resolve("default"), ["scaling.num_workers=4", "run.name=mine"])
    sweep_dir = str(tmp_path / "sweeps #2" / "lr")  # YAML would cut an override string at " #"
    sweep = load_sweep(
        _sweep(
            tmp_path, space={"accum.steps": {"choice": [1, 2]}}, scheduler={"name": "pbt", "perturbation_interval": 7}
        ),
        base,
    )
    trial = trial_base(base, sweep, sweep_dir)
    assert trial.run.storage_path == sweep_dir  # each run in its trial's directory
    # PBT hands over the checkpoint of each decision's step: every report goes out.
    assert base.run.coalesce_reports and not trial.run.coalesce_reports
    assert (trial.scaling.num_workers, trial.scaling.cpus_per_worker) == (1, 0.5)  # the sweep's trial section
    assert (trial.run.name, trial.run.progress) == ("", False)
    assert trial.eval.every_steps == trial.run.report_every_steps == trial.checkpoint.every_steps == 7
    assert (base.run.name, base.scaling.num_workers) == ("mine", 4)  # the recipe itself is untouched
    with pytest.raises(ConfigError) as info:
        load_sweep(_sweep(tmp_path, space={"accum.steps": {"choice": [1]}}, trial={"num_workers": 0}), base)
    assert info.value.key == "trial.num_workers"
