"""Automatic micro-batching (``accum.micro_batch=auto``): the largest micro-batch that fits,
found by the run itself.

Each batch the loop hands the step (``data.batch_size`` rows) is split into ``splits``
micro-batches along its rows (:func:`split_batch`, or the task's own ``split_batch``). An
out-of-memory error on any worker reaches every worker through the step's one all-reduce; then,
instead of skipping the update, every worker doubles ``splits`` (its micro-batch halves, its
micro-batches per update double) and the same update is tried again on the same rows, with the
RNG states and the model's buffers put back as they were before the first try
(:class:`Attempt`). The global batch is unchanged and no row is dropped: under
``loss.reduction=sum`` the update does not depend on how the rows are split, and under ``mean``
the halves are equal (an uneven split is never made). ``splits`` stays for the rest of the run: the
engine's checkpoint counters hold it, and a group restarted after an OOM that broke its
collectives (:class:`~raytrain_loops.errors.GroupBrokenError`, which only the
failing worker sees) starts from what that worker recorded before raising (``on_resize``, which
the wiring points at the run directory). Data positions count the loop's batches, whose size
does not change, so they do not depend on ``splits``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from raytrain_loops.engine.distributed import collectives
from raytrain_loops.engine.rng import rng_state, set_rng_state
from raytrain_loops.errors import SplitError

__all__ = ["Attempt", "MicroBatches", "Resize", "SplitError", "batch_rows", "split_batch"]

SplitFn = Callable[[Any, int], list[Any]]
REMEDY = "a task whose batches hold such values gives Task.split_batch, or runs with accum.micro_batch=fixed"


def _fields(batch: Any) -> Any:
    """A top-level list is the batch's fields (what ``default_collate`` makes of tuple samples),
    as a tuple; a list inside a dict or a tuple holds one item per row."""
    return tuple(batch) if isinstance(batch, list) else batch


def batch_rows(batch: Any, where: str = "batch", *, numbers: bool = False) -> int:
    """The rows of a collated batch: the length of its tensors' first dimension and of its lists
    of per-row items, which must all agree. Raises :class:`SplitError` naming the part that has
    no rows. ``numbers``: pass over Python numbers (a batch's token count), values a task's own
    ``split_batch`` works out again for each part; the default split refuses them."""
    counts: dict[str, int] = {}
    _rows(_fields(batch), where, counts, numbers)
    if not counts:
        raise SplitError(f"{where} holds no tensor or list to split into micro-batches; {REMEDY}")
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{k}: {v}" for k, v in counts.items())
        raise SplitError(
            f"the parts of the batch disagree on its rows ({shown}): it cannot be split into micro-batches; {REMEDY}"
        )
    return next(iter(counts.values()))


def _rows(obj: Any, where: str, counts: dict[str, int], numbers: bool) -> None:
    if isinstance(obj, torch.Tensor) and obj.dim() > 0:
        counts[where] = obj.shape[0]
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _rows(v, f"{where}[{k!r}]", counts, numbers)
    elif isinstance(obj, tuple):
        for i, v in enumerate(obj):
            _rows(v, f"{where}[{i}]", counts, numbers)
    elif isinstance(obj, list):
        counts[where] = len(obj)
    elif numbers and isinstance(obj, (int, float)):
        return
    else:
        raise SplitError(f"{where} is a {type(obj).__name__}, which cannot be split along the batch's rows; {REMEDY}")


def split_batch(batch: Any, parts: int) -> list[Any]:
    """``batch`` cut along its rows into ``parts`` consecutive pieces, as even as they come (sizes
    differ by one at most): tensors along their first dimension (views, no copy), lists inside
    a dict or tuple as lists of per-row items, tuples, dicts and a top-level list (the fields
    ``default_collate`` gives) part by part. Raises :class:`SplitError` for a batch with a part
    that has no rows (a scalar, a string) or fewer rows than ``parts``."""
    rows = batch_rows(batch)
    if rows < parts:
        raise SplitError(f"a batch of {rows} rows cannot be split into {parts} micro-batches")
    bounds = [rows * i // parts for i in range(parts + 1)]
    pieces = [_cut(_fields(batch), a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    return [list(p) for p in pieces] if isinstance(batch, list) else pieces


def _cut(obj: Any, a: int, b: int) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj[a:b]
    if isinstance(obj, dict):
        return {k: _cut(v, a, b) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_cut(v, a, b) for v in obj)
    return obj[a:b]


@dataclass(frozen=True)
class Resize:
    """A change of the micro-batch: ``old`` to ``new`` rows after an out-of-memory error on
    ``worker`` in update ``step`` (1: the run's first), ``per_update`` micro-batches per update
    from now on, ``splits`` per batch. ``restart``: the OOM broke the group's collectives, so
    only that worker knows of it, and the group restarts from its last checkpoint."""

    old: int
    new: int
    worker: int
    step: int
    per_update: int
    splits: int
    restart: bool = False

    def line(self) -> str:
        """The console's line."""
        then = "; the group restarts from its last checkpoint" if self.restart else ""
        return (
            f"micro-batch {self.old} -> {self.new} after an out-of-memory error on worker {self.worker} "
            f"at step {self.step} ({self.per_update} per update){then}"
        )


class Attempt:
    """What a failed try of an update changed and a retry must find as it was: every RNG state
    (dropout, the task's random draws) and the model's buffers (BatchNorm's running statistics,
    updated by the forward passes that ran)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.rng = rng_state()
        self.buffers = [b.detach().clone() for b in module.buffers()]

    @torch.no_grad()
    def restore(self) -> None:
        set_rng_state(self.rng)
        for buffer, saved in zip(self.module.buffers(), self.buffers, strict=True):
            buffer.copy_(saved)


class MicroBatches:
    """One worker's micro-batching: ``splits`` micro-batches per batch (1 unless ``auto``),
    how a batch is split, and the halving every worker does together after an OOM.

    ``mean``: ``loss.reduction=mean``, where only even halves keep the update the same.
    ``on_resize`` hears of every change (on every worker, or on the failing worker alone before
    a restart of the group)."""

    def __init__(self, auto: bool, mean: bool, split: SplitFn | None = None):
        self.auto, self.mean = auto, mean
        self.split: SplitFn = split or split_batch
        self.splits = 1
        self.on_resize: Callable[[Resize], None] | None = None
        self._rows = 0  # the largest batch of this update on this worker, in rows (0: no data)
        self._batches = 1  # the loop's batches in this update
        self._checked = False

    def attempt(self, module: torch.nn.Module) -> Attempt | None:
        """What a retry of this update restores (None unless ``auto``)."""
        return Attempt(module) if self.auto else None

    def parts(self, batches: Sequence[Any]) -> list[Any]:
        """The update's micro-batches: each batch cut into ``splits`` (a ``None`` batch, a worker
        out of data, into as many ``None``); the batches as they are unless ``auto``. The first
        batch is tried once, so a batch that cannot be split fails at the first update (the driver's
        preflight tries the run's first batch before any worker starts)."""
        if not self.auto:
            return list(batches)
        self._batches = len(batches)
        real = [b for b in batches if b is not None]
        self._rows = max((batch_rows(b, numbers=True) for b in real), default=0)
        if real and not self._checked:
            self.split(real[0], 2)
            self._checked = True
        if self.splits == 1:
            return list(batches)
        out: list[Any] = []
        for b in batches:
            out.extend([None] * self.splits if b is None else self.split(b, self.splits))
        return out

    def smaller(self, batch: Any) -> Any:
        """The first half of ``batch`` (itself when it holds one row): the zero-weight pass a
        worker joins the collectives with after an OOM takes it."""
        if batch is None or batch_rows(batch, numbers=True) < 2:
            return batch
        return self.split(batch, 2)[0]

    def _can_halve(self) -> bool:
        """Whether this worker's batches can take twice the splits: at least one row a piece,
        and under ``loss.reduction=mean`` equal pieces."""
        if self._rows == 0:
            return True
        twice = 2 * self.splits
        return self._rows % twice == 0 if self.mean else self._rows >= twice

    def _size(self, rows: int) -> int:
        return math.ceil(rows / self.splits)

    def halve(self, step: int, ooms: int) -> bool:
        """After update ``step`` (0: the run's first), whose all-reduce counted an OOM (every worker
        calls it): double ``splits`` on every worker and return True, or False when a worker's batches cannot be halved
        (``oom.policy`` then decides). One gather names the worker that ran out of memory."""
        if not self.auto:
            return False
        seen = collectives.all_gather_object((ooms, self._rows, self._can_halve()))
        if not all(can for _, _, can in seen):
            return False
        rows = max(r for _, r, _ in seen)
        worker = next(r for r, (n, _, _) in enumerate(seen) if n > 0)
        self._resize(step, rows, worker, restart=False)
        return True

    def before_restart(self, step: int) -> None:
        """An OOM that the other workers cannot hear of (their collectives are under way): this
        worker halves alone and tells ``on_resize``, so the restarted group starts smaller."""
        if self.auto and self._rows and self._can_halve():
            self._resize(step, self._rows, collectives.rank(), restart=True)

    def _resize(self, step: int, rows: int, worker: int, *, restart: bool) -> None:
        old = self._size(rows)
        self.splits *= 2
        resize = Resize(
            old, self._size(rows), worker, step + 1, self._batches * self.splits, self.splits, restart
        )
        if self.on_resize is not None:
            self.on_resize(resize)
