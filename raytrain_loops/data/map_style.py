"""Batches of map-style splits (``MapSplit``) for one worker of a group, without Ray.

An epoch's batches are a function of (``loop.seed``, epoch, rank) alone, so a run resumed
mid-epoch continues with exactly the batches the interrupted one had left:

- the order: a ``DistributedSampler`` with this worker's rank, the group size and ``loop.seed``,
  set to the epoch (one permutation shared by the group, each worker taking its share, padded
  to equal counts as :func:`~raytrain_loops.engine.length.batches_per_epoch` assumes); or the
  split's own batch sampler (``MapSplit.batch_sampler``, e.g.
  :class:`~raytrain_loops.data.samplers.GroupedBatchSampler`), built once with
  (``data.batch_size``, rank, group size, ``loop.seed``) and set to the epoch, whose ``len``
  is then the worker's batches per epoch;
- the position: a resumed epoch starts at its batch ``start`` in the sampler's order, without
  loading the batches before it. A group of another size finishes the epoch on the batches the
  old group's workers had not trained, dealt out whole over its workers (:meth:`MapBatches.dealt`,
  :func:`~raytrain_loops.data.recut.recut_batches`);
- random augmentation: every batch is read and collated under torch, NumPy and Python RNGs
  seeded from (seed, epoch, rank, batch number), in whichever process reads it, so its draws do
  not depend on ``data.loader_workers``, on which loader process got it, or on what was read
  before. In the training process (``data.loader_workers=0``) the RNG states are put back after
  each batch, so dropout draws from the stream the checkpoint saved;
- the DataLoader draws its workers' base seed from a generator of its own, never from the
  global RNG that a resumed run restores mid-epoch.

On a CUDA worker the DataLoader pins its batches in page-locked memory, so that the engine's
``non_blocking`` copies to the device overlap with the host's work instead of waiting for it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate

from raytrain_loops.config.run import DataConfig
from raytrain_loops.data.recut import Deal, recut_batches
from raytrain_loops.engine.devices import pins
from raytrain_loops.engine.length import batches_per_epoch
from raytrain_loops.engine.rng import rng_state, set_rng_state


def derived_seeds(*key: int) -> tuple[int, int, int]:
    """Independent seeds for torch (64 bits), NumPy (32 bits) and Python from a tuple of ints."""
    words = np.random.SeedSequence([k % 2**63 for k in key]).generate_state(4)
    return int(words[0]) << 31 | int(words[1]) >> 1, int(words[2]), int(words[3])


@contextmanager
def seeded(*key: int, restore: bool) -> Iterator[None]:
    """Run the block with torch, NumPy and Python's global RNGs seeded from ``key``; with
    ``restore``, put their previous states back afterwards."""
    saved = rng_state() if restore else None
    t, n, p = derived_seeds(*key)
    torch.manual_seed(t)
    np.random.seed(n)
    random.seed(p)
    try:
        yield
    finally:
        if saved is not None:
            set_rng_state(saved)


class _Batches(Dataset):
    """A map-style dataset read a batch at a time: item ``(number, rows)`` is the collated batch
    of ``rows``, read under RNGs seeded from ``key + (number,)``."""

    def __init__(self, dataset: Any, collate: Any, key: tuple[int, ...]):
        self.dataset, self.collate, self.key = dataset, collate or default_collate, key

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, list[int]]) -> Any:
        number, rows = item
        # In a loader process the states need no restoring: each batch seeds its own.
        in_trainer = torch.utils.data.get_worker_info() is None
        with seeded(*self.key, number, restore=in_trainer):
            return self.collate([self.dataset[i] for i in rows])


def _unchanged(batch: Any) -> Any:
    return batch


class MapBatches:
    """This worker's batches of map-style splits, per epoch, from any batch on: the loop's
    :class:`~raytrain_loops.engine.loop.BatchSource` for ``MapSplit`` data.

    ``splits`` maps a split name ("train", "eval") to an object with ``dataset``,
    ``collate_fn`` and ``batch_sampler`` (a :class:`~raytrain_loops.tasks.MapSplit`). Training
    batches come from the train split's batch sampler, or are shuffled with the last partial one
    dropped; evaluation reads this worker's rows (every ``world``-th) in order, each row on one
    worker only. ``device``: this worker's device; batches are pinned when it is a CUDA device.
    """

    def __init__(
        self,
        splits: dict[str, Any],
        data: DataConfig,
        seed: int,
        rank: int,
        world: int,
        device: torch.device | str | None = None,
    ):
        self.splits, self.data, self.seed, self.rank, self.world = splits, data, seed, rank, world
        self.has_eval = "eval" in splits
        self.pin_memory = pins(device)
        self.sampler = None
        if "train" in splits:
            factory = getattr(splits["train"], "batch_sampler", None)
            if factory is not None:
                self.sampler = factory(data.batch_size, rank, world, seed)
                self.batches_per_epoch = len(self.sampler)
            else:
                rows = len(splits["train"].dataset)
                self.batches_per_epoch = batches_per_epoch(rows, world, data.batch_size, padded=True)

    def _rows(self, split: str, epoch: int) -> list[list[int]]:
        """This worker's batches of ``split`` in ``epoch``, as lists of row indices."""
        dataset = self.splits[split].dataset
        if split == "train":
            return self._train(epoch, self.rank, self.world)
        mine = list(range(self.rank, len(dataset), self.world))
        size = self.data.eval_batch_size
        return [mine[i : i + size] for i in range(0, len(mine), size)]

    def train_batches(self, epoch: int) -> list[list[int]]:
        """This worker's training batches in ``epoch`` (its own, not a re-cut part)."""
        return self._train(epoch, self.rank, self.world)

    def _train(self, epoch: int, rank: int, world: int) -> list[list[int]]:
        """Worker ``rank`` of a group of ``world``'s training batches in ``epoch``."""
        dataset, size = self.splits["train"].dataset, self.data.batch_size
        if self.sampler is not None:
            if (rank, world) == (self.rank, self.world):
                return self._sampled(epoch, self.sampler, rank, self.batches_per_epoch)
            sampler = self.splits["train"].batch_sampler(size, rank, world, self.seed)
            return self._sampled(epoch, sampler, rank, len(sampler))
        sampler = DistributedSampler(dataset, world, rank, shuffle=True, seed=self.seed)
        sampler.set_epoch(epoch)
        mine = list(sampler)
        return [mine[i : i + size] for i in range(0, len(mine) - size + 1, size)]

    def _sampled(self, epoch: int, sampler: Any, rank: int, expected: int) -> list[list[int]]:
        """A batch sampler's batches for ``epoch``, checked against its ``len`` (``expected``): a
        sampler giving ranks different counts would leave some workers waiting in a step."""
        sampler.set_epoch(epoch)
        rows = [list(batch) for batch in sampler]
        if len(rows) != expected:
            raise ValueError(
                f"split 'train': the batch sampler yielded {len(rows)} batches on rank {rank} "
                f"in epoch {epoch}, but its len() is {expected}"
            )
        return rows

    def dealt(self, epoch: int, deal: Deal) -> list[list[int]]:
        """This worker's training batches of ``epoch`` on ``deal``: the batches of every worker
        of the group it was dealt for, re-cut (:func:`~raytrain_loops.data.recut.recut_batches`)."""
        parts = [self._train(epoch, q, deal.world) for q in range(deal.world)]
        return recut_batches([*parts, []], deal.recuts)[self.rank]

    def batches(self, split: str, epoch: int, start: int = 0, rows: list[list[int]] | None = None) -> Iterable[Any]:
        """The batches of ``split`` in ``epoch``, from batch ``start`` on (``rows``: the batches,
        when not this worker's own of the epoch: a re-cut part)."""
        rows = self._rows(split, epoch) if rows is None else rows
        key = (self.seed, epoch, self.rank, 0 if split == "train" else 1)
        items = [(number, rows[number]) for number in range(start, len(rows))]
        source = self.splits[split]
        return DataLoader(
            _Batches(source.dataset, source.collate_fn, key),
            batch_size=None,  # the items are whole batches
            sampler=items,
            num_workers=self.data.loader_workers,
            collate_fn=_unchanged,
            pin_memory=self.pin_memory,
            generator=torch.Generator().manual_seed(derived_seeds(*key)[0]),
        )
