"""Feeding the step: group a batch stream into micro-batch lists and time the wait for data."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any


def timed_groups(batches: Iterable[Any], k: int) -> Iterator[tuple[list[Any], float]]:
    """Yield lists of ``k`` consecutive batches with the seconds spent waiting for them.

    A short final group is yielded as is; an empty stream yields nothing.
    """
    it = iter(batches)
    while True:
        start = time.perf_counter()
        group = []
        for _ in range(k):
            try:
                group.append(next(it))
            except StopIteration:
                break
        if not group:
            return
        yield group, time.perf_counter() - start
        if len(group) < k:
            return


def accum_steps(accum_cfg, epoch: int, scale: float = 1.0) -> int:
    """Micro-batches per update in ``epoch``: 1 before ``accum.start_epoch`` (cvnets), then
    ``accum.steps``; times ``scale`` (full group size / current size) when an elastic group
    runs short of workers, so the global batch stays the same (to the nearest micro-batch)."""
    return max(1, round((accum_cfg.steps if epoch >= accum_cfg.start_epoch else 1) * scale))
