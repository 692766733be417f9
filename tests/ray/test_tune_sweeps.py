"""The sweep file of Tune sweeps: every key checked against the recipe before Ray starts."""

from __future__ import annotations

import ast
import json
import os
import shlex
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
from raytrain_loops.data.parquet import ROW_SEED
from raytrain_loops.recipes import resolve
from raytrain_loops.tasks import DigitsTask
from tests.support.runfiles import records


class DigitsThroughPreprocess(DigitsTask):
    """Digits whose rows pass, unchanged, through ``preprocess``: read by preprocessing tasks."""

    def preprocess(self, batch, train):
        return {k: v for k, v in batch.items() if k != ROW_SEED}


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
def test_pbt_exploit_continues_from_the_donors_weights(ray_session, tmp_path):
    from raytrain_loops import tune
    from raytrain_loops.checkpoint import files as ckpt

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
def test_a_sweep_whose_trial_failed_exits_1_naming_it_and_its_error_with_no_best_recipe(ray_session, tmp_path):
    """`raytrain-loops tune` whose one trial raises after its first step (no retries): the trial
    named as it fails, the table written with its error, no best.yaml, and the command exits 1
    with a last line naming the trial, its error and where the error is kept. The same command
    then runs the trial again, to its end."""
    sweep = _sweep(tmp_path, name="fails", num_samples=1, space={"schedules.lr.value": {"choice": [3.0e-3]}})
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump(sweep))
    command = [
        sys.executable, "-m", "raytrain_loops.cli", "tune", "default", *TINY, "loop.max_steps=4",
        "run.max_failures=0", "fault.plan=[{step: 1, kind: raise}]", f"data.dir={tmp_path / 'data'}",
        "--sweep", str(sweep_file),
    ]  # fmt: skip
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    console = out.stdout + out.stderr
    assert out.returncode == 1, console[-3000:]
    sweep_dir = tmp_path / "sweeps" / "fails"
    error = sweep_dir / "trial_00000" / "error.txt"
    assert f"trial_00000 failed; its error: {error}" in out.stdout, console[-3000:]
    assert "fault.plan[0] after step 1" in error.read_text()
    last = out.stderr.splitlines()[-1]
    assert last.startswith(f"raytrain-loops: tune: 1 of 1 trials of the sweep in {sweep_dir} failed (trial_00000: "), last
    assert "fault.plan[0] after step 1" in last and f"(its error: {error})" in last, last
    assert last.endswith("; no trial ended without an error and with a finite eval_accuracy: no best recipe was written")
    assert out.stdout.splitlines()[-1] == f"sweep directory: {sweep_dir}", out.stdout[-2000:]
    table = pd.read_csv(sweep_dir / "results.csv")
    assert list(table["trial"]) == ["trial_00000"] and list(table["error"]) == ["InjectedFault"], table
    assert not (sweep_dir / "best.yaml").exists() and "best: none: " in out.stdout

    # The same command runs the failed trial again (from its checkpoint; the fault fired once).
    again = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "resuming the sweep" in again.stdout and "trial_00000 finished at step 4: " in again.stdout, again.stdout
    assert pd.read_csv(sweep_dir / "results.csv")["error"].isna().all()
    assert load_config(sweep_dir / "best.yaml").schedules["lr"].value == 3.0e-3


def _mlflow_runs(store: Path) -> dict[str, tuple[str, str]]:
    """The MLflow runs of the sweep "asha": trial -> (run id, status)."""
    from raytrain_loops.callbacks.mlflow_log import client

    mlflow_client = client(str(store))
    runs = mlflow_client.search_runs([mlflow_client.get_experiment_by_name("asha").experiment_id])
    return {r.data.tags["trial"]: (r.info.run_id, r.info.status) for r in runs}


