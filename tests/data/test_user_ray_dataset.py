"""A split that is the user's own Ray Dataset (``DatasetSplit``, or a bare ``ray.data.Dataset``):
refused where it cannot be trained, trained locally by examples/ray_dataset.py, and on 2 Ray
workers through their ``streaming_split`` shards, an interrupted run's epoch restarted from its
first rows with the step count continued (docs/data.md, "A Ray Dataset as a split")."""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from raytrain_loops import DatasetSplit, LossOutput, Task, fit
from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.driver.preflight import DataError, dataset_rows
from raytrain_loops.engine.loop import Position
from raytrain_loops.runtime.batches import Batches

ROWS = 256
"""Rows of the test's Dataset: two Parquet files of 128."""


def _config(**scaling) -> object:
    return load_config({"data": {"batch_size": 16}, "scaling": {"num_workers": 2, **scaling}})


def test_a_dataset_split_holding_no_dataset_is_refused_naming_the_split():
    with pytest.raises(DataError, match="split 'eval': DatasetSplit's dataset is list, not a ray.data.Dataset"):
        dataset_rows(_config(), Task(), "eval", DatasetSplit([1, 2, 3]))


def test_a_dataset_epoch_cannot_be_continued_by_a_group_of_another_size():
    """Each worker's shard is Ray's streaming_split of the epoch: a group of another size has no
    part of it to continue, and says which size it can resume at. None trained: it starts afresh."""
    def source(rank: int, world: int) -> Batches:
        return Batches(Task(), _config(), {"train": DatasetSplit(None, ROWS)}, {"train": ROWS}, rank, world, "cpu", None)

    pair = [source(rank, 2) for rank in range(2)]
    assert pair[1].resume([r.record(Position(1, 3)) for r in pair]) == Position(1, 3)  # the same size continues
    with pytest.raises(ValueError, match="split 'train' is a Ray Dataset.*scaling.num_workers=2"):
        source(0, 1).resume([r.record(Position(1, 3)) for r in pair])
    assert source(0, 1).resume([r.record(Position(1, 0)) for r in pair]) == Position(1, 0)


