"""Slicing Ray Data's large fetched batches into micro-batches keeps every row, in order."""

import numpy as np

from raytrain_loops.data.parquet import sliced


def _fetched(sizes):
    start = 0
    for n in sizes:
        yield {"x": np.arange(start, start + n), "y": np.arange(start, start + n) * 10}
        start += n


def test_sliced_keeps_rows_in_order_across_fetched_batches():
    out = list(sliced(_fetched([10, 10, 5]), 4, lambda b: b, drop_last=False))
    assert [len(b["x"]) for b in out] == [4, 4, 4, 4, 4, 4, 1]
    assert np.concatenate([b["x"] for b in out]).tolist() == list(range(25))
    assert all((b["y"] == b["x"] * 10).all() for b in out)


def test_sliced_drop_last_drops_only_the_final_partial_batch():
    out = list(sliced(_fetched([10, 10, 5]), 4, lambda b: len(b["x"]), drop_last=True))
    assert out == [4] * 6  # 25 rows: floor(25 / 4) full batches, as batches_per_epoch assumes