def _interrupt_and_rerun(
    command: list[str], sweep_dir: Path, env: dict[str, str], store: Path, rerun_env: dict[str, str]
) -> tuple[str, dict[str, tuple[str, str]], subprocess.CompletedProcess]:
    """Run the sweep's command, Ctrl-C it once its first trial has written its final checkpoint
    and its third has started its Train run, then run the same command again to its end (in
    ``rerun_env``): the first command's output, the MLflow runs it left, the second command."""
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 600  # three Train runs' starts, on a loaded machine
    started = sweep_dir / "trial_00002" / "config.yaml"  # written once the trial's MLflow run is open
    while not ((sweep_dir / "trial_00000" / "checkpoint_00000060").exists() and started.exists()):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
        time.sleep(0.5)
    first.send_signal(signal.SIGINT)
    interrupted = first.communicate(timeout=300)[0]
    # Interrupted, not ended: exit 130, the trial left to run named, and no results table or best
    # recipe of a sweep that has not ended.
    assert first.returncode == 130, interrupted[-3000:]
    (said,) = [line for line in interrupted.splitlines() if line.startswith("raytrain-loops: the sweep in ")]
    assert said.endswith(
        f"was interrupted; trials not ended: trial_00002; the same command runs it again: "
        f"{shlex.join(['raytrain-loops', *command[3:]])}"
    ), said
    assert not (sweep_dir / "best.yaml").exists() and not (sweep_dir / "results.csv").exists()
    assert "best: " not in interrupted
    between = _mlflow_runs(store)
    second = subprocess.run(command, capture_output=True, text=True, timeout=600, env=rerun_env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    return interrupted, between, second


@pytest.mark.ray
def test_an_asha_sweep_stopped_by_ctrl_c_resumes_and_writes_a_usable_best_recipe(ray_session, tmp_path):
    """`raytrain-loops tune` over examples/sweep.yaml's space with Optuna's TPE and ASHA, one trial
    at a time: a good rate, then a poor one that ASHA stops at its rung, then Optuna's own
    proposal, during which Ctrl-C stops the sweep; the same command finishes it without rerunning
    the trials that had ended. The first command joins the session's Ray (``RAY_ADDRESS``, as on a
    cluster): its trials end with its job. The second starts a local Ray of its own, sized by
    ``tune`` for a trial and its preprocessing: the task reads its rows through ``preprocess``, in
    tasks of 2 CPUs each (more than the one CPU a local Ray once left beside a trial)."""
    example = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "sweep.yaml").read_text())
    assert example["search"]["algorithm"] == "optuna"
    good, poor = 3.0e-3, 1.0e-4  # the poor rate is the space's lowest
    sweep = _sweep(
        tmp_path,
        name="asha",
        num_samples=3,
        # One trial at a time, the given points first, the good rate before the poor one: the good
        # trial is the rung's first result and goes on; the poor one, compared with it at the
        # rung, stops. Ray Tune does not save the scheduler with the sweep: the stop is decided
        # before the interruption, and the resumed trial is the rung's first again.
        max_concurrent_trials=1,
        space=example["space"],
        search={
            **example["search"],
            "points": [{"schedules.lr.value": lr, "data.batch_size": 32} for lr in (good, poor)],
        },
        # The first rung at step 30: before it, evaluation in eval mode is at chance for both rates on
        # one worker (BatchNorm's running statistics still settling); at 30, 0.67 against 0.24.
        scheduler={"name": "asha", "grace_period": 30, "reduction_factor": 2},
    )
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump(sweep))
    store = tmp_path / "mlruns"  # an MLflow directory store
    command = [
        sys.executable, "-m", "raytrain_loops.cli", "tune", "default", *TINY, "loop.max_steps=60",
        f"data.dir={tmp_path / 'data'}", f"logging.mlflow.tracking_uri={store}", "--sweep", str(sweep_file),
        "task.name=tests.ray.test_tune_sweeps:DigitsThroughPreprocess", "data.preprocess.num_cpus=2",
    ]  # fmt: skip
    sweep_dir = tmp_path / "sweeps" / "asha"
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    local = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    interrupted, between, second = _interrupt_and_rerun(command, sweep_dir, env, store, local)

    # A sweep's console is a run's: the trials' lines, a resumed one's too; Ray's own output, Tune's
    # box and its TensorBoard hint into Ray's temporary directory among it, in the sweep's ray.log.
    assert "resuming the sweep" in second.stdout
    assert "trial_00000 finished at step 60: eval_accuracy " in interrupted, interrupted[-3000:]
    assert "trial_00001 stopped by the scheduler at step " in interrupted, interrupted[-3000:]
    assert "trial_00002 finished at step 60: eval_accuracy " in second.stdout, second.stdout[-3000:]
    for console in (interrupted, second.stdout + second.stderr):
        for ray_only in ("Configuration for experiment", "tensorboard --logdir", "PlacementGroupCleaner", "\x1b["):
            assert ray_only not in console, (ray_only, console[-3000:])
    assert "Configuration for experiment" in (sweep_dir / "ray.log").read_text()
    assert "Started a local Ray" in (sweep_dir / "ray.log").read_text()  # the second command's

    table = pd.read_csv(sweep_dir / "results.csv")
    assert len(table) == 3 and (table["error"].isna()).all(), table
    assert sorted(table["trial"]) == ["trial_00000", "trial_00001", "trial_00002"]
    # ASHA stopped the poor trial at its rung (step 30); the good one and Optuna's ran to the end.
    lrs, steps = (dict(zip(table["trial"], table[key], strict=True)) for key in ("schedules.lr.value", "steps"))
    assert (lrs["trial_00000"], lrs["trial_00001"]) == (good, poor), table
    assert steps["trial_00001"] < 60 and steps["trial_00000"] == steps["trial_00002"] == 60, table
    # Optuna proposed its trial inside the space, and its study was saved with the sweep.
    assert table["schedules.lr.value"].between(1.0e-4, 1.0e-2).all() and table["data.batch_size"].isin([16, 32]).all()
    assert table["schedules.lr.value"].nunique() == 3 and list(sweep_dir.glob("searcher-state-*.pkl"))
    best = table.loc[table["eval_accuracy"].idxmax()]
    assert best["schedules.lr.value"] == good and best["steps"] == 60
    _check_best_recipe(sweep_dir, second.stdout, {"schedules.lr.value": good, "data.batch_size": 32})
    _check_trial_runs(sweep_dir, table)
    # The finished trial was not run again: each of its steps was logged once.
    assert [r["step"] for r in records(sweep_dir / "trial_00000" / "metrics.jsonl")] == list(range(1, 61))
    _check_mlflow(store, table, best, between)


