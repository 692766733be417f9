"""A digits task that records which rows every micro-batch held, for the recovery tests."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from raytrain_loops.data.parquet import ROW_SEED
from raytrain_loops.errors import TrainingError
from raytrain_loops.tasks import DigitsTask, ParquetSplit
from raytrain_loops.tasks.digits import write_digits_parquet


class RecordingDigits(DigitsTask):
    """Digits with a row ``id`` column; the criterion appends {step, micro, epoch, ids} to
    ``record_dir/ids.rank<r>.jsonl`` (a restarted attempt appends again: the last record of a
    step is the one that counted)."""

    def __init__(self, record_dir: str, **params):
        super().__init__(**params)
        self.record_dir = record_dir

    def prepare(self, data_dir: Path) -> None:
        paths = write_digits_parquet(data_dir / "digits")
        out = data_dir / "digits-ids" / "train.parquet"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            table = pq.read_table(paths["train"])
            pq.write_table(table.append_column("id", [np.arange(table.num_rows)]), out)

    def splits(self, data_dir: Path) -> dict[str, ParquetSplit]:
        return {
            "train": ParquetSplit(str(data_dir / "digits-ids" / "train.parquet"), ["image", "label", "id"]),
            "eval": super().splits(data_dir)["eval"],
        }

    def collate(self, batch):
        x, y = super().collate(batch)
        if "id" not in batch:
            return x, y
        # Which processes preprocessed the rows (PreprocessedDigits), and which one trains on them.
        pids = sorted(set(batch["pre_pid"].tolist())) if "pre_pid" in batch else []
        return x, y, torch.tensor(batch["id"]), {"pre_pids": pids, "pid": os.getpid()}

    def criterion(self, model, batch, ctx):
        x, y, ids, pids = batch
        if ctx.measuring:  # the throughput callback's FLOP count: not a micro-batch of the run
            return super().criterion(model, (x, y), ctx)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        record = {"step": ctx.step + 1, "micro": ctx.micro_index, "epoch": ctx.epoch, "ids": ids.tolist(), **pids}
        with open(os.path.join(self.record_dir, f"ids.rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        return super().criterion(model, (x, y), ctx)


class PreprocessedDigits(RecordingDigits):
    """Recording digits whose rows are preprocessed in Ray tasks: training images get noise
    drawn from each row's seed (an augmentation), and every row notes the process that
    preprocessed it (``pre_pid``)."""

    def preprocess(self, batch, train):
        images = np.stack(batch["image"]).astype(np.float32)
        if train:
            for i, seed in enumerate(batch[ROW_SEED]):
                images[i] += np.random.default_rng(int(seed)).normal(0.0, 0.5, images.shape[1]).astype(np.float32)
        out = {**{k: v for k, v in batch.items() if k != ROW_SEED}, "image": images}
        return {**out, "pre_pid": np.full(len(images), os.getpid())}


def restored(run_dir: str | Path) -> dict:
    """What the run's latest start restored, as rank 0 recorded it (``init.json``): the checkpoint,
    the ones skipped and why, the world that wrote it."""
    return json.loads(Path(run_dir, "init.json").read_text())


def counted_batches(record_dir: Path) -> dict[tuple[int, int, int], dict]:
    """(rank, step, micro) -> the last record of it: what the run's final trajectory used."""
    out = {}
    for path in sorted(record_dir.glob("ids.rank*.jsonl")):
        rank = int(path.stem.removeprefix("ids.rank"))
        for line in path.read_text().splitlines():
            r = json.loads(line)
            r.pop("pid"), r.pop("pre_pids")  # processes differ from run to run
            out[(rank, r["step"], r["micro"])] = r
    return out


def batch_processes(record_dir: Path) -> list[tuple[int, list[int]]]:
    """Per recorded micro-batch: the training process, and the processes that preprocessed its rows."""
    out = []
    for path in sorted(record_dir.glob("ids.rank*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            out.append((r["pid"], r["pre_pids"]))
    return out


class StopsAlone(RecordingDigits):
    """Recording digits whose criterion raises a :class:`TrainingError` on worker ``stop_rank``
    alone at step ``stop_step`` (counted from 0), once, noting the time in ``record_dir/stopped``."""

    def __init__(self, record_dir: str, stop_step: int, stop_rank: int = 1, **params):
        super().__init__(record_dir, **params)
        self.stop_step, self.stop_rank = stop_step, stop_rank

    def criterion(self, model, batch, ctx):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        marker = Path(self.record_dir) / "stopped"
        if not ctx.measuring and rank == self.stop_rank and ctx.step == self.stop_step and not marker.exists():
            marker.write_text(repr(time.time()))
            raise TrainingError(f"worker {rank} alone decided to stop")
        return super().criterion(model, batch, ctx)
