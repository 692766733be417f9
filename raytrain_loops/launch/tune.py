"""``tune(config, sweep)``: a Ray Tune search in which every trial is a multi-worker Ray Train run.

Each trial is a small driver function that builds a TorchTrainer for its config and relays the
Train run's reports to Tune: metrics (already averaged over all workers by the loop) and the
checkpoint, so PBT can hand a donor's checkpoint to an exploiting trial, which then starts a new
Train run from it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from raytrain_loops.config import Config, load_config, to_dict
from raytrain_loops.config.sweep import SweepConfig, load_sweep, trial_config
from raytrain_loops.launch import storage
from raytrain_loops.launch.errors import raise_if_stopped
from raytrain_loops.launch.fit import ensure_ray, prepare
from raytrain_loops.launch.worker import total_steps
from raytrain_loops.tasks import Task

DRIVER_CPUS = 0.25  # the per-trial driver function only waits on its TorchTrainer


@dataclass
class SweepResult:
    """What a finished sweep left: its directory, the best trial's values and metric."""

    sweep_dir: str
    best_values: dict[str, Any]
    best_metric: float
    table: Any  # pandas.DataFrame of all trials


def _space(sweep: SweepConfig) -> dict[str, Any]:
    from ray import tune

    make = {
        "choice": lambda a: tune.choice(a),
        "grid": lambda a: tune.grid_search(a),
        "uniform": lambda a: tune.uniform(*a),
        "loguniform": lambda a: tune.loguniform(*a),
        "randint": lambda a: tune.randint(int(a[0]), int(a[1])),
    }
    return {key: make[kind](args) for key, spec in sweep.space.items() for kind, args in spec.items()}


def _sweep_overrides(sweep: SweepConfig) -> list[str]:
    """Cadence a scheduler needs: the metric evaluated and reported at its decision points."""
    s = sweep.scheduler
    every = {"asha": s.grace_period, "pbt": s.perturbation_interval}.get(s.name)
    t = sweep.trial
    out = [
        f"scaling.num_workers={t.num_workers}",
        f"scaling.cpus_per_worker={t.cpus_per_worker}",
        f"scaling.use_gpu={t.use_gpu}",
    ]
    out += ["run.progress=false", "run.name="]
    if every:
        out += [f"eval.every_steps={every}", f"run.report_every_steps={every}"]
    if s.name == "pbt":
        out.append(f"checkpoint.every_steps={s.perturbation_interval}")
    return out


class _Relay:
    """A Ray Train callback (runs in the Train controller) passing each report to the trial."""

    def __init__(self, queue):
        self.queue = queue

    def after_report(self, run_context, metrics, checkpoint) -> None:
        self.queue.put((dict(metrics[0]), checkpoint.path if checkpoint else None))


def _trial(values: dict[str, Any], payload: dict[str, Any]) -> None:
    """Tune's trainable: one Ray Train run with this trial's values."""
    from ray import tune
    from ray.train.v2.api.callback import UserCallback
    from ray.util.queue import Empty, Queue

    from raytrain_loops.launch.trainer import build_trainer

    class Relay(_Relay, UserCallback):
        pass

    config = trial_config(payload["base"], values)
    trial = tune.get_context().get_trial_name()
    donor = tune.get_checkpoint()
    init = donor.path if donor is not None else None
    # After a PBT exploit the trial starts a new Train run from the donor's checkpoint (reusing
    # its own run name would make Ray Train resume the trial's old state instead).
    name = trial if init is None else f"{trial}-from-{hashlib.sha256(init.encode()).hexdigest()[:8]}"
    run_dir = storage.join(config.run.storage_path, name)
    queue = Queue(maxsize=4, actor_options={"num_cpus": 0})
    trainer = build_trainer(
        config,
        payload["task"],
        payload["splits"],
        payload["rows"],
        name,
        run_dir,
        callbacks=[Relay(queue)],
        init_checkpoint=init,
    )
    outcome: dict[str, BaseException] = {}

    def fit() -> None:
        try:
            raise_if_stopped(trainer.fit())
        except BaseException as err:  # re-raised in the trial's thread below
            outcome["error"] = err

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    while True:
        try:
            metrics, checkpoint = queue.get(timeout=0.5)
        except Empty:
            if not thread.is_alive() and queue.empty():
                break
            continue
        metrics["trial_run"] = name
        # Only PBT needs Tune to hold checkpoints (to hand them over); the Train run keeps its own.
        handed = tune.Checkpoint(checkpoint) if checkpoint and payload["hand_over"] else None
        tune.report(metrics, checkpoint=handed)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]