def _check_best_recipe(sweep_dir: Path, console: str, values: dict) -> None:
    """The sweep's best values, as it printed them, and best.yaml: a recipe `train` accepts, with
    the best values in it."""
    (shown,) = [line for line in console.splitlines() if line.startswith("best: ")]
    assert ast.literal_eval(shown.removeprefix("best: ").split(" -> ")[0]) == values, shown
    recipe = load_config(sweep_dir / "best.yaml")
    assert recipe.schedules["lr"].value == values["schedules.lr.value"]
    assert recipe.data.batch_size == values["data.batch_size"]
    assert recipe.scaling.num_workers == 1  # the sweep's trial section
    assert recipe.run.storage_path == load_config(resolve("default")).run.storage_path
    assert (sweep_dir / "metric_per_trial.png").read_bytes()[:4] == b"\x89PNG"


def _check_trial_runs(sweep_dir: Path, table: pd.DataFrame) -> None:
    """Each trial's Train run is its trial's directory, one tree under the sweep, and a complete
    run directory: the one ASHA stopped too (its summary written by the sweep, from its last
    report), and the one the interruption stopped (its run resumed)."""
    assert sorted(p.name for p in sweep_dir.glob("trial*")) == list(table["trial"].sort_values())
    for _, row in table.iterrows():
        run_dir = sweep_dir / row["trial"]
        assert (run_dir / "params.json").is_file() and (run_dir / "metrics.jsonl").is_file()  # Tune's and ours
        assert load_config(run_dir / "config.yaml").schedules["lr"].value == row["schedules.lr.value"]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["metrics"]["step"] == row["steps"] and "trial_id" not in summary["metrics"]
        assert summary["metrics"]["eval_accuracy"] == pytest.approx(row["eval_accuracy"])
        if row["steps"] == 60:  # the runs that ended their own way: their final checkpoints
            assert Path(summary["checkpoint"]) == run_dir / "checkpoint_00000060"
        assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"


