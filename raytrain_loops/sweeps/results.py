"""What a finished sweep leaves: ``results.csv``, the printed table, ``best.yaml`` (a recipe that
``raytrain-loops train`` accepts) and ``metric_per_trial.png``; a failed trial's ``error.txt`` in
its trial's directory."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from raytrain_loops import storage
from raytrain_loops.checkpoint import last_checkpoint
from raytrain_loops.config.run import Config, RunConfig
from raytrain_loops.config.sweep import SweepConfig, trial_config
from raytrain_loops.driver.fit import write_summary
from raytrain_loops.errors import root_cause, root_type
from raytrain_loops.rundir.layout import SUMMARY

# What Tune adds to a trial's results, beside the run's own metrics.
TUNE_KEYS = ("trial_id", "experiment_tag", "done", "trial_run", "warmup_time", "should_checkpoint")


@dataclass
class SweepResult:
    """What a finished sweep left: its directory, the best trial's values and metric (None and
    NaN when no trial ended without an error and with a finite metric: then no ``best.yaml``)."""

    sweep_dir: str
    best_values: dict[str, Any] | None
    best_metric: float
    table: Any  # pandas.DataFrame of all trials


class SweepFailed(RuntimeError):
    """A sweep that ended with failed trials, or with no best trial (none ended without an error
    and with a finite metric: all diverged), raised once everything it writes is written:
    ``failed`` maps each failed trial to its error's line and where its error file is; ``result``
    is what the sweep wrote (``best.yaml`` from the trials that did not fail, when one did not);
    ``metric``: the sweep's."""

    def __init__(self, result: SweepResult, failed: dict[str, str], trials: int, metric: str):
        if result.best_values is not None:
            after = f"best.yaml is the best of the {trials - len(failed)} others"
        else:
            after = f"no trial ended without an error and with a finite {metric}: no best recipe was written"
        if failed:
            said = "; ".join(f"{trial}: {line}" for trial, line in failed.items())
            line = f"{len(failed)} of {trials} trials of the sweep in {result.sweep_dir} failed ({said}); {after}"
        else:
            got = ", ".join(f"{row['trial']}: {row[metric]}" for _, row in result.table.iterrows())
            line = f"the sweep in {result.sweep_dir} ended with no best trial ({metric} {got}); {after}"
        super().__init__(line)
        self.result, self.failed, self.trials = result, failed, trials


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


def failed_trials(results, sweep_dir: str) -> dict[str, str]:
    """The trials that ended in an error: each one's error (its root cause, on one line) and the
    file that holds it, in the trial's directory where the sweep copied it."""
    failed = {}
    for r in results:
        if r.error is None:
            continue
        trial = storage.name(r.path) if r.path else "?"
        copied = storage.join(sweep_dir, trial, "error.txt")
        where = copied if storage.exists(copied) else "not kept"
        failed[trial] = f"{root_cause(r.error)} (its error: {where})"
    return dict(sorted(failed.items()))


def best_result(results, metric: str, mode: str):
    """The trial whose last ``metric`` is best (``mode`` max or min) among those that ended
    without an error and with a finite value; None when there is none. A failed trial is never
    the best, whatever it reported before it failed."""
    candidates = [r for r in results if r.error is None and _finite((r.metrics or {}).get(metric))]
    if not candidates:
        return None
    pick = max if mode == "max" else min
    return pick(candidates, key=lambda r: float(r.metrics[metric]))


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


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
    """results.csv, the printed table, metric_per_trial.png and best.yaml (a recipe; none when no
    trial is :func:`best_result`)."""
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
                "error": root_type(r.error) if r.error else "",
            }
        )
    table = pd.DataFrame(rows)
    # Through the storage layer: the sweep directory may be a URI (s3://...), not a local path.
    storage.write_text(storage.join(sweep_dir, "results.csv"), table.to_csv(index=False))
    print(table.to_string(index=False), flush=True)
    _plot(results, sweep, sweep_dir)
    best = best_result(results, sweep.metric, sweep.mode)
    if best is None:
        print(f"best: none: no trial ended without an error and with a finite {sweep.metric}", flush=True)
        return SweepResult(sweep_dir, None, math.nan, table)
    values = {k: best.config[k] for k in keys}
    # The trial's settings, with the user's run section (name, storage) instead of the trial's.
    recipe = replace(trial_config(base.to_dict(), values), run=user_run).to_dict()
    best_yaml = storage.join(sweep_dir, "best.yaml")
    storage.write_text(
        best_yaml,
        f"# The best trial of the sweep in {sweep_dir} ({sweep.metric} = {best.metrics.get(sweep.metric)}).\n"
        f"#   raytrain-loops train {best_yaml}\n" + yaml.safe_dump(recipe, sort_keys=False),
    )
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
