"""The same run, anywhere: a local run continues on Ray from its checkpoint and that Ray run
continues locally, ending with the weights of an uninterrupted run at the same world size (one
worker); the one-worker Ray attempt trains on the local run's batches, batch for batch, on a
Parquet split whose rows are preprocessed (in Ray tasks on Ray, in the process locally)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from raytrain_loops import fit
from raytrain_loops.checkpoint import files as ckpt
from tests.support.recording import counted_batches, restored

pytestmark = pytest.mark.ray

# 1347 rows / 32 per batch: 42 steps an epoch on one worker; 2 epochs, checkpoints every 21 steps.
# Interrupted after step 22 and after step 64 by exceptions the fault plan raises once each (a fault
# fires before its step's report): local to 22, on Ray from the checkpoint at 21 (mid epoch 0) to 64,
# across the epoch's end and an evaluation, then local again from the checkpoint at 63 (mid epoch 1).
STEPS, CUTS = 84, (22, 64)


def _config(tmp_path: Path, name: str, workers: int, interrupted: bool = True) -> dict:
    record = tmp_path / "records" / name
    record.mkdir(parents=True, exist_ok=True)
    return {
        "task": {"name": "tests.support.recording:PreprocessedDigits", "params": {"record_dir": str(record), "width": 16}},
        "loop": {"epochs": 2, "seed": 3},
        "data": {"dir": str(tmp_path / "data"), "batch_size": 32, "shuffle_buffer": 256, "shuffle_chunk_rows": 64},
        "optim": {"name": "adamw"},
        "schedules": {"lr": {"kind": "cosine", "value": 3e-3, "end": 1e-5, "warmup_steps": 10}},
        "eval": {"every_steps": 42},
        "checkpoint": {"every_steps": 21},
        "scaling": {"num_workers": workers},
        "logging": {"every_steps": 21},
        "run": {
            "name": name,
            "storage_path": str(tmp_path / "runs"),
            "progress": False,
            "report_every_steps": 21,
            "coalesce_reports": False,  # the checkpoint at the cut, however slowly Ray takes reports
        },
        "fault": {"plan": [{"step": cut, "kind": "raise"} for cut in CUTS] if interrupted else []},
    }


def _weights(result) -> dict[str, torch.Tensor]:
    return ckpt.read_file(result.checkpoint, ckpt.STATE)["model"]


def _batches(tmp_path: Path, name: str) -> dict:
    return counted_batches(tmp_path / "records" / name)


def test_a_local_run_continues_on_ray_and_the_ray_run_locally_with_an_uninterrupted_runs_weights(ray_session, tmp_path):
    reference = fit(_config(tmp_path, "whole", 0, interrupted=False))
    assert reference.metrics["step"] == STEPS

    run_dir = tmp_path / "runs" / "anywhere"

    with pytest.raises(RuntimeError, match=rf"fault\.plan\[0\] after step {CUTS[0]}"):
        fit(_config(tmp_path, "anywhere", 0))  # raised here, in this process
    with pytest.raises(Exception, match=rf"fault\.plan\[1\] after step {CUTS[1]}"):
        fit(_config(tmp_path, "anywhere", 1))
    assert Path(restored(run_dir)["checkpoint"]).name == "checkpoint_00000021"  # on Ray, from the local run's checkpoint
    result = fit(_config(tmp_path, "anywhere", 0))
    assert Path(restored(run_dir)["checkpoint"]).name == "checkpoint_00000063"  # locally, from the Ray attempt's

    # Batch for batch: the rows of every step, local, on Ray and local again.
    expected = _batches(tmp_path, "whole")
    assert len(expected) == STEPS and {k[1] for k in expected} == set(range(1, STEPS + 1))
    assert _batches(tmp_path, "anywhere") == expected
    whole = _weights(reference)
    assert result.metrics["step"] == STEPS
    got = _weights(result)
    assert got.keys() == whole.keys() and all(torch.equal(got[k], whole[k]) for k in whole), result.run_dir
    # The evaluations agree too (on the eval split, preprocessed without augmentation): at step 42
    # on Ray and at 84 locally, as in the uninterrupted run.
    assert result.metrics["eval_loss"] == reference.metrics["eval_loss"]
    evaluations = (run_dir / "eval.jsonl").read_text()
    assert [json.loads(line)["step"] for line in evaluations.splitlines()] == [42, 84]
    assert evaluations == (tmp_path / "runs" / "whole" / "eval.jsonl").read_text()
    # The Ray attempt's checkpoint records where its rows were preprocessed (Ray tasks, on its node).
    record = ckpt.read_file(run_dir / "checkpoint_00000063", ckpt.rank_file(0))
    assert set(record["preprocessed_on"]) == {record["node_id"]} and sum(record["preprocessed_on"].values()) > 0, record
