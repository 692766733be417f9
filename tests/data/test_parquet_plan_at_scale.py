"""The epoch's plan of a Parquet split at scale (raytrain_loops.data.parquet), without files: the
split-wide deal computed on one number per chunk gives every worker the very pieces the chunk
list dealt out gave (the reference below), and a worker's plan call never holds the split's
chunk list, only its own share's pieces."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from raytrain_loops.data.deal import shares
from raytrain_loops.data.parquet import READ_ROWS, SplitIndex, eval_plan, train_plan
from raytrain_loops.data.recut import Deal, recut_plan


def index_of(row_groups: list[list[int]]) -> SplitIndex:
    """A split's index as its footers give it (files never opened)."""
    return SplitIndex("simulated", None, [f"part-{f}" for f in range(len(row_groups))], row_groups, ["x"])


# The plan as it was first written: the split's chunk list built row group by row group, dealt
# out whole, then cut. It defines every row's position per (seed, epoch, world, rank).


def reference_chunks(index: SplitIndex, chunk_rows: int) -> np.ndarray:
    parts = []
    for f, groups in enumerate(index.row_groups):
        for g, n in enumerate(groups):
            starts = np.arange(0, n, chunk_rows, dtype=np.int64)
            stops = np.minimum(starts + chunk_rows, n)
            parts.append(np.stack([np.full_like(starts, f), np.full_like(starts, g), starts, stops], axis=1))
    return np.concatenate(parts) if parts else np.zeros((0, 4), dtype=np.int64)


def reference_cut(pieces: np.ndarray, lo: int, hi: int) -> np.ndarray:
    lengths = pieces[:, 3] - pieces[:, 2]
    ends = np.cumsum(lengths)
    begins = ends - lengths
    keep = (ends > lo) & (begins < hi)
    out = pieces[keep].copy()
    if len(out):
        out[:, 2] += np.maximum(lo - begins[keep], 0)
        out[:, 3] -= np.maximum(ends[keep] - hi, 0)
    return out


def reference_deal(count: int, world: int, rng: np.random.Generator) -> np.ndarray:
    owner = np.empty(count, dtype=np.int64)
    full = count // world * world
    owner[:full] = np.argsort(rng.random((count // world, world)), axis=1).ravel()
    owner[full:] = rng.permutation(world)[: count - full]
    return np.concatenate([rng.permutation(np.flatnonzero(owner == r)) for r in range(world)])


def reference_dealt(index: SplitIndex, seed: int, epoch: int, world: int, chunk_rows: int, buffer: int) -> np.ndarray:
    pieces = reference_chunks(index, chunk_rows)
    if not buffer:
        return pieces
    rng = np.random.default_rng(np.random.SeedSequence([seed % 2**63, epoch % 2**63]))
    return pieces[reference_deal(len(pieces), world, rng)]


SHAPES = {
    "uneven groups, empty groups and files": [[300, 0, 57], [], [128, 129, 1], [1000], [0]],
    "many small groups": [[128] * 40 + [77]] * 3,
    "one large group": [[10_000]],
    "fewer rows than workers": [[5]],
    "no rows": [[]],
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_every_workers_plan_is_the_reference_deals_row_for_row(shape):
    index = index_of(shape)
    for seed, epoch, chunk, buffer in [(0, 0, 128, 10_000), (7, 3, 128, 1000), (7, 3, 1, 64), (3, 1, 100, 0)]:
        for world in (1, 2, 3, 8):
            dealt = reference_dealt(index, seed, epoch, world, chunk, buffer)
            share = index.rows // world
            bounds = [(r * share, (r + 1) * share) for r in range(world)] + [(world * share, index.rows)]
            expected = [reference_cut(dealt, lo, hi) for lo, hi in bounds]
            for rank in range(world):
                plan = train_plan(index, seed, epoch, world, rank, chunk, buffer)
                assert np.array_equal(plan.pieces, expected[rank]), (seed, epoch, chunk, buffer, world, rank)
                assert plan.pieces.dtype == np.int64 and plan.pieces.shape[1:] == (4,)
            # The re-cut of a resumed epoch starts from the same shares, its remainder included.
            got = shares(index.row_groups, (seed, epoch), world, chunk, bool(buffer), range(world + 1))
            assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
            recut = recut_plan(index, seed, epoch, chunk, buffer, Deal(world, ((2, (0,) * world),)), 0)
            assert all(np.array_equal(p.pieces, e) for p, e in zip(recut.base, expected, strict=True))
            n = index.rows
            for rank in range(world):
                storage = reference_cut(reference_chunks(index, READ_ROWS), n * rank // world, n * (rank + 1) // world)
                assert np.array_equal(eval_plan(index, world, rank).pieces, storage), (world, rank)


def test_a_plan_call_never_holds_the_splits_chunk_list():
    # 2M rows in row groups of 128 rows (as docs/data.md recommends), chunks of 128 rows: 15,625
    # chunks, whose list of (file, row group, start, stop) takes 500 kB.
    index = index_of([[128] * 64] * (2_000_000 // 128 // 64) + [[128] * (2_000_000 // 128 % 64)])
    count = index.rows // 128
    chunk_list = count * 4 * 8
    world, rank = 8, 5
    tracemalloc.start()
    try:
        plan = train_plan(index, 0, 1, world, rank, 128, 10_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # The split-wide deal takes a few numbers per chunk; the list of chunks built row group by row
    # group took about 7 times the list's own size (an array per row group, then the list dealt and cut).
    assert peak < 2 * chunk_list, (peak, chunk_list)
    # What the worker keeps: its share's pieces (1/8 of the chunks, one more where a cut falls inside one).
    assert len(plan.pieces) <= count // world + 2 and plan.pieces.nbytes <= (count // world + 2) * 32
    assert plan.rows == index.rows // world
