"""One worker's batches of a run's splits, without Ray: Parquet splits in the epoch's order of
:mod:`raytrain_loops.data.parquet`, map-style splits by :class:`~raytrain_loops.data.MapBatches`.
The loop's :class:`~raytrain_loops.engine.loop.BatchSource` for a Ray worker
(:mod:`raytrain_loops.worker.preprocessing`, which hands a task's ``preprocess`` to Ray tasks) and for a
local run (which applies it in its own process, :func:`preprocessed_here`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.pin_memory import pin_memory

from raytrain_loops.config import Config
from raytrain_loops.config.run import DataConfig
from raytrain_loops.data.map_style import MapBatches
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
from raytrain_loops.data.recut import Deal, RecutPlan, data_record, recut_plan, resume_point
from raytrain_loops.engine.devices import pins
from raytrain_loops.engine.length import accum_steps, batches_per_epoch, epochs_in_run, steps_in_epoch
from raytrain_loops.engine.loop import Position
from raytrain_loops.streams import close
from raytrain_loops.tasks import DatasetSplit, MapSplit, ParquetSplit, Task, has_preprocess, set_up_once

Plan = WorkerPlan | RecutPlan
"""One worker's rows of an epoch: its own share, or its part of a re-cut epoch."""

# (task, data, plan, index, start_row, (seed, epoch), train, ahead) -> the plan's preprocessed rows from
# start_row on; ``ahead``: the train split's plans of the epochs that follow (an executor may work ahead
# into them), None for an evaluation
Preprocessing = Callable[..., Iterable[dict[str, Any]]]


@dataclass(frozen=True)
class EpochPlans:
    """One worker's plans of the train split for the epochs after the one a stream starts in, up to
    ``last``: what a long-lived executor reads ahead into."""

    index: Any
    seed: int
    world: int
    rank: int
    chunk_rows: int
    buffer: int
    last: int

    def __call__(self, epoch: int) -> WorkerPlan:
        return train_plan(self.index, self.seed, epoch, self.world, self.rank, self.chunk_rows, self.buffer)


@dataclass(frozen=True)
class _Resumed:
    """The epoch a group of another size resumed: its ``deal``, this worker's ``part`` of it (a
    :class:`~raytrain_loops.data.recut.RecutPlan`, or map-style batches), the position ``row``
    in the part where it resumed, and ``virtual``, the loop's batch count there."""

    epoch: int
    deal: Deal
    part: Any
    row: int
    virtual: int