def _check_mlflow(store: Path, table: pd.DataFrame, best: pd.Series, between: dict[str, tuple[str, str]]) -> None:
    """One MLflow run per trial in the sweep's experiment, ended even when ASHA stopped the trial;
    the trial the interruption stopped ended its run KILLED, as an interrupted run does, and its
    resumed Train run continued that MLflow run to FINISHED."""
    from raytrain_loops.callbacks.mlflow_log import client

    statuses = {trial: status for trial, (_, status) in between.items()}
    assert statuses == {"trial_00000": "FINISHED", "trial_00001": "FINISHED", "trial_00002": "KILLED"}, between
    mlflow_client = client(str(store))
    runs = mlflow_client.search_runs([mlflow_client.get_experiment_by_name("asha").experiment_id])
    assert sorted(r.data.tags["trial"] for r in runs) == sorted(table["trial"])
    assert {r.data.tags["sweep"] for r in runs} == {"asha"} and {r.info.status for r in runs} == {"FINISHED"}
    by_trial = {r.data.tags["trial"]: r for r in runs}
    assert {trial: r.info.run_id for trial, r in by_trial.items()} == {t: run_id for t, (run_id, _) in between.items()}
    best_run = by_trial[best["trial"]]
    assert best_run.data.params["schedules.lr.value"] == "0.003"
    assert best_run.data.metrics["eval_accuracy"] == pytest.approx(best["eval_accuracy"])


def test_an_interrupted_sweep_ends_the_latest_run_of_each_interrupted_trial_killed(tmp_path):
    """The MLflow runs a sweep ends after Tune: a trial the sweep's interruption stopped is KILLED
    (it resumes with the sweep), only its latest run; a trial a scheduler stopped FINISHED."""
    from raytrain_loops.callbacks.mlflow_log import client
    from raytrain_loops.driver.tracking import finish_sweep, open_tracking

    config = load_config(resolve("default"), [f"logging.mlflow.tracking_uri={tmp_path / 'mlruns'}"])
    tracking = open_tracking(config.logging.mlflow, default_experiment="s")
    mlflow_client = client(tracking.tracking_uri)

    def run(trial: str, status: str, sweep: str = "s") -> str:
        started = 1_000_000 + len(runs)  # each run started after the one before
        tags = {"sweep": sweep, "trial": trial}
        run_id = mlflow_client.create_run(tracking.experiment_id, start_time=started, tags=tags).info.run_id
        if status != "RUNNING":
            mlflow_client.set_terminated(run_id, status)
        return run_id

    runs: dict[str, str] = {}
    runs["stopped"] = run("trial_00000", "RUNNING")  # a trial a scheduler stopped: its actor killed
    runs["failed"] = run("trial_00001", "RUNNING")
    runs["exploited"] = run("trial_00002", "FINISHED")  # a PBT trial's run before an exploit ...
    runs["interrupted"] = run("trial_00002", "FINISHED")  # ... and its continuation, ended as Tune ended it
    runs["killed"] = run("trial_00003", "RUNNING")  # an interrupted trial whose actor was killed
    runs["other_sweep"] = run("trial_00000", "RUNNING", sweep="t")
    finish_sweep(tracking, "s", {"trial_00001"}, {"trial_00002", "trial_00003"})
    statuses = {key: mlflow_client.get_run(run_id).info.status for key, run_id in runs.items()}
    assert statuses == {
        "stopped": "FINISHED",
        "failed": "FAILED",
        "exploited": "FINISHED",
        "interrupted": "KILLED",
        "killed": "KILLED",
        "other_sweep": "RUNNING",
    }


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


