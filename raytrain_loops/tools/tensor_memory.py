"""The memory of the tensors a piece of code creates, measured as it runs on any device: every
storage an operator returns, from its creation to its release, in the order they happen. What
``raytrain-loops plan`` measures one training step with (:mod:`raytrain_loops.tools.memory_plan`).

A CPU has no allocator statistics to read (CUDA's ``max_memory_allocated`` has no CPU twin), and
a process's resident memory mixes the tensors with everything else. A dispatch mode sees every
operator's outputs, forward and backward alike; a weak reference to each new storage says when it
is freed. The storages are told apart afterwards by what they became (a gradient, an optimizer's
state, or neither), so the timeline gives the peak of any mix of them."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class Timeline:
    """The storages created while the mode was on, in order: ``sizes[i]`` bytes created at event
    ``born[i]`` and freed at ``died[i]`` (None: still alive); ``alive`` the storages still held,
    by the index of their creation, so that a caller can name them."""

    sizes: list[int] = field(default_factory=list)
    born: list[int] = field(default_factory=list)
    died: list[int | None] = field(default_factory=list)
    events: int = 0
    alive: dict[int, weakref.ref] = field(default_factory=dict)

    def indices_of(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """The creations (indices) whose storages ``tensors`` live in, among those still alive."""
        wanted = {id(t.untyped_storage()) for t in tensors}
        return {i for i, ref in self.alive.items() if (st := ref()) is not None and id(st) in wanted}

    def peak(self, weights: dict[int, float] | None = None, default: float = 1.0) -> float:
        """The largest sum, over the timeline, of the live storages' sizes, each weighted by
        ``weights`` (by creation index; ``default`` for the rest, 0 to leave them out)."""
        weights = weights or {}
        changes: list[tuple[int, int, float]] = []
        for i, size in enumerate(self.sizes):
            w = weights.get(i, default) * size
            changes.append((self.born[i], 1, w))
            if self.died[i] is not None:
                changes.append((self.died[i], 0, -w))  # a free before a creation at the same event
        live = best = 0.0
        for _, _, delta in sorted(changes):
            live += delta
            best = max(best, live)
        return best


FRESH = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


class TensorMemory(TorchDispatchMode):
    """``with TensorMemory() as mem: ...``; then ``mem.timeline``. Each storage is counted once,
    by its size in bytes, however many views of it the operators return."""

    def __init__(self) -> None:
        super().__init__()
        self.timeline = Timeline()
        self._seen: dict[int, int] = {}  # id of a live storage -> its creation's index

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # torch.tensor(data) makes its storage before any operator, then hands it to lift_fresh
        given = () if func in FRESH else tree_flatten((args, kwargs))[0]
        inputs = {id(t.untyped_storage()) for t in given if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:  # an in-place operator or a view returns a storage it was given
            if isinstance(t, torch.Tensor) and id(st := t.untyped_storage()) not in inputs:
                self._track(st)
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        tl = self.timeline
        tl.events += 1
        key = id(storage)
        if key in self._seen:
            return
        index = len(tl.sizes)
        self._seen[key] = index
        tl.sizes.append(storage.nbytes())
        tl.born.append(tl.events)
        tl.died.append(None)
        tl.alive[index] = weakref.ref(storage, lambda _, i=index, k=key: self._freed(i, k))

    def _freed(self, index: int, key: int) -> None:
        tl = self.timeline
        tl.events += 1
        tl.died[index] = tl.events
        tl.alive.pop(index, None)
        if self._seen.get(key) == index:
            del self._seen[key]