class Batches:
    """This worker's batches of each split, per epoch: Parquet splits by the epoch's plan (read on
    a background thread, or through ``preprocessing`` for a task with ``preprocess``), map-style
    splits by a :class:`~raytrain_loops.data.MapBatches`. ``device``: where the batches go (pinned
    on a CUDA device).

    The data positions a checkpoint records (:meth:`record`) and resumes from (:meth:`resume`)
    are rows in the deal the epoch runs on (:mod:`raytrain_loops.data.recut`): a group of another
    size finishes the epoch on the rows not yet trained, re-cut over its workers."""

    def __init__(
        self,
        task: Task,
        config: Config,
        splits: dict[str, Any],
        rows: dict[str, int],
        rank: int,
        world: int,
        device: torch.device | str | None,
        preprocessing: Preprocessing,
    ):
        self.task, self.data, self.seed, self.rank, self.world = task, config.data, config.loop.seed, rank, world
        self.accum, self.scale = config.accum, config.scaling.workers / world  # the loop's micro-batches per update
        self.preprocessing = preprocessing
        self.pin = pins(device)  # a CUDA worker's Parquet batches pinned after collate, as map-style ones are
        self.device = torch.device(device) if device is not None else None
        self.has_eval = "eval" in splits
        self.parquet = {name: split for name, split in splits.items() if isinstance(split, ParquetSplit)}
        maps = {name: split for name, split in splits.items() if isinstance(split, MapSplit)}
        # A Ray Dataset's shard (a worker's) or the Dataset itself (a local run): read as it streams.
        self.datasets = {name: split.dataset for name, split in splits.items() if isinstance(split, DatasetSplit)}
        self.maps = MapBatches(maps, config.data, config.loop.seed, rank, world, device)
        self.resumed: _Resumed | None = None
        if "train" in maps:  # a DistributedSampler's padded shares, or the split's batch sampler
            self.batches_per_epoch = self.maps.batches_per_epoch
        else:
            self.batches_per_epoch = batches_per_epoch(rows["train"], world, self.data.batch_size)
        self.last_epoch = epochs_in_run(config.loop, config.accum, self.batches_per_epoch, self.scale) - 1

    def close(self) -> None:
        """End what the batch source keeps between epochs (an executor working ahead)."""
        close(self.preprocessing)

    def batches(self, split: str, epoch: int, start: int = 0) -> Iterable[Any]:
        r = self.resumed if split == "train" and self.resumed and self.resumed.epoch == epoch else None
        if split in self.maps.splits:
            if r is not None:
                return self.maps.batches(split, epoch, _batches_in(r.part, r.row) + start - r.virtual, rows=r.part)
            return self.maps.batches(split, epoch, start)
        train = split == "train"
        size = self.data.batch_size if train else self.data.eval_batch_size
        collate = _pinning(self.task.collate, self.device) if self.pin else self.task.collate
        if split in self.datasets:  # the epoch from its first rows, whatever ``start`` (docs/data.md)
            batches = self.datasets[split].iter_batches(
                batch_size=size, batch_format="numpy", drop_last=train, prefetch_batches=self.data.prefetch_batches
            )
            return self._ahead(_collated(batches, collate))
        index = self.parquet[split].index
        start_row = start * size
        if r is not None:
            plan, start_row = r.part, r.row + (start - r.virtual) * size
        elif train:
            plan = train_plan(
                index, self.seed, epoch, self.world, self.rank, self.data.shuffle_chunk_rows, self.data.shuffle_buffer
            )
        else:
            plan = eval_plan(index, self.world, self.rank)
        if has_preprocess(self.task):
            ahead = None
            if train:
                d = self.data
                ahead = EpochPlans(index, self.seed, self.world, self.rank, d.shuffle_chunk_rows, d.shuffle_buffer, self.last_epoch)
            fetched = self.preprocessing(self.task, self.data, plan, index, start_row, (self.seed, epoch), train, ahead)
        else:  # read here, one window ahead on a thread (pyarrow releases the GIL)
            fetched = prefetched(_read(index, plan, start_row), min(1, self.data.prefetch_batches))
        return self._ahead(sliced(fetched, size, collate, drop_last=train), fetched)

    def _ahead(self, batches: Iterable[Any], rows: Any = None) -> Iterator[Any]:
        """``batches`` made (cut, collated, pinned, and what they wait for: a window's read, a Ray
        Data execution's next block) on a thread of their own, ``data.prefetch_batches`` ahead, so
        that the loop's thread only takes them while the device runs (docs/data.md, "Batches ready
        ahead"); 0: made in the loop's thread. ``rows`` (what the batches are cut from) may say when
        the loop waits (``wanted``: an execution's bounds count then) and how to end the thread's
        wait when the loop closes the stream (``interrupt``)."""
        return prefetched(
            batches,
            self.data.prefetch_batches,
            name="collate-ahead",
            waiting=getattr(rows, "wanted", None),
            interrupt=getattr(rows, "interrupt", None),
        )

    def record(self, position: Position) -> dict[str, Any]:
        """What a checkpoint records of this worker's data at the loop's ``position``: the epoch,
        the loop's batch count, the position in rows in this worker's part of the epoch's deal,
        and the deal."""
        epoch, batches = position.epoch, position.batches
        r = self.resumed if self.resumed and self.resumed.epoch == epoch else None
        if r is not None:
            consumed = batches - r.virtual
            if isinstance(r.part, list):  # map-style batches
                rows = _rows_in(r.part, _batches_in(r.part, r.row) + consumed)
            else:
                rows = r.row + consumed * self.data.batch_size
            return data_record(epoch, batches, rows, r.deal)
        if "train" in self.maps.splits and self.maps.sampler is not None and batches:
            rows = _rows_in(self.maps.train_batches(epoch), batches)  # a batch sampler's batches may differ in size
        else:
            rows = batches * self.data.batch_size
        return data_record(epoch, batches, rows, Deal(self.world))

    def resume(self, records: Sequence[Any] | None) -> Position:
        """The loop's position to resume from a checkpoint whose workers wrote ``records`` (one
        per worker, :meth:`record`). A group of the same size continues its own part; a group of
        another size takes its part of the epoch's rows not yet trained, and the position is then
        the loop's count of batches such that the steps left in the epoch are the part's (its
        batches // micro-batches per update): the loop itself is unchanged. ``records`` None:
        nothing to resume (a checkpoint whose load failed after this was called), the beginning."""
        self.resumed = None
        if records is None:
            return Position()
        at = resume_point(records, self.world, self.rank, self.data.batch_size)
        if at.batches is not None:  # this group's own plan, as it was dealt
            return Position(at.epoch, at.batches)
        if "train" in self.datasets:
            raise ValueError(
                f"split 'train' is a Ray Dataset, whose epoch {at.epoch} a group of {self.world} workers cannot "
                f"continue from the checkpoint of {len(records)}: resume with scaling.num_workers={len(records)}"
            )
        if "train" in self.maps.splits:
            part = self.maps.dealt(at.epoch, at.deal)
            left = len(part) - _batches_in(part, at.row)
        else:
            d = self.data
            part = recut_plan(
                self.parquet["train"].index,
                self.seed,
                at.epoch,
                d.shuffle_chunk_rows,
                d.shuffle_buffer,
                at.deal,
                self.rank,
            )
            left = (part.rows - at.row) // d.batch_size
        k = accum_steps(self.accum, at.epoch, self.scale)
        steps = steps_in_epoch(self.accum, self.batches_per_epoch, at.epoch, self.scale)
        virtual = (steps - min(steps, left // k)) * k
        self.resumed = _Resumed(at.epoch, at.deal, part, at.row, virtual)
        return Position(at.epoch, virtual)


def _pinning(collate: Callable[[dict[str, Any]], Any], device: torch.device) -> Callable[[dict[str, Any]], Any]:
    """``collate`` whose batches are copied into page-locked memory (their copy to the device then
    runs beside the step), with ``device`` the thread's current one while it pins: a thread's
    current device is its own (device 0 unless set), and pinning on another would start a CUDA
    context there (torch's DataLoader sets its pinning thread's device the same way)."""

    def pinned(rows: dict[str, Any]) -> Any:
        with torch.cuda.device(device):
            return pin_memory(collate(rows))

    return pinned


def _collated(batches: Iterable[dict[str, Any]], collate: Callable[[dict[str, Any]], Any]) -> Iterator[Any]:
    """``batches`` through ``collate``; closing this closes them."""
    try:
        for batch in batches:
            yield collate(batch)
    finally:
        close(batches)


def _rows_in(batches: list[list[int]], n: int) -> int:
    """The rows of the first ``n`` of ``batches``."""
    return sum(len(b) for b in batches[:n])


def _batches_in(batches: list[list[int]], rows: int) -> int:
    """How many of ``batches`` the first ``rows`` rows fill."""
    return int(np.searchsorted(np.cumsum([len(b) for b in batches]), rows, side="right")) if rows else 0


def _read(index: Any, plan: Plan, start_row: int) -> Iterator[dict[str, Any]]:
    reader = Reader(index)
    try:
        yield from windows_from(reader, plan, start_row)
    finally:
        reader.close()


def read_and_preprocess(
    task: Task,
    index: Any,
    plan: Plan,
    windows: Iterable[int],
    first: int,
    skip: int,
    seeds: tuple[int, int],
    rows: int,
    train: bool,
) -> Iterator[dict[str, np.ndarray]]:
    """Read ``windows`` of ``plan`` and pass their rows through ``task.preprocess``, ``rows`` at
    a time (``skip``: the rows of window ``first`` already trained on; ``train``: the train
    split's rows)."""
    set_up_once(task)
    reader = Reader(index)
    try:
        for w in windows:
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


def preprocessed_here(
    task: Task,
    data: DataConfig,
    plan: Plan,
    index: Any,
    start_row: int,
    seeds: tuple[int, int],
    train: bool,
    ahead: EpochPlans | None = None,
) -> Iterable[dict[str, Any]]:
    """The plan's windows from ``start_row`` on, read and preprocessed in this process, one
    window ahead on a background thread: the same rows, in the same order and with the same
    row seeds, as the preprocessing tasks give a Ray worker (``ahead`` is not read: nothing works
    ahead across epochs here)."""
    first, skip = plan.locate(start_row)
    parts = read_and_preprocess(
        task, index, plan, range(first, plan.windows), first, skip, seeds, data.preprocess.batch_rows, train
    )
    return prefetched(parts, max(1, data.prefetch_batches))


def first_batch(task: Task, config: Config, splits: dict[str, Any], rows: dict[str, int]) -> tuple[Any, Batches]:
    """Rank 0's first training batch of epoch 0, as a run with ``scaling.num_workers``
    workers reads it (``Task.preprocess`` applied here), and the batch source."""
    source = Batches(task, config, splits, rows, 0, config.scaling.workers, "cpu", preprocessed_here)
    stream = source.batches("train", 0)
    try:
        return next(iter(stream)), source
    finally:
        close(stream)


def feed_units(plan: Plan, start_row: int) -> list[tuple[int, int]]:
    """The plan's rows from ``start_row`` on as ``(window, rows skipped)``, one per window."""
    first, skip = plan.locate(start_row)
    return [(w, skip if w == first else 0) for w in range(first, plan.windows)]