@pytest.mark.ray
def test_a_sweep_whose_trial_and_its_preprocessing_the_cluster_cannot_hold_is_refused_before_any_trial(
    ray_session, tmp_path
):
    """The session's Ray has 4 CPUs: a trial of 2 workers of 1.5 CPUs, with a preprocessing task
    of 1 CPU beside each, and its driver's 0.25, does not fit. Without ``preprocess`` it does."""
    from raytrain_loops import tune
    from raytrain_loops.sweeps.resources import concurrency

    sweep = _sweep(tmp_path, name="big", max_concurrent_trials=0, space={"schedules.lr.value": {"choice": [1.0e-3]}})
    sweep["trial"] = {"num_workers": 2, "cpus_per_worker": 1.5}
    overrides = [f"data.dir={tmp_path / 'data'}", "task.name=tests.ray.test_tune_sweeps:DigitsThroughPreprocess"]
    with pytest.raises(ConfigError) as info:
        tune(resolve("default"), sweep, overrides=overrides)
    assert info.value.key == "trial"
    assert str(info.value).startswith(
        "trial: one trial needs 5.25 CPUs (0.25 for its driver, 3 for its 2 workers, 2 for their preprocessing "
        "at data.preprocess.num_cpus=1 each), but the cluster has 4"
    ), str(info.value)
    assert not list((tmp_path / "sweeps").glob("big/trial_*"))
    # Trials at once leave each its preprocessing: 4 CPUs hold two of 0.25 + 0.5 + 1, not four.
    assert concurrency(load_sweep({**_sweep(tmp_path), "max_concurrent_trials": 0, "space": sweep["space"]},
                                  load_config(resolve("default"))), 1.75) == 2  # fmt: skip


def test_a_failed_trials_error_is_copied_into_its_trial_directory_and_named(tmp_path, capsys):
    from raytrain_loops.sweeps.tune import TrialProgress

    class Failed:  # what the callback reads of Tune's trial
        trial_id, experiment_tag = "5f1e2_00001", "1_lr=0.1"
        error_file = str(tmp_path / "session" / "driver_artifacts" / "error.txt")

    Path(Failed.error_file).parent.mkdir(parents=True)
    Path(Failed.error_file).write_text("Traceback ...\nValueError: logits and targets disagree\n")
    sweep_dir = tmp_path / "sweeps" / "lr"
    TrialProgress(None, "eval_accuracy", 60, str(sweep_dir)).on_trial_error(0, [], Failed())
    copied = sweep_dir / "trial_00001" / "error.txt"
    assert copied.read_text().endswith("ValueError: logits and targets disagree\n")
    assert capsys.readouterr().out == f"trial_00001 failed; its error: {copied}\n"