def _trial_name(trial) -> str:
    """``trial_00003``, the trial's index in the sweep: the same names for the same sweep, so a
    rerun or a restore finds its trials' run directories."""
    numbered = re.fullmatch(r"[0-9a-f]+_(\d+)", trial.trial_id)  # random and grid: <sweep id>_<index>
    if numbered:
        return f"trial_{int(numbered.group(1)):05d}"
    # Searchers (Optuna) name trials by random ids; their tag starts with a count from 1.
    return f"trial_{int(trial.experiment_tag.split('_', 1)[0]) - 1:05d}"


def _per_trial_cpus(sweep: SweepConfig) -> float:
    t = sweep.trial
    return (0 if t.use_gpu else t.num_workers * t.cpus_per_worker) + DRIVER_CPUS


def _concurrency(sweep: SweepConfig) -> int:
    """``max_concurrent_trials``, or as many trials as the cluster's GPUs (or CPUs, one left to
    Ray Data) hold at once."""
    import ray

    if sweep.max_concurrent_trials:
        return sweep.max_concurrent_trials
    resources = ray.cluster_resources()
    t = sweep.trial
    if t.use_gpu:
        return max(1, int(resources.get("GPU", 0) // t.num_workers))
    return max(1, math.floor((resources.get("CPU", 1) - 1) / _per_trial_cpus(sweep)))


def sweep_name(base: Config, sweep: SweepConfig, task: Task) -> str:
    if sweep.name:
        return sweep.name
    blob = json.dumps({"base": base.to_dict(), "sweep": to_dict(sweep)}, sort_keys=True)
    return f"{type(task).__name__.removesuffix('Task').lower() or 'task'}-sweep-{hashlib.sha256(blob.encode()).hexdigest()[:8]}"


def tune(
    config: Config | dict | str | Path,
    sweep: SweepConfig | dict | str | Path,
    task: Task | None = None,
    overrides: list[str] | None = None,
) -> SweepResult:
    """Run the sweep over the recipe ``config``. The same sweep run again resumes where it stopped."""
    base = (
        config
        if isinstance(config, Config) and not overrides
        else load_config(config if not isinstance(config, Config) else config.to_dict(), overrides)
    )
    sweep = sweep if isinstance(sweep, SweepConfig) else load_sweep(sweep, base)
    user_run = base.to_dict()["run"]
    base = load_config(base.to_dict(), _sweep_overrides(sweep))
    task, splits, rows = prepare(base, task)
    name = sweep_name(base, sweep, task)
    root = storage.join(sweep.storage_path)
    sweep_dir = storage.join(root, name)
    # Each trial's Train run (its checkpoints and logs) under the sweep: trials/<trial>.
    base = load_config(base.to_dict(), [f"run.storage_path={storage.join(sweep_dir, 'trials')}"])
    print(f"sweep directory: {sweep_dir}", flush=True)

    # Trials share the cluster: a trial's workers may wait for those of a trial that just ended.
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "600")
    # A local Ray holds the trials asked to run at once (logical CPUs may exceed the cores).
    ensure_ray(base, num_cpus=sweep.max_concurrent_trials * _per_trial_cpus(sweep) + 1)
    from ray import tune as rt
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining
    from ray.tune.search.basic_variant import BasicVariantGenerator

    concurrency = _concurrency(sweep)
    s = sweep.scheduler
    length = total_steps(base, rows["train"] // base.scaling.num_workers // base.data.batch_size)
    if s.name == "asha":
        scheduler = ASHAScheduler(
            time_attr="step", grace_period=s.grace_period, reduction_factor=s.reduction_factor, max_t=s.max_t or length
        )
    elif s.name == "pbt":
        mutations = {}
        for key, spec in sweep.space.items():
            ((kind, args),) = spec.items()
            mutations[key] = list(args) if kind == "choice" else _space(SweepConfig(space={key: spec}))[key]
        scheduler = PopulationBasedTraining(
            time_attr="step",
            perturbation_interval=s.perturbation_interval,
            hyperparam_mutations=mutations,
            quantile_fraction=s.quantile_fraction,
            resample_probability=s.resample_probability,
        )
    else:
        scheduler = FIFOScheduler()
    if sweep.search.algorithm == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        search = OptunaSearch(seed=sweep.search.seed, points_to_evaluate=sweep.search.points or None)
    else:
        # Tune applies max_concurrent_trials to a searcher it builds, not to one given to it.
        search = BasicVariantGenerator(
            random_state=sweep.search.seed, max_concurrent=concurrency, points_to_evaluate=sweep.search.points or None
        )

    payload = {
        "base": base.to_dict(),
        "task": task,
        "splits": splits,
        "rows": rows,
        "hand_over": s.name == "pbt",
    }
    trainable = rt.with_resources(rt.with_parameters(_trial, payload=payload), {"CPU": DRIVER_CPUS})
    if rt.Tuner.can_restore(sweep_dir):
        print(f"resuming the sweep in {sweep_dir}", flush=True)
        tuner = rt.Tuner.restore(sweep_dir, trainable=trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = rt.Tuner(
            trainable,
            param_space=_space(sweep),
            tune_config=rt.TuneConfig(
                metric=sweep.metric,
                mode=sweep.mode,
                num_samples=sweep.num_samples,
                scheduler=scheduler,
                search_alg=search,
                max_concurrent_trials=None if isinstance(search, BasicVariantGenerator) else concurrency,
                # A stopped trial's actor must go, taking its Ray Train run (which it owns) with it;
                # a reused actor would keep that run's workers and their resources.
                reuse_actors=False,
                trial_name_creator=_trial_name,
                trial_dirname_creator=_trial_name,
            ),
            # PBT hands over a trial's latest checkpoint; keeping a few lets an exploit that was
            # decided on a slightly older one still find it.
            run_config=rt.RunConfig(name=name, storage_path=root, checkpoint_config=rt.CheckpointConfig(num_to_keep=4)),
        )
    results = tuner.fit()
    return _write_outputs(results, sweep, base, user_run, sweep_dir)


def _write_outputs(results, sweep: SweepConfig, base: Config, user_run: dict, sweep_dir: str) -> SweepResult:
    """results.csv, the printed table, best.yaml (a recipe) and metric_per_trial.png."""
    import pandas as pd

    keys = list(sweep.space)
    rows = []
    for r in results:
        cfg = r.config or {}
        history = r.metrics_dataframe
        steps = int(history["step"].max()) if history is not None and "step" in history else 0
        rows.append(
            {
                "trial": Path(r.path).name if r.path else "?",
                **{k: cfg.get(k) for k in keys},
                sweep.metric: (r.metrics or {}).get(sweep.metric),
                "steps": steps,
                "error": type(r.error).__name__ if r.error else "",
            }
        )
    table = pd.DataFrame(rows)
    os.makedirs(sweep_dir, exist_ok=True)
    table.to_csv(os.path.join(sweep_dir, "results.csv"), index=False)
    print(table.to_string(index=False), flush=True)
    best = results.get_best_result(metric=sweep.metric, mode=sweep.mode, scope="last")
    values = {k: best.config[k] for k in keys}
    recipe = trial_config(base.to_dict(), values).to_dict()
    recipe["run"] = user_run  # the trial's settings, the user's run name and storage
    Path(sweep_dir, "best.yaml").write_text(
        f"# The best trial of the sweep in {sweep_dir} ({sweep.metric} = {best.metrics.get(sweep.metric)}).\n"
        f"#   raytrain-loops train {os.path.join(sweep_dir, 'best.yaml')}\n" + yaml.safe_dump(recipe, sort_keys=False)
    )
    _plot(results, sweep, sweep_dir)
    print(
        f"best: {values} -> {sweep.metric} {best.metrics.get(sweep.metric)}; recipe {os.path.join(sweep_dir, 'best.yaml')}",
        flush=True,
    )
    return SweepResult(sweep_dir, values, best.metrics.get(sweep.metric), table)


def _plot(results, sweep: SweepConfig, sweep_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        df = r.metrics_dataframe
        if df is not None and sweep.metric in df and "step" in df:
            ax.plot(df["step"], df[sweep.metric], marker=".", label=Path(r.path).name if r.path else "?")
    ax.set(xlabel="step", ylabel=sweep.metric, title=f"{sweep.metric} per trial")
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(sweep_dir, "metric_per_trial.png"), dpi=100)
    plt.close(fig)
