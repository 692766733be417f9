"""This worker's batches on Ray: Ray Data shards of Parquet splits, or the batches of map-style
splits (:mod:`raytrain_loops.data.map_style`). The loop's
:class:`~raytrain_loops.engine.loop.BatchSource`."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import numpy as np
import ray.train
import ray.train.torch

from raytrain_loops.config import Config
from raytrain_loops.data import MapBatches
from raytrain_loops.engine.length import batches_per_epoch
from raytrain_loops.tasks import MapSplit, Task

# Ray Data's iterator costs about a millisecond of Python per batch it hands out, on a thread that
# shares the GIL with training; fetching at least this many rows at a time and slicing them into
# micro-batches here keeps that cost off small-batch runs.
FETCH_ROWS = 512


def sliced(fetched: Iterable[dict[str, Any]], size: int, collate, drop_last: bool) -> Iterable[Any]:
    """Cut NumPy batches into batches of ``size`` rows, each passed through ``collate``; rows
    left over at the end of one fetched batch are joined with the next."""
    rest: dict[str, Any] | None = None
    for batch in fetched:
        if rest is not None:
            batch = {k: np.concatenate([rest[k], v]) for k, v in batch.items()}
            rest = None
        n = len(next(iter(batch.values())))
        start = 0
        while n - start >= size:
            yield collate({k: v[start : start + size] for k, v in batch.items()})
            start += size
        if start < n:
            rest = {k: v[start:] for k, v in batch.items()}
    if rest is not None and not drop_last:
        yield collate(rest)


def shuffled(fetched: Iterable[dict[str, Any]], seed: tuple[int, ...]) -> Iterable[dict[str, Any]]:
    """Permute the rows of each fetched batch (of data.shuffle_buffer rows or more) with a
    generator seeded by (seed, epoch, rank). The shard arrives in the same order every time
    (Ray Data's preserve_order), so an epoch's batches are a function of the seed alone and a
    run resumed mid-epoch continues with exactly the rows the interrupted attempt had left."""
    rng = np.random.default_rng(seed)
    for batch in fetched:
        order = rng.permutation(len(next(iter(batch.values()))))
        yield {k: v[order] for k, v in batch.items()}


class RayBatches:
    """This worker's batches of each split, per epoch, from Ray Data shards or (map-style
    splits) a :class:`~raytrain_loops.data.MapBatches`, which needs no Ray."""

    def __init__(self, task: Task, config: Config, splits: dict[str, Any], rows: dict[str, int], rank: int, world: int):
        self.task, self.data, self.seed, self.rank = task, config.data, config.loop.seed, rank
        self.has_eval = "eval" in splits
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
        stream = self._shard(split, epoch)
        return itertools.islice(stream, start, None) if start else stream

    def _shard(self, split: str, epoch: int) -> Iterable[Any]:
        shard = ray.train.get_dataset_shard(split)
        train = split == "train"
        size = self.data.batch_size if train else self.data.eval_batch_size
        window = self.data.shuffle_buffer if train else 0
        fetched = shard.iter_batches(
            batch_size=size * max(1, -(-max(FETCH_ROWS, window) // size)),
            batch_format="numpy",
            prefetch_batches=self.data.prefetch_batches,
        )
        if window:
            fetched = shuffled(fetched, (self.seed, epoch, self.rank))
        return sliced(fetched, size, self.task.collate, drop_last=train)
