"""The rows a group of workers trains on in an epoch, read off the epoch's plan as the workers'
sources read it: for the tests that count every token a run trained on."""

from __future__ import annotations

from raytrain_loops.config.run import DataConfig
from raytrain_loops.data.parquet import train_plan


def trained_rows(split, data: DataConfig, seed: int, workers: int = 2) -> list[int]:
    """The row numbers (storage order) the workers train on in epoch 0: their shares of the
    epoch's plan (equal shares, the remainder left out). The lm recipe's count of every token it
    trains on is checked in the FSDP run on Ray (tests/engine/test_fsdp_matches_ddp.py), not in a
    Ray run of its own."""
    rows = []
    for rank in range(workers):
        plan = train_plan(split.index, seed, 0, workers, rank, data.shuffle_chunk_rows, data.shuffle_buffer)
        offsets = split.index.group_offsets()
        for f, g, start, stop in plan.pieces.tolist():
            rows += range(offsets[(f, g)] + start, offsets[(f, g)] + stop)
    return rows
