"""Checkpoint retention with ``checkpoint.score_metric``: Ray's own checkpoint manager, given the
run's CheckpointConfig, always leaves the newest checkpoint and the one before it; the best by
the metric are kept in ``best/``, and a report without the metric is never the best."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from ray.train import Checkpoint
from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
from ray.train.v2._internal.execution.storage import StorageContext
from ray.train.v2._internal.execution.training_report import _TrainingReport

from raytrain_loops.checkpoint import files as ckpt
from raytrain_loops.checkpoint.ray_keep_best import KeepBest
from raytrain_loops.config import load_config
from raytrain_loops.driver.trainer import run_config

# (step, the metric in that report or None): the first report comes before any evaluation.
REPORTS = [(6, None), (12, 0.5), (18, 0.7), (24, 0.6), (30, 0.8), (36, None)]


def _checkpoint(run: Path, step: int) -> Path:
    d = run / f"checkpoint_{step:08d}"
    ckpt.write_files(d, 0, {ckpt.STATE: {"step": step}, ckpt.rank_file(0): {}}, 1)
    return d


def _metrics(step: int, value: float | None) -> dict:
    return {"step": step, **({"eval_loss": value, "evaluated_step": step} if value is not None else {})}


@pytest.mark.parametrize("mode", ["min", "max"])
def test_rays_retention_always_leaves_the_newest_and_the_one_before(tmp_path, mode):
    config = load_config(
        None, ["checkpoint.keep=2", "checkpoint.score_metric=eval_loss", f"checkpoint.score_mode={mode}"]
    )
    config.run.storage_path = str(tmp_path)
    manager = CheckpointManager(run_config(config, "run").checkpoint_config, StorageContext(str(tmp_path), "run"))
    run = tmp_path / "run"

    async def report_all():
        for i, (step, value) in enumerate(REPORTS):
            report = _TrainingReport(Checkpoint(str(_checkpoint(run, step))), _metrics(step, value), validation=False)
            manager.register_checkpoint(report)
            present = sorted(ckpt.step_of(p.name) for p in run.glob("checkpoint_0*"))
            assert present[-2:] == [s for s, _ in REPORTS[max(i - 1, 0) : i + 1]], (step, present)

    asyncio.run(report_all())
    # The metric-less first checkpoint is gone: it was never counted as the best.
    assert sorted(p.name for p in run.glob("checkpoint_0*")) == ["checkpoint_00000030", "checkpoint_00000036"]


@pytest.mark.parametrize("mode,best", [("min", [12, 24]), ("max", [30, 18])])
def test_the_best_checkpoints_by_the_metric_are_kept_in_best(tmp_path, mode, best):
    run = tmp_path / "run"
    keeper = KeepBest(str(run), "eval_loss", mode, keep=2)
    for step, value in REPORTS:
        keeper.after_report(None, [_metrics(step, value), {}], Checkpoint(str(_checkpoint(run, step))))
    ranked = json.loads((run / "best" / "best.json").read_text())
    assert [e["step"] for e in ranked] == best  # best first; the metric-less 6 and 36 never in it
    assert [e["path"] for e in ranked] == [str(run / "best" / f"checkpoint_{s:08d}") for s in best]
    assert sorted(p.name for p in (run / "best").iterdir()) == sorted(
        ["best.json", *(f"checkpoint_{s:08d}" for s in best)]
    )
    for s in best:  # whole checkpoints, linked (no bytes copied)
        copy = run / "best" / f"checkpoint_{s:08d}"
        assert (
            ckpt.verify(copy) == 1
            and (copy / ckpt.STATE).stat().st_ino == (run / f"checkpoint_{s:08d}" / ckpt.STATE).stat().st_ino
        )


def test_with_keep_all_the_best_are_ranked_in_place(tmp_path):
    run = tmp_path / "run"
    keeper = KeepBest(str(run), "eval_loss", "min", keep=0)
    for step, value in REPORTS:
        keeper.after_report(None, [_metrics(step, value)], Checkpoint(str(_checkpoint(run, step))))
    ranked = json.loads((run / "best" / "best.json").read_text())
    assert [(e["step"], e["path"]) for e in ranked] == [(s, str(run / f"checkpoint_{s:08d}")) for s in (12, 24, 18, 30)]
    assert [p.name for p in (run / "best").iterdir()] == ["best.json"]


def test_a_checkpoint_whose_report_carries_an_earlier_evaluation_is_not_ranked(tmp_path):
    # checkpoint.every_steps=10, eval.every_steps=20: the report of step 10 carries step 0's
    # evaluation (every report carries the latest), which says nothing of step 10's weights.
    run = tmp_path / "run"
    keeper = KeepBest(str(run), "eval_loss", "min", keep=2)
    keeper.after_report(
        None, [{"step": 10, "evaluated_step": 0, "eval_loss": 0.1}], Checkpoint(str(_checkpoint(run, 10)))
    )
    keeper.after_report(
        None, [{"step": 20, "evaluated_step": 20, "eval_loss": 0.4}], Checkpoint(str(_checkpoint(run, 20)))
    )
    ranked = json.loads((run / "best" / "best.json").read_text())
    assert [e["step"] for e in ranked] == [20]