def _ids(path: Path) -> str:
    path.mkdir(parents=True)
    for part in range(2):
        ids = np.arange(part * ROWS // 2, (part + 1) * ROWS // 2)
        pq.write_table(pa.table({"id": ids}), path / f"part-{part}.parquet")
    return str(path)


def _plus_half(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The user's own preprocessing (the Dataset's map_batches)."""
    return {"id": batch["id"], "x": batch["id"].astype(np.float32) + 0.5}


class Logged(Task):
    """A Dataset of ids read with ``ray.data.read_parquet`` and the user's own ``map_batches``; each
    trained batch's ids written to a file named by the worker's process, with the step and epoch."""

    def __init__(self, path: str = "", log: str = ""):
        self.path, self.log = path, log

    def splits(self, data_dir):
        import ray.data

        ds = ray.data.read_parquet(self.path, override_num_blocks=2).map_batches(_plus_half, batch_size=None)
        return {"train": ds, "eval": DatasetSplit(ds, rows=ROWS)}

    def collate(self, batch):
        if self.log:  # the thread that collates: the loop's own would hold up its step
            with open(os.path.join(self.log, "..", "collated_on"), "a") as f:
                f.write(threading.current_thread().name + "\n")
        return torch.as_tensor(batch["id"]), torch.as_tensor(batch["x"])

    def build_model(self):
        return nn.Linear(1, 1)

    def criterion(self, model, batch, ctx):
        ids, x = batch
        assert torch.equal(x, ids.float() + 0.5)  # the Dataset's own preprocessing ran
        if not ctx.measuring:
            with open(os.path.join(self.log, str(os.getpid())), "a") as f:
                f.write(f"{ctx.epoch} {ctx.step} {','.join(map(str, ids.tolist()))}\n")
        return LossOutput(model(x[:, None]).square().mean(), sample_size=len(ids))


    def evaluate(self, model, batch):
        ids, x = batch
        return {"x": (x.mean(), len(ids))}


def _trained(log: Path) -> dict[str, list[tuple[int, int, list[int]]]]:
    """Per worker process: (epoch, step counted before it, ids) of each batch it trained."""
    out = defaultdict(list)
    for f in log.iterdir():
        for line in f.read_text().splitlines():
            epoch, step, ids = line.split()
            out[f.name].append((int(epoch), int(step), [int(i) for i in ids.split(",")]))
    return out


@pytest.mark.ray
def test_two_workers_train_disjoint_shards_of_a_ray_dataset_and_a_resumed_epoch_starts_over(ray_session, tmp_path):
    """2 workers, 16 rows a batch, 2 epochs of 256 rows: 8 steps an epoch, 16 in all; a checkpoint
    every 4 steps, a fault after step 14. Epoch 0: the workers' rows are disjoint and cover the
    Dataset. The retried attempt resumes at step 12 (epoch 1, 4 batches in): it trains steps 13-16
    on epoch 1 read from its first rows again, so it trains the rows epoch 1's first 4 steps had
    trained, and the run ends at step 16. The eval split, the same Dataset, is evaluated whole.
    Every batch is collated on the collate-ahead thread, not the loop's."""
    log = tmp_path / "log"
    log.mkdir()
    result = fit(
        {
            "run": {"storage_path": str(tmp_path / "runs"), "max_failures": 1},
            "scaling": {"num_workers": 2},
            "loop": {"epochs": 2},
            "data": {"batch_size": 16},
            "checkpoint": {"every_steps": 4},
            "fault": {"plan": [{"step": 14, "rank": 1, "kind": "raise"}]},
            "logging": {"every_steps": 100},
        },
        task=Logged(_ids(tmp_path / "ids"), str(log)),
    )
    assert result.metrics["step"] == 16
    assert result.metrics["eval_x"] == pytest.approx(ROWS / 2)  # the mean of id + 0.5: each eval row once
    collated_on = (tmp_path / "collated_on").read_text().split()
    assert set(collated_on) == {"collate-ahead"} and len(collated_on) >= 16 + 2 * ROWS // 16, collated_on[:5]
    trained = _trained(log)
    first = {pid: b for pid, b in trained.items() if any(epoch == 0 for epoch, _, _ in b)}
    second = {pid: b for pid, b in trained.items() if pid not in first}
    assert len(first) == 2 and len(second) == 2
    epoch0 = [sorted(i for epoch, _, ids in b if epoch == 0 for i in ids) for b in first.values()]
    assert [len(rows) for rows in epoch0] == [ROWS // 2] * 2 and not set(epoch0[0]) & set(epoch0[1])
    assert sorted(epoch0[0] + epoch0[1]) == list(range(ROWS))
    steps = [sorted(step for _, step, _ in b) for b in second.values()]
    assert steps == [[12, 13, 14, 15]] * 2  # steps 13-16: the count continues from the checkpoint
    again = [{i for _, _, ids in b for i in ids} for b in second.values()]
    assert not again[0] & again[1]
    before = {i for b in first.values() for epoch, step, ids in b if epoch == 1 and step < 12 for i in ids}
    assert again[0] | again[1] == before and len(before) == 2 * 4 * 16  # epoch 1's first rows, trained twice


@pytest.mark.ray
def test_the_ray_dataset_example_trains_locally_and_a_dataset_the_run_cannot_train_is_refused(ray_session, tmp_path):
    """examples/ray_dataset.py in local mode (the Dataset iterated in the driver's process), one
    epoch; then its Dataset refused beside a task with preprocess, and in an elastic group."""
    from examples.parquet_task import TableTask
    from examples.ray_dataset import DatasetTask, main

    data = tmp_path / "my_data"
    main(["--make-data", str(data)])
    result = main(["--data", str(data), "--local", "--epochs", "1", "--storage-path", str(tmp_path / "runs")])
    assert result.metrics["step"] == 4096 // 64 and result.metrics["eval_accuracy"] > 0.9
    split = DatasetTask(str(data), [0.0] * 16, [1.0] * 16).splits(data)["train"]
    with pytest.raises(DataError, match="split 'train' is a Ray Dataset, to which TableTask.preprocess is not applied"):
        dataset_rows(_config(), TableTask(str(data), [0.0] * 16, [1.0] * 16), "train", split)
    with pytest.raises(ConfigError, match="scaling.min_workers"):
        dataset_rows(_config(min_workers=1), Task(), "train", split)
    assert dataset_rows(_config(), Task(), "train", DatasetSplit(split.dataset, rows=7)) == 7  # rows= skips the count
