"""Batch samplers for map-style training splits (``MapSplit(batch_sampler=...)``).

A batch sampler is built once per worker as ``factory(batch_size, rank, world, seed)``; the
loop calls its ``set_epoch`` before each epoch and reads this worker's batches of row indices
by iterating it. Its ``len`` is this worker's batches per epoch, the same on every rank: the
driver sizes the run with rank 0's, the workers with their own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

__all__ = ["GroupedBatchSampler"]


class GroupedBatchSampler:
    """Batches whose rows share one group id (an image's aspect-ratio bin, say), so that a
    batch can be stacked without padding across shapes.

    Each epoch, seeded by (``seed``, epoch) alone:

    1. the rows of every group are shuffled and cut into full batches of ``batch_size``; the
       rows left over in a group (fewer than a batch) are dropped for this epoch. They differ
       from epoch to epoch, since the shuffle does;
    2. the batches of all groups are shuffled together;
    3. batch ``i`` goes to worker ``i % world``, and the batches beyond the largest multiple of
       ``world`` are dropped, so every worker gets the same number and no row is used twice in
       an epoch over all workers.

    ``len`` is ``sum(rows of g // batch_size for each group g) // world``: it depends on the
    groups, the batch size and the world only, never on the epoch or the rank.

    Raises ``ValueError`` for an empty ``groups``, a group with fewer rows than ``batch_size``
    (its rows would never be trained on: merge it into a neighbouring group), or fewer batches
    than workers.
    """

    def __init__(self, groups: Sequence[int], batch_size: int, rank: int, world: int, seed: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a group of {world} workers")
        ids = np.asarray(groups)
        if ids.ndim != 1 or len(ids) == 0:
            raise ValueError("groups is empty: give one group id per row of the split")
        self.batch_size, self.rank, self.world, self.seed = batch_size, rank, world, seed
        self.epoch = 0
        # Rows of each group in a fixed order (group ids sorted, rows ascending), so the
        # epoch's shuffle is the only source of order.
        names = np.unique(ids)
        self.members = [np.flatnonzero(ids == g) for g in names]
        small = [(g, len(m)) for g, m in zip(names.tolist(), self.members, strict=True) if len(m) < batch_size]
        if small:
            shown = ", ".join(f"group {g!r} has {n}" for g, n in small[:5])
            raise ValueError(f"batch_size {batch_size} is more than the rows of {len(small)} group(s): {shown}")
        self.total = sum(len(m) // batch_size for m in self.members)
        if self.total < world:
            raise ValueError(f"the groups make {self.total} batches of {batch_size}, fewer than the {world} workers")

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose batches the next iteration yields."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.total // self.world

    def __iter__(self) -> Iterator[list[int]]:
        rng = np.random.default_rng([self.seed % 2**63, self.epoch])
        batches = []
        for rows in self.members:
            rows = rng.permutation(rows)
            full = len(rows) // self.batch_size * self.batch_size
            batches.extend(rows[:full].reshape(-1, self.batch_size))
        order = rng.permutation(len(batches))[: len(self) * self.world]
        for i in order[self.rank :: self.world]:
            yield batches[i].tolist()
