"""An epoch finished by groups of other sizes, end to end through the real loop, without Ray: a
local run (one worker) interrupted at half of its first epoch, continued by a group of two gloo
processes (the same wiring as a Ray worker, checkpoints written by every worker), which stops
after 7 of its 10 steps, and finished locally. Every row of the epoch is trained once, and what
is missing is exactly what the last re-cut part drops; the next epoch is the local plan's own."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from raytrain_loops import fit
from raytrain_loops.checkpoint import files as ckpt
from raytrain_loops.checkpoint.reporter import CheckpointReporter
from raytrain_loops.checkpoint.restore import candidates
from raytrain_loops.config import load_config
from raytrain_loops.console.feed import Sender
from raytrain_loops.driver.preflight import prepare
from raytrain_loops.engine.distributed import collectives
from raytrain_loops.engine.loop import Callback
from raytrain_loops.runtime.batches import Batches, preprocessed_here
from raytrain_loops.runtime.wiring import WorkerPayload, wire
from tests.support.gloo import run_gloo
from tests.support.recording import counted_batches

# Digits: 1347 training rows, 32 a batch. One worker: 42 steps an epoch; interrupted after step 22,
# it resumes from its checkpoint at step 21 (672 rows trained). Two workers then share the 675 rows
# left (337 each, 10 batches), and stop after step 28 (7 steps, 224 rows each). One worker finishes
# the epoch on the 227 rows left: 7 batches, 3 rows dropped.
ROWS, CUT, STOP = 1347, 21, 28


def _config(tmp_path: Path) -> dict:
    return {
        "task": {
            "name": "tests.support.recording:PreprocessedDigits",
            "params": {"record_dir": str(tmp_path / "records"), "width": 16},
        },
        "loop": {"epochs": 2, "seed": 3},
        "data": {"dir": str(tmp_path / "data"), "batch_size": 32, "shuffle_buffer": 256, "shuffle_chunk_rows": 64},
        "optim": {"name": "adamw"},
        "checkpoint": {"every_steps": 7},
        "logging": {"every_steps": 7},
        "scaling": {"num_workers": 0},
        "run": {"name": "recut", "storage_path": str(tmp_path / "runs"), "progress": False},
        "fault": {"plan": [{"step": CUT + 1, "kind": "raise"}]},
    }


class _Stopped(Exception):
    pass


class _StopBefore(Callback):
    """Ends the run on every worker right before update ``step`` + 1 (after step ``step``'s checkpoint)."""

    def __init__(self, step: int):
        self.step = step

    def before_step(self, step, micro_batches):
        if step == self.step:
            raise _Stopped


class _GroupReporter(CheckpointReporter):
    """A gloo group's checkpoints in the run directory, as Ray lays them out: every worker's files
    in the directory rank 0 names."""

    def report(self, metrics, checkpoint):
        if checkpoint is None:
            return
        name = collectives.all_gather_object(self._dir_name())[0]
        tmp = self._write(checkpoint, None)
        shutil.copytree(tmp, os.path.join(self.run_dir, name), dirs_exist_ok=True)
        shutil.rmtree(tmp)
        collectives.all_gather_object(None)  # every worker's files are in place

    def restore(self, init_checkpoint=None):
        return self.restore_from(candidates(self.run_dir, None), init_checkpoint)


def _group(rank: int, world: int, payload: WorkerPayload) -> dict:
    """Worker ``rank`` of a gloo group resuming ``payload``'s run, stopped after step STOP."""
    wired = wire(
        payload,
        rank,
        world,
        torch.device("cpu"),
        Sender(None),
        prepare_model=lambda module, task, config: (DistributedDataParallel(module), None),
        batches=functools.partial(_batches, device=None),
        reporter=functools.partial(_GroupReporter, rank=rank, world=world, run_dir=payload.run_dir),
    )
    start = wired.engine.step
    wired.loop.callbacks.append(_StopBefore(STOP))
    with contextlib.suppress(_Stopped):
        wired.loop.run(wired.position)
    return {"start": start, "position": (wired.position.epoch, wired.position.batches), "step": wired.engine.step}


def _batches(task, config, splits, rows, rank, world, device):
    return Batches(task, config, splits, rows, rank, world, device, preprocessed_here)


def test_an_epoch_continued_by_two_gloo_workers_and_finished_locally_trains_every_row_once(tmp_path):
    config = _config(tmp_path)
    (tmp_path / "records").mkdir()
    with pytest.raises(RuntimeError, match=rf"fault\.plan\[0\] after step {CUT + 1}"):
        fit(config)
    (run_dir,) = (tmp_path / "runs").iterdir()

    # Two workers, as a Ray group of two would get the run (prepared once, here).
    two = load_config({**config, "scaling": {"num_workers": 2}, "fault": {"plan": []}})
    payload = WorkerPayload(two, *prepare(two, None), str(run_dir), stops=None)
    outcomes = run_gloo(2, _group, payload)
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message + outcomes[1].message
    # The loop's position: the steps left in the epoch are the two-worker part's (10 of 21).
    assert [o.value for o in outcomes] == [{"start": CUT, "position": (0, 11), "step": STOP}] * 2
    data = ckpt.read_file(run_dir / f"checkpoint_{STOP:08d}", ckpt.rank_file(1))["data"]
    assert data == {
        "epoch": 0,
        "batches": 18,
        "rows": 224,
        "deal": {"world": 1, "recuts": [{"world": 2, "rows": [672]}]},
    }

    result = fit(config)
    assert result.metrics["step"] == 84  # the run's length at one worker: the re-cut epoch held 35 steps
    records = counted_batches(tmp_path / "records")
    by_epoch: dict[int, list[int]] = {}
    for r in records.values():
        by_epoch.setdefault(r["epoch"], []).extend(r["ids"])
    first = np.bincount(by_epoch[0], minlength=ROWS)
    assert (first > 1).sum() == 0 and (first == 0).sum() == 3  # the last part's 227 rows: 7 batches, 3 left
    assert sorted(r["step"] for r in records.values() if r["epoch"] == 0) == sorted(
        [*range(1, 22), *range(22, 29), *range(22, 29), *range(29, 36)]
    )
    second = np.bincount(by_epoch[1], minlength=ROWS)
    assert (second > 1).sum() == 0 and (second == 0).sum() == ROWS % 32  # one worker's own plan
