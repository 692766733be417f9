"""The split-wide deal of an epoch, without Ray: which rows of a Parquet split each share of a
group holds, in what order (the order :mod:`raytrain_loops.data.parquet` defines).

A worker needs its own share only, yet the deal is a function of the whole split. It is computed
on one number per chunk (the chunks' order, their rows, cumulated), never on the split's list of
pieces, and only the requested shares' pieces are built: what a worker keeps is its share's, and
a plan call costs a few vectorised passes over the chunks. One design serves an epoch's own plan
(:func:`~raytrain_loops.data.parquet.train_plan`, one share) and a resumed epoch's re-cut
(:func:`~raytrain_loops.data.recut.recut_plan`, every share and the remainder).

Pieces are ``(n, 4)`` arrays of (file, row group, start, stop): rows ``[start, stop)`` of a row
group of a file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Columns of the arrays that describe pieces: rows [start, stop) of a row group of a file.
FILE, GROUP, START, STOP = range(4)


def keyed_rng(*key: int) -> np.random.Generator:
    """The generator of a key of integers (seed, epoch, ...)."""
    return np.random.default_rng(np.random.SeedSequence([k % 2**63 for k in key]))


def cut(pieces: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The pieces covering rows ``[lo, hi)`` of the rows ``pieces`` hold, in order, the first
    and last trimmed."""
    lengths = pieces[:, STOP] - pieces[:, START]
    ends = np.cumsum(lengths)
    begins = ends - lengths
    keep = (ends > lo) & (begins < hi)
    out = pieces[keep].copy()
    if len(out):
        out[:, START] += np.maximum(lo - begins[keep], 0)
        out[:, STOP] -= np.maximum(ends[keep] - hi, 0)
    return out


@dataclass(frozen=True)
class Chunks:
    """A split cut into pieces of at most ``size`` rows of one row group, in storage order,
    described by two numbers per row group (the list of chunks is never built): row group ``g``
    (numbered over all files, in storage order) has ``rows[g]`` rows and its chunks are numbered
    from ``first[g]``; file ``f``'s row groups are numbered from ``files[f]``."""

    size: int
    rows: np.ndarray
    first: np.ndarray
    files: np.ndarray

    @classmethod
    def of(cls, row_groups: Sequence[Sequence[int]], size: int) -> Chunks:
        """The chunks of a split whose files hold row groups of ``row_groups`` rows."""
        files = np.cumsum([0] + [len(groups) for groups in row_groups], dtype=np.int64)
        rows = np.fromiter((n for groups in row_groups for n in groups), dtype=np.int64, count=int(files[-1]))
        counts = rows + (size - 1)
        counts //= size  # each row group's chunks
        first = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=first[1:])
        return cls(size, rows, first, files)

    @property
    def count(self) -> int:
        return int(self.first[-1])

    def lengths(self) -> np.ndarray:
        """Every chunk's rows, in storage order (not to be written to): ``size``, but the last of
        each row group. Row groups of at most ``size`` rows (as docs/data.md recommends writing
        them) are one chunk each: their own rows."""
        if self.count == len(self.rows):
            return self.rows
        out = np.full(self.count, self.size, dtype=np.int64)
        rest = self.rows % self.size
        short = rest > 0
        last = self.first[1:][short]
        last -= 1
        out[last] = rest[short]
        return out

    def pieces(self, ids: np.ndarray) -> np.ndarray:
        """Chunks ``ids`` as pieces. Of empty row groups and files (no chunk, so sharing their
        first number with the next), the search finds the last: the one holding the chunk."""
        out = np.empty((len(ids), 4), dtype=np.int64)
        g = np.searchsorted(self.first, ids, side="right")
        g -= 1
        f = np.searchsorted(self.files, g, side="right")
        f -= 1
        out[:, FILE] = f
        np.subtract(g, self.files[f], out=out[:, GROUP])
        del f
        np.subtract(ids, self.first[g], out=out[:, START])
        out[:, START] *= self.size
        np.add(out[:, START], self.size, out=out[:, STOP])
        np.minimum(out[:, STOP], self.rows[g], out=out[:, STOP])
        return out


def deal(count: int, world: int, rng: np.random.Generator) -> np.ndarray:
    """A seeded order of ``count`` chunks, stratified over the group: each run of ``world``
    neighbouring chunks (in storage order) gives one chunk to each worker's part, the parts
    follow one another, and each part is in random order. A worker so draws from every region of
    the split, whatever order it is stored in (by class, source or time), and its chunks differ
    from one epoch to the next (each is its own with probability ``1 / world``)."""
    owner = np.empty(count, dtype=np.int32)
    full = count // world * world
    owner[:full] = np.argsort(rng.random((count // world, world)), axis=1).ravel()
    owner[full:] = rng.permutation(world)[: count - full]
    order = np.argsort(owner, kind="stable")  # each part's chunks in storage order, part after part
    ends = np.cumsum(np.bincount(owner, minlength=world))
    del owner
    for part in np.split(order, ends[:-1]):
        rng.shuffle(part)  # in place: the draws of ``rng.permutation(part)``, without its copy
    return order


def shares(
    row_groups: Sequence[Sequence[int]],
    key: tuple[int, int],
    world: int,
    chunk_rows: int,
    shuffled: bool,
    ranks: Sequence[int],
) -> list[np.ndarray]:
    """The pieces of shares ``ranks`` of a split of ``row_groups``, its chunks of ``chunk_rows``
    rows dealt to a group of ``world`` by the generator of ``key`` (seed, epoch) (not
    ``shuffled``: in storage order). Share ``r < world`` is rows ``[r * share, (r + 1) * share)``
    of the dealt order; share ``world``, the remainder that the shares leave out."""
    part = Chunks.of(row_groups, chunk_rows)
    order = deal(part.count, world, keyed_rng(*key)) if shuffled else np.arange(part.count, dtype=np.int64)
    ends = part.lengths()[order]
    np.cumsum(ends, out=ends)
    rows = int(ends[-1]) if len(ends) else 0
    share = rows // world
    return [span(part, order, ends, r * share, (r + 1) * share if r < world else rows) for r in ranks]


def span(part: Chunks, order: np.ndarray, ends: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The pieces covering rows ``[lo, hi)`` of the chunks ``order`` lists (``ends``: their rows
    cumulated), in order, the first and last trimmed (as :func:`cut` trims them, in place)."""
    a = int(np.searchsorted(ends, lo, side="right"))  # the first chunk ending past lo
    b = int(np.searchsorted(ends, hi, side="left")) + 1 if hi > 0 else 0  # past the last one beginning before hi
    b = max(a, min(b, len(order)))
    pieces = part.pieces(order[a:b])
    if len(pieces):
        pieces[0, START] += lo - (int(ends[a - 1]) if a else 0)
        pieces[-1, STOP] -= max(int(ends[b - 1]) - hi, 0)
    return pieces


def storage_span(row_groups: Sequence[Sequence[int]], chunk_rows: int, lo: int, hi: int) -> np.ndarray:
    """Rows ``[lo, hi)`` of a split of ``row_groups`` in storage order, as chunks of at most
    ``chunk_rows`` rows."""
    part = Chunks.of(row_groups, chunk_rows)
    return span(part, np.arange(part.count, dtype=np.int64), np.cumsum(part.lengths()), lo, hi)
