"""This worker's batches on Ray: Parquet splits in the epoch's order of
:mod:`raytrain_loops.data.parquet` (read on a background thread of this worker, or, for a task
with :meth:`~raytrain_loops.tasks.Task.preprocess`, read and preprocessed by Ray Data tasks on the
cluster's CPUs), or the batches of map-style splits (:mod:`raytrain_loops.data.map_style`). The
loop's :class:`~raytrain_loops.engine.loop.BatchSource`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import ray.train
import ray.train.torch

from raytrain_loops.config import Config
from raytrain_loops.data import MapBatches
from raytrain_loops.data.parquet import (
    ROW_SEED,
    Reader,
    WorkerPlan,
    eval_plan,
    prefetched,
    read_window,
    sliced,
    train_plan,
    windows_from,
)
from raytrain_loops.engine.length import batches_per_epoch
from raytrain_loops.tasks import MapSplit, ParquetSplit, Task, has_preprocess


class RayBatches:
    """This worker's batches of each split, per epoch: Parquet splits by the epoch's plan, map-style
    splits by a :class:`~raytrain_loops.data.MapBatches`, which needs no Ray."""

    def __init__(self, task: Task, config: Config, splits: dict[str, Any], rows: dict[str, int], rank: int, world: int):
        self.task, self.data, self.seed, self.rank, self.world = task, config.data, config.loop.seed, rank, world
        self.has_eval = "eval" in splits
        self.parquet = {name: split for name, split in splits.items() if isinstance(split, ParquetSplit)}
        maps = {name: split for name, split in splits.items() if isinstance(split, MapSplit)}
        # Pinned batches on a GPU worker, so the engine's non_blocking copies are asynchronous.
        device = ray.train.torch.get_device()
        self.maps = MapBatches(maps, config.data, config.loop.seed, rank, world, device)
        if "train" in maps:  # a DistributedSampler's padded shares, or the split's batch sampler
            self.batches_per_epoch = self.maps.batches_per_epoch
        else:
            self.batches_per_epoch = batches_per_epoch(rows["train"], world, self.data.batch_size)

    def batches(self, split: str, epoch: int, start: int = 0) -> Iterable[Any]:
        if split in self.maps.splits:
            return self.maps.batches(split, epoch, start)
        train = split == "train"
        size = self.data.batch_size if train else self.data.eval_batch_size
        index = self.parquet[split].index
        if train:
            plan = train_plan(
                index, self.seed, epoch, self.world, self.rank, self.data.shuffle_chunk_rows, self.data.shuffle_buffer
            )
        else:
            plan = eval_plan(index, self.world, self.rank)
        if has_preprocess(self.task):
            fetched = preprocessed(self.task, self.data, plan, index, start * size, (self.seed, epoch), train)
        else:
            # One window read ahead on a background thread while the step runs (pyarrow releases the GIL).
            fetched = prefetched(_read(index, plan, start * size), min(1, self.data.prefetch_batches))
        return sliced(fetched, size, self.task.collate, drop_last=train)


def _read(index: Any, plan: WorkerPlan, start_row: int) -> Iterator[dict[str, Any]]:
    reader = Reader(index)
    try:
        yield from windows_from(reader, plan, start_row)
    finally:
        reader.close()


def _read_and_preprocess(
    ids: dict[str, np.ndarray],
    *,
    task: Task,
    index: Any,
    plan: WorkerPlan,
    first: int,
    skip: int,
    seeds: tuple[int, int],
    rows: int,
    train: bool,
) -> Iterator[dict[str, np.ndarray]]:
    """A Ray Data task's work: read window ``first + id`` of ``plan`` and preprocess its rows
    ``rows`` at a time (``skip``: rows of the first window already trained on; ``train``: the
    train split's rows)."""
    reader = Reader(index)
    try:
        for w in (first + int(i) for i in ids["id"]):
            batch = read_window(reader, plan, w, skip if w == first else 0, seeds)
            for lo in range(0, len(batch[ROW_SEED]), rows):
                yield _preprocess_part(task, {k: v[lo : lo + rows] for k, v in batch.items()}, train)
    finally:
        reader.close()


def _preprocess_part(task: Task, part: dict[str, np.ndarray], train: bool) -> dict[str, np.ndarray]:
    """``task.preprocess`` of ``part``, checked to give one row per row, without the row seeds."""
    out = task.preprocess(part, train=train)
    got = {k: len(v) for k, v in out.items()}
    if set(got.values()) != {len(part[ROW_SEED])}:
        raise ValueError(
            f"{type(task).__name__}.preprocess must map each row to one row: {len(part[ROW_SEED])} rows in, "
            f"column lengths out {got}"
        )
    out.pop(ROW_SEED, None)
    return out


def preprocessed(
    task: Task, data: Any, plan: WorkerPlan, index: Any, start_row: int, seeds: tuple[int, int], train: bool
) -> Iterable[dict[str, Any]]:
    """The plan's windows from ``start_row`` on, read and passed through ``task.preprocess`` by
    Ray Data tasks (``data.preprocess``: CPUs each, how many at once) wherever the cluster has
    CPUs, streamed to this worker in the plan's order."""
    import ray.data

    first, skip = plan.locate(start_row)
    count = plan.windows - first
    if count <= 0:
        return []
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # the plan's order, whichever task finishes first
    context.enable_progress_bars = False  # they would interleave with the training progress lines
    p = data.preprocess
    ds = ray.data.range(count, override_num_blocks=count).map_batches(
        _read_and_preprocess,
        batch_size=1,
        fn_kwargs={
            "task": task,
            "index": index,
            "plan": plan,
            "first": first,
            "skip": skip,
            "seeds": seeds,
            "rows": p.batch_rows,
            "train": train,
        },
        num_cpus=p.num_cpus,
        compute=ray.data.TaskPoolStrategy(size=p.concurrency or None),
    )
    return ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=data.prefetch_batches)
