"""A map-style task whose train split is grouped (one group id per row) and batched by
``GroupedBatchSampler``: ``GROUPS``, 41 rows in 7 groups of uneven sizes (``SIZES``) in shuffled
order, and the rows themselves, regression rows with a little random augmentation and their ids."""

from __future__ import annotations

import functools

import numpy as np
import torch

from raytrain_loops.data import GroupedBatchSampler
from raytrain_loops.tasks import MapSplit, Task
from tests.support import fakes

# 7 groups of uneven sizes (aspect-ratio bins, say): 3 + 5 + 9 + 4 + 11 + 6 + 3 = 41 rows.
SIZES = [3, 5, 9, 4, 11, 6, 3]
GROUPS = [g for g, n in enumerate(SIZES) for _ in range(n)]
np.random.default_rng(0).shuffle(GROUPS)  # rows of a group are not adjacent


class Rows(torch.utils.data.Dataset):
    """Regression rows with a little random augmentation, and each row's id."""

    def __init__(self, n: int):
        self.x, self.y = fakes.regression_data(n=n, seed=3)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.05 * torch.randn(self.x.shape[1]), self.y[i], i


class GroupedTask(Task):
    """A task whose train split is grouped by ``groups`` (one id per row)."""

    def __init__(self, groups, rows: int | None = None):
        self.groups, self.rows = groups, len(groups) if rows is None else rows

    def splits(self, data_dir):
        sampler = functools.partial(GroupedBatchSampler, self.groups)
        return {"train": MapSplit(Rows(self.rows), batch_sampler=sampler), "eval": MapSplit(Rows(5))}
