"""What a finished sweep leaves: ``results.csv``, the printed table, ``best.yaml`` (a recipe that
``raytrain-loops train`` accepts) and ``metric_per_trial.png``; a failed trial's ``error.txt`` in
its trial's directory."""

from __future__ import annotations

import io
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from raytrain_loops import storage
from raytrain_loops.checkpoint import last_checkpoint
from raytrain_loops.config.run import Config, RunConfig
from raytrain_loops.config.sweep import SweepConfig, trial_config
from raytrain_loops.driver.fit import write_summary
from raytrain_loops.rundir.layout import SUMMARY

# What Tune adds to a trial's results, beside the run's own metrics.
TUNE_KEYS = ("trial_id", "experiment_tag", "done", "trial_run", "warmup_time", "should_checkpoint")


@dataclass
class SweepResult:
    """What a finished sweep left: its directory, the best trial's values and metric."""

    sweep_dir: str
    best_values: dict[str, Any]
    best_metric: float
    table: Any  # pandas.DataFrame of all trials


class SweepInterrupted(KeyboardInterrupt):
    """A sweep stopped by Ctrl-C (Tune ends it and saves its state): the trials that had not
    ended, which the same sweep run again resumes. No results table or best recipe is written for
    a sweep that has not ended."""

    def __init__(self, sweep_dir: str, trials: list[str]):
        super().__init__(f"the sweep in {sweep_dir} was interrupted; trials not ended: {', '.join(trials)}")
        self.sweep_dir, self.trials = sweep_dir, trials


def unended(results) -> set[str]:
    """The trials that neither ended their own way, nor were stopped by the scheduler, nor failed:
    those a Ctrl-C stopped (Tune ends them as a scheduler's stop, but their last result is not
    marked done)."""
    return {storage.name(r.path) for r in results if r.error is None and not (r.metrics or {}).get("done")}


def copy_error(error_file: str | None, sweep_dir: str | None, trial: str) -> str:
    """A failed trial's error file (in Ray's session directory, on the driver) copied into the
    trial's own directory of the sweep, as ``error.txt``: where it is now ('?' when Ray kept none)."""
    if not error_file:
        return "?"
    if sweep_dir is None:
        return error_file
    dest = storage.join(sweep_dir, trial, "error.txt")
    try:
        with open(error_file, encoding="utf-8", errors="replace") as f:
            text = f.read()
        storage.make_dirs(storage.join(sweep_dir, trial))
        storage.write_text(dest, text)
    except OSError:  # the copy is a convenience: Ray's own file is still there
        return error_file
    return dest


def complete_stopped_runs(results, sweep_dir: str) -> None:
    """The Train run of a trial's last result, whose trial the scheduler stopped (its actor ended
    before the run could end its own way), made a complete run directory: ``summary.json`` of its
    last report, with its last complete checkpoint, and ``curves.png``. A PBT trial's earlier run,
    before an exploit, keeps its logs and checkpoints only."""
    from ray.tune.result import AUTO_RESULT_KEYS

    for r in results:
        last = r.metrics or {}
        if not last.get("trial_run"):
            continue
        run_dir = storage.join(sweep_dir, last["trial_run"])
        if storage.exists(storage.join(run_dir, SUMMARY)):
            continue
        metrics = {k: v for k, v in last.items() if k not in (*AUTO_RESULT_KEYS, *TUNE_KEYS)}
        write_summary(run_dir, metrics, last_checkpoint(run_dir), float(last.get("time_total_s") or 0.0))


def write_outputs(results, sweep: SweepConfig, base: Config, user_run: RunConfig, sweep_dir: str) -> SweepResult:
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
    # Through the storage layer: the sweep directory may be a URI (s3://...), not a local path.
    storage.write_text(storage.join(sweep_dir, "results.csv"), table.to_csv(index=False))
    print(table.to_string(index=False), flush=True)
    best = results.get_best_result(metric=sweep.metric, mode=sweep.mode, scope="last")
    values = {k: best.config[k] for k in keys}
    # The trial's settings, with the user's run section (name, storage) instead of the trial's.
    recipe = replace(trial_config(base.to_dict(), values), run=user_run).to_dict()
    best_yaml = storage.join(sweep_dir, "best.yaml")
    storage.write_text(
        best_yaml,
        f"# The best trial of the sweep in {sweep_dir} ({sweep.metric} = {best.metrics.get(sweep.metric)}).\n"
        f"#   raytrain-loops train {best_yaml}\n" + yaml.safe_dump(recipe, sort_keys=False),
    )
    _plot(results, sweep, sweep_dir)
    print(f"best: {values} -> {sweep.metric} {best.metrics.get(sweep.metric)}; recipe {best_yaml}", flush=True)
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
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    storage.write_bytes(storage.join(sweep_dir, "metric_per_trial.png"), png.getvalue())
