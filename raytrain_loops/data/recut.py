"""An epoch finished by a group of another size, without Ray: the deal an epoch runs on, and the
re-cut of the rows its workers had not trained.

An epoch runs on a *deal*: the group size it was dealt for (the plan of
:func:`~raytrain_loops.data.parquet.train_plan`, or a map-style split's sampler, for that size),
then every *re-cut* since: when a group of another size resumes the epoch (an elastic restart, a
move between local mode and Ray, a rerun at another ``scaling.num_workers``), the rows each
worker of the deal had not trained yet (its share from its position on, in its own reading
order), followed by the rows the deal left out (the shares' remainder), are cut into equal
contiguous parts, one per new worker. A re-cut of a re-cut composes: its rows are always named in
the epoch's first plans (a window of one worker's share, rows ``lo`` to ``hi`` of that window's
order), so rows are read where they are, with their own row seeds, and none twice. From the next
epoch on, a group uses its own size's plan.

A checkpoint records, per worker, ``{"epoch", "batches", "rows", "deal"}`` (:func:`data_record`):
the loop's batch count, the position in rows in the worker's part of the deal (a unit that does
not depend on the batch size), and the deal (:meth:`Deal.record`). A record without ``rows``
(written before the deal was recorded) reads as ``batches`` full batches of the group that wrote
it, on that group's own plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from raytrain_loops.data.deal import cut, shares
from raytrain_loops.data.parquet import READ_ROWS, Reader, SplitIndex, WorkerPlan, read_window

# Columns of the arrays of segments: rows [lo, hi) of window ``window`` (in its order) of plan ``plan``.
PLAN, WINDOW, LO, HI = range(4)


@dataclass(frozen=True)
class Deal:
    """The deal an epoch runs on: ``world``, the group size it was dealt for, and ``recuts``, one
    ``(size of the group that took it over, every worker's position in rows when it did)`` per
    re-cut since."""

    world: int
    recuts: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @property
    def workers(self) -> int:
        """The group size the deal is cut for now."""
        return self.recuts[-1][0] if self.recuts else self.world

    def then(self, world: int, positions: Sequence[int]) -> Deal:
        """This deal re-cut for a group of ``world``, its workers having reached ``positions``."""
        return Deal(self.world, (*self.recuts, (world, tuple(positions))))

    def record(self) -> dict[str, Any]:
        return {"world": self.world, "recuts": [{"world": w, "rows": list(p)} for w, p in self.recuts]}

    @classmethod
    def of(cls, record: Any) -> Deal:
        """The deal a checkpoint's record describes; ValueError naming what is wrong."""
        try:
            recuts = tuple((_count(r["world"], 1), tuple(_count(p, 0) for p in r["rows"])) for r in record["recuts"])
            return cls(_count(record["world"], 1), recuts)
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed deal {record!r} ({type(err).__name__}: {err})") from None


def _count(value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"expected an integer >= {least}, got {value!r}")
    return value


@dataclass(frozen=True)
class Resume:
    """Where one worker of a resumed group starts: ``epoch``, its ``deal``, its position ``row``
    in its part of that deal, and ``batches``, the loop's count, when the deal is the group's own
    plan unchanged (a resume at the same size: exactly the loop's position, as before)."""

    epoch: int
    deal: Deal
    row: int
    batches: int | None


def data_record(epoch: int, batches: int, rows: int, deal: Deal) -> dict[str, Any]:
    """What a checkpoint records of one worker's data position."""
    return {"epoch": epoch, "batches": batches, "rows": rows, "deal": deal.record()}


def _read_record(record: Any, writers: int, batch_size: int) -> tuple[int, int, int, Deal]:
    """(epoch, batches, rows, deal) of one worker's record; an old record (epoch and batches
    only) reads as full batches on the writing group's own plan."""
    try:
        epoch, batches = _count(record["epoch"], 0), _count(record["batches"], 0)
        if "rows" not in record:
            return epoch, batches, batches * batch_size, Deal(writers)
        return epoch, batches, _count(record["rows"], 0), Deal.of(record["deal"])
    except (KeyError, TypeError) as err:
        raise ValueError(f"malformed data position {record!r} ({type(err).__name__}: {err})") from None


def resume_point(records: Sequence[Any], world: int, rank: int, batch_size: int) -> Resume:
    """Where worker ``rank`` of a group of ``world`` resumes from a checkpoint whose workers wrote
    ``records`` (one per worker, in rank order; a group of the same size needs only its own, the
    others may be None). The same group size continues each worker's own part; another size
    re-cuts the rows not trained yet (none at all trained: the epoch is dealt afresh for the new
    size). ValueError, naming the worker, when the records disagree."""
    writers = len(records)
    if writers == world:
        epoch, batches, row, deal = _read_record(records[rank], writers, batch_size)
        _check_cut(deal, writers)
        return Resume(epoch, deal, row, batches if not deal.recuts else None)
    read = [_read_record(r, writers, batch_size) for r in records]
    epoch, _, _, deal = read[0]
    for r, (e, _, _, d) in enumerate(read):
        if (e, d) != (epoch, deal):
            raise ValueError(f"worker {r} recorded epoch {e} on {d}, worker 0 epoch {epoch} on {deal}")
    _check_cut(deal, writers)
    positions = [row for _, _, row, _ in read]
    if not deal.recuts and not any(positions):
        return Resume(epoch, Deal(world), 0, 0)
    return Resume(epoch, deal.then(world, positions), 0, None)


def _check_cut(deal: Deal, writers: int) -> None:
    if deal.workers != writers:
        raise ValueError(f"the deal is cut for {deal.workers} workers, but {writers} wrote the checkpoint")


def _rows(segments: np.ndarray) -> int:
    return int((segments[:, HI] - segments[:, LO]).sum())


def recut_parts(parts: list[np.ndarray], recuts: Sequence[tuple[int, Sequence[int]]]) -> list[np.ndarray]:
    """Each worker's segments after ``recuts``. ``parts``: the deal's workers' segments, then
    the segments of the rows it leaves out. Each re-cut puts the rows every worker had not
    trained (from its position on) and then the left-out rows one after the other, and cuts them
    into equal contiguous parts; what does not divide is left out again."""
    for world, positions in recuts:
        if len(positions) != len(parts) - 1:
            raise ValueError(f"a re-cut records {len(positions)} positions for a deal of {len(parts) - 1} workers")
        left = []
        for r, (part, at) in enumerate(zip(parts, [*positions, 0], strict=True)):
            if at > _rows(part):
                raise ValueError(f"worker {r}'s position {at} is past its {_rows(part)} rows")
            left.append(cut(part, at, _rows(part)))
        rest = np.concatenate(left)
        n = _rows(rest)
        share = n // world
        parts = [cut(rest, r * share, (r + 1) * share) for r in range(world)] + [cut(rest, world * share, n)]
    return parts


def _window_segments(q: int, plan: WorkerPlan) -> np.ndarray:
    """Plan ``q``'s windows as segments: each window whole, in the plan's order."""
    sizes = np.asarray(plan.window_rows, dtype=np.int64)
    rows = np.stack([np.full_like(sizes, q), np.arange(len(sizes)), np.zeros_like(sizes), sizes], axis=1)
    return rows.reshape(-1, 4).astype(np.int64)


class RecutPlan:
    """One worker's part of a re-cut epoch: ``segments`` (rows ``lo`` to ``hi`` of a window of one
    of the ``base`` plans, in that window's order), read one segment per window. The interface
    of :class:`~raytrain_loops.data.parquet.WorkerPlan` that the read paths use: ``rows``,
    ``windows``, ``locate``, and :meth:`read` (which :func:`~raytrain_loops.data.parquet.read_window`
    calls)."""

    def __init__(self, base: list[WorkerPlan], segments: np.ndarray):
        self.base, self.segments = base, segments
        lengths = segments[:, HI] - segments[:, LO]
        self._starts = np.r_[0, np.cumsum(lengths)].astype(np.int64)

    @property
    def rows(self) -> int:
        return int(self._starts[-1])

    @property
    def windows(self) -> int:
        return len(self.segments)

    def locate(self, row: int) -> tuple[int, int]:
        """The segment holding row ``row`` of the part, and the row's offset in it."""
        if row >= self.rows:
            return self.windows, 0
        w = int(np.searchsorted(self._starts, row, side="right")) - 1
        return w, row - int(self._starts[w])

    def read(
        self, reader: Reader, w: int, skip: int = 0, seeds: tuple[int, int] | None = None
    ) -> dict[str, np.ndarray]:
        """Segment ``w``'s rows from its row ``skip`` on: its window read in its own plan's order
        (with the rows' own seeds), then cut."""
        q, window, lo, hi = (int(v) for v in self.segments[w])
        batch = read_window(reader, self.base[q], window, lo + skip, seeds)
        return {k: v[: max(0, hi - lo - skip)] for k, v in batch.items()}


def recut_plan(
    index: SplitIndex, seed: int, epoch: int, chunk_rows: int, buffer: int, deal: Deal, rank: int
) -> RecutPlan:
    """Worker ``rank``'s part of ``epoch`` on ``deal``: the epoch's plans for the deal's first
    group size (as :func:`~raytrain_loops.data.parquet.train_plan` makes them, every share from
    one deal of the split, :func:`~raytrain_loops.data.deal.shares`), and the rows the deal
    leaves out, re-cut by :func:`recut_parts`."""
    world = deal.world
    dealt = shares(index.row_groups, (seed, epoch), world, chunk_rows, bool(buffer), range(world + 1))
    base = [
        WorkerPlan(pieces, buffer or READ_ROWS, (seed, epoch, world, q) if buffer else None)
        for q, pieces in enumerate(dealt)
    ]
    parts = recut_parts([_window_segments(q, plan) for q, plan in enumerate(base)], deal.recuts)
    return RecutPlan(base, parts[rank])


def recut_batches(parts: list[list[list[int]]], recuts: Sequence[tuple[int, Sequence[int]]]) -> list[list[list[int]]]:
    """Map-style batches after ``recuts``: ``parts``, each worker's batches (lists of row
    indices) on the deal, then the batches it leaves out (none). Each re-cut puts every worker's
    batches not trained (past its position in rows) and then the left-out ones one after the
    other, and deals them out whole, in equal contiguous counts (a batch sampler's batches keep
    their grouping); the batches that do not divide are left out again."""
    for world, positions in recuts:
        if len(positions) != len(parts) - 1:
            raise ValueError(f"a re-cut records {len(positions)} positions for a deal of {len(parts) - 1} workers")
        rest: list[list[int]] = []
        for r, (part, at) in enumerate(zip(parts, [*positions, 0], strict=True)):
            ends = np.cumsum([len(b) for b in part], dtype=np.int64)
            if at and at not in ends:
                raise ValueError(f"worker {r}'s position {at} is not at the end of one of its batches")
            rest.extend(part[int(np.searchsorted(ends, at, side="right")) :])
        share = len(rest) // world
        parts = [rest[r * share : (r + 1) * share] for r in range(world)] + [rest[world * share :]]
    return parts


__all__ = [
    "Deal",
    "RecutPlan",
    "Resume",
    "data_record",
    "recut_batches",
    "recut_parts",
    "recut_plan",
    "resume_point",
]