def test_a_failed_trial_is_never_the_best_and_a_sweep_of_failed_trials_writes_no_best_recipe(tmp_path, capsys):
    """write_outputs over Ray Tune's own ``Result`` objects (no Ray started): the best trial is the
    best of those that ended without an error and with a finite metric, even when a failed one
    reported a better value before it failed; with none such, the table is written and no
    best.yaml. The failed trials are named with their error and its copy. The sweep's end raises
    SweepFailed for failed trials, and for a sweep whose trials all diverged (no best trial)."""
    from ray.tune import Result

    from raytrain_loops.sweeps.results import SweepFailed, failed_trials, write_outputs
    from raytrain_loops.sweeps.tune import _ended

    base = load_config(resolve("default"))
    sweep = load_sweep(_sweep(tmp_path, space={"schedules.lr.value": {"choice": [0.1, 0.2, 0.3, 0.4]}}), base)
    sweep_dir = tmp_path / "sweeps" / "s"

    def result(trial: str, lr: float, accuracy: float, error: Exception | None = None) -> Result:
        metrics = {"eval_accuracy": accuracy, "step": 10, "done": True, "config": {"schedules.lr.value": lr}}
        frame = pd.DataFrame([{"step": 5, "eval_accuracy": accuracy / 2}, {"step": 10, "eval_accuracy": accuracy}])
        return Result(metrics=metrics, checkpoint=None, error=error, path=str(sweep_dir / trial), metrics_dataframe=frame)

    boom = RuntimeError("fault.plan[0] after step 10")
    results = [
        result("trial_00000", 0.1, 0.95, error=boom),  # the highest accuracy, but the trial failed
        result("trial_00001", 0.2, 0.60),
        result("trial_00002", 0.3, float("nan")),  # diverged: never the best
        result("trial_00003", 0.4, 0.70),
    ]
    (sweep_dir / "trial_00000").mkdir(parents=True)
    (sweep_dir / "trial_00000" / "error.txt").write_text("Traceback ...\nRuntimeError: fault.plan[0] after step 10\n")

    written = write_outputs(results, sweep, base, base.run, str(sweep_dir))
    assert written.best_values == {"schedules.lr.value": 0.4} and written.best_metric == 0.7
    assert load_config(sweep_dir / "best.yaml").schedules["lr"].value == 0.4
    table = pd.read_csv(sweep_dir / "results.csv")
    assert list(table["error"].fillna("")) == ["RuntimeError", "", "", ""], table
    failed = failed_trials(results, str(sweep_dir))
    assert failed == {
        "trial_00000": f"RuntimeError: fault.plan[0] after step 10 (its error: {sweep_dir / 'trial_00000' / 'error.txt'})"
    }
    said = str(SweepFailed(written, failed, len(results), "eval_accuracy"))
    assert said.startswith(f"1 of 4 trials of the sweep in {sweep_dir} failed (trial_00000: RuntimeError: ")
    assert said.endswith("; best.yaml is the best of the 3 others"), said
    sweep = load_sweep(_sweep(tmp_path, mode="min", space={"schedules.lr.value": {"choice": [0.1, 0.2]}}), base)
    assert write_outputs(results, sweep, base, base.run, str(sweep_dir)).best_values == {"schedules.lr.value": 0.2}

    # Every trial failed or diverged: the table and the plot, no best recipe.
    (sweep_dir / "best.yaml").unlink()
    capsys.readouterr()
    none = write_outputs([results[0], results[2]], sweep, base, base.run, str(sweep_dir))
    assert none.best_values is None and not (sweep_dir / "best.yaml").exists()
    assert len(pd.read_csv(sweep_dir / "results.csv")) == 2
    assert "best: none: no trial ended without an error and with a finite eval_accuracy" in capsys.readouterr().out
    said = str(SweepFailed(none, failed_trials([results[0], results[2]], str(sweep_dir)), 2, "eval_accuracy"))
    assert said.endswith("; no trial ended without an error and with a finite eval_accuracy: no best recipe was written")

    # The sweep's end: failed trials, or no best trial (all diverged, none failed), raise once all is written.
    with pytest.raises(SweepFailed) as raised:
        _ended(results, sweep, base, base.run, str(sweep_dir), None)
    assert list(raised.value.failed) == ["trial_00000"] and raised.value.result.best_values == {"schedules.lr.value": 0.2}
    (sweep_dir / "best.yaml").unlink()
    diverged = [results[2], result("trial_00004", 0.5, float("nan"))]
    with pytest.raises(SweepFailed) as raised:
        _ended(diverged, sweep, base, base.run, str(sweep_dir), None)
    assert raised.value.failed == {} and not (sweep_dir / "best.yaml").exists()
    assert str(raised.value) == (
        f"the sweep in {sweep_dir} ended with no best trial (eval_accuracy trial_00002: nan, trial_00004: nan); "
        "no trial ended without an error and with a finite eval_accuracy: no best recipe was written"
    )
    assert _ended(results[1:2], sweep, base, base.run, str(sweep_dir), None).best_values == {"schedules.lr.value": 0.2}
