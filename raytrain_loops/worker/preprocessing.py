"""This worker's batches on Ray: :class:`~raytrain_loops.runtime.batches.Batches` on this worker's
device, with a task's :meth:`~raytrain_loops.tasks.Task.preprocess` executed by Ray Data
(:class:`RayPreprocessing`). The loop's :class:`~raytrain_loops.engine.loop.BatchSource`.

The plan (:mod:`raytrain_loops.data.parquet`) decides which rows this worker reads and in what
order; Ray Data decides where and when they are preprocessed. The train split runs in long-lived
executions, each over this worker's windows of the epoch it starts in and of the next
:data:`AHEAD_EPOCHS`, in the plan's order (``preserve_order``): the next epoch's first rows are
ready when it starts. Each evaluation runs an execution of its own. Every execution holds
this worker's share of ``data.preprocess.memory_gb`` (Ray Data's backpressure) and its blocks are
bounded in bytes, so a window is never one object.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import ray.train
import ray.train.torch

from raytrain_loops import ray_private
from raytrain_loops.config import Config
from raytrain_loops.config.run import DataConfig, PreprocessConfig
from raytrain_loops.console.feed import Sender
from raytrain_loops.runtime.batches import Batches, EpochPlans, Plan, feed_units, read_and_preprocess
from raytrain_loops.streams import close
from raytrain_loops.tasks import Task, has_actor_setup, set_up_once
from raytrain_loops.worker.feed import Execution, Starvation

NODE = "_preprocessed_on"
"""The column a preprocessing task adds to the rows it returns: the id of the node it ran on (taken
off on the worker)."""

EPOCH = "_feed_epoch"
"""The column a preprocessing task adds to the rows it returns: their epoch (taken off on the worker)."""

PREPROCESSED_ON: Counter[str] = Counter()
"""Rows preprocessed for this worker process, per node: recorded in every checkpoint's rank file."""
_COUNTING = threading.Lock()  # the train and an evaluation's streams count from their own threads

STORE_SHARE = 0.25
"""The budget's default (``data.preprocess.memory_gb=0``): this fraction of the cluster's object store."""

EVAL_SHARE = 0.25
"""The part of a worker's budget an evaluation's execution holds; the train split's holds the rest."""

_PLANS: OrderedDict[tuple[str, int], Plan] = OrderedDict()
"""The plans of later epochs a preprocessing process built, by (execution, epoch), the latest few."""

AHEAD_EPOCHS = 2
"""The epochs one train execution covers after the one it starts in: their plans are built here to
list their windows (and again in the tasks that read them), so an attempt does not build every
epoch's plan at its start; past them the next execution starts where it ended."""

MAX_UNITS = 4096
"""The most windows one train execution covers: past them (a long run of small windows) the next
execution starts where it ended."""

TASK_ROWS = 8192
"""The rows one preprocessing task covers at most, in successive whole windows of one epoch (at
least one window): Ray's own cost of a task (here 20-25 ms from one task's last row to the next
one's first, on 1 CPU) is paid per task, not per window. Each epoch's first task covers one window,
so that its first rows come after one window's work (a task's rows come out when it ends, unless
they fill a block), and an epoch has at least as many tasks as run at once."""


def unit_groups(
    units: list[tuple[int, int, int]], rows_per_window: float, windows_per_epoch: int, at_once: int
) -> list[list[tuple[int, int, int]]]:
    """``units`` (epoch, window, rows skipped), in their order, cut into the tasks' groups of
    successive windows of one epoch: the epoch's first window alone, then up to :data:`TASK_ROWS`
    rows' worth and an ``at_once``-th of an epoch's ``windows_per_epoch`` (at least one window)."""
    most = max(1, min(int(TASK_ROWS // max(rows_per_window, 1.0)), windows_per_epoch // max(at_once, 1)))
    groups: list[list[tuple[int, int, int]]] = []
    for unit in units:
        last = groups[-1] if groups else None
        if last is not None and last[-1][0] == unit[0] and last[-1][1] + 1 == unit[1] and not unit[2]:
            first_of_epoch = len(groups) == 1 or groups[-2][0][0] != unit[0]
            if len(last) < (1 if first_of_epoch else most):
                last.append(unit)
                continue
        groups.append([unit])
    return groups


def ray_batches(
    task: Task,
    config: Config,
    splits: dict[str, Any],
    rows: dict[str, int],
    rank: int,
    world: int,
    sender: Sender | None = None,
) -> Batches:
    """This worker's batch source: pinned batches on a GPU worker (the engine's non_blocking
    copies are then asynchronous), preprocessing executed by Ray Data; ``sender``: where a
    starved worker's line goes (the console)."""
    say = (lambda text: sender.send("data", f"worker {rank}: {text}")) if sender is not None else print
    preprocessing = RayPreprocessing(world, say)
    return Batches(task, config, splits, rows, rank, world, ray.train.torch.get_device(), preprocessing)


@dataclass
class _Work:
    """What every preprocessing task or actor of one execution reads: the task, the split's index,
    the first epoch's plan (a worker's own, a re-cut part's, an evaluation's) and the plans of the
    epochs after it."""

    task: Task
    index: Any
    first_epoch: int
    first: Plan
    ahead: EpochPlans | None
    seed: int
    rows: int
    train: bool
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Names this execution's plans in the process caches of the tasks that read them."""

    def plan(self, epoch: int) -> Plan:
        if epoch == self.first_epoch or self.ahead is None:
            return self.first
        key = (self.token, epoch)
        if key not in _PLANS:  # built once per process and epoch, not once per window
            while len(_PLANS) >= 4:
                _PLANS.popitem(last=False)
            _PLANS[key] = self.ahead(epoch)
        return _PLANS[key]

    def parts(self, units: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        """The preprocessed parts of ``units`` (one task's group: ``windows`` windows of an epoch
        from ``window`` on, the first with ``skip`` rows skipped), each ``rows`` rows at most,
        marked with their epoch and this process's node; the windows are read through one reader."""
        node = ray.get_runtime_context().get_node_id()
        epoch, first, count, skip = (int(units[k][0]) for k in ("epoch", "window", "windows", "skip"))
        plan, seeds = self.plan(epoch), (self.seed, epoch)
        windows = range(first, first + count)
        for part in read_and_preprocess(self.task, self.index, plan, windows, first, skip, seeds, self.rows, self.train):
            n = len(next(iter(part.values())))
            part[EPOCH] = np.full(n, epoch, dtype=np.int64)
            part[NODE] = np.full(n, node)
            yield part


def _preprocess_units(units: dict[str, np.ndarray], work: _Work) -> Iterator[dict[str, np.ndarray]]:
    """A Ray task's work (Ray Data's ``map_batches`` function)."""
    yield from work.parts(units)


class _Preprocessor:
    """An actor's work: the task's :meth:`~raytrain_loops.tasks.Task.actor_setup` once, then its
    windows (Ray Data's ``map_batches`` class)."""

    def __init__(self, work: _Work):
        self.work = work
        set_up_once(work.task)

    def __call__(self, units: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        yield from self.work.parts(units)


def budget_bytes(p: PreprocessConfig) -> float:
    """``data.preprocess.memory_gb`` in bytes, or its default from the cluster's object store."""
    if p.memory_gb > 0:
        return p.memory_gb * 2**30
    return STORE_SHARE * float(ray.cluster_resources().get("object_store_memory", 2**30))


def _cpus_share(p: PreprocessConfig, world: int) -> float:
    """This worker's share of the cluster's CPUs for preprocessing (at least one task's)."""
    return max(p.num_cpus, float(ray.cluster_resources().get("CPU", 1.0)) / world)


def block_bytes(memory: float) -> int:
    """The blocks' bound for an execution that holds ``memory`` bytes: a sixteenth of it, 1-128 MiB
    (Ray Data cuts a part of 1.5 times that or more)."""
    return int(min(128 * 2**20, max(2**20, memory / 16)))


def _dataset(work: _Work, units: list[tuple[int, int, int]], p: PreprocessConfig, world: int, memory: float) -> Any:
    """The Ray Data execution of ``units`` (epoch, window, rows skipped) for one stream of this
    worker, in their order, holding ``memory`` bytes of object store: Ray Data's limit is what is
    left once the blocks outside its count are set aside (the one this worker's thread holds, the
    one the step reads, one more that a running task may write past the limit)."""
    import ray.data
    from ray.data import ActorPoolStrategy, ExecutionResources, TaskPoolStrategy
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cpus_share = _cpus_share(p, world)  # read once: a call to Ray's control store
    share = max(1, int(cpus_share // max(p.num_cpus, 1e-9)))  # tasks at once on this worker's CPUs
    actors: tuple[int, int] | None = None
    if p.actors:
        actors = (p.actors[0], p.actors[1])  # the config keeps the pair as a list
    elif has_actor_setup(work.task):
        actors = (1, share)
    at_once = actors[1] if actors else p.concurrency or share
    first = work.first
    groups = unit_groups(units, first.rows / max(first.windows, 1), first.windows, at_once)
    items = [{"epoch": g[0][0], "window": g[0][1], "windows": len(g), "skip": g[0][2]} for g in groups]
    ds = ray.data.from_items(items, override_num_blocks=len(items))  # an item each: one task's work
    args: dict[str, Any] = {"num_cpus": p.num_cpus, "batch_size": 1, "zero_copy_batch": True}
    if p.num_gpus:
        args["num_gpus"] = p.num_gpus
    if p.resources:
        args["resources"] = dict(p.resources)
    cpus = None
    if actors:
        low, high = actors
        args.update(fn_constructor_kwargs={"work": work}, compute=ActorPoolStrategy(min_size=low, max_size=high))
        ds = ds.map_batches(_Preprocessor, **args)
    else:
        if p.concurrency:
            args["compute"] = TaskPoolStrategy(size=p.concurrency)
        else:
            cpus = cpus_share
        ds = ds.map_batches(_preprocess_units, fn_kwargs={"work": work}, **args)
    ctx = ds.context
    # This worker's node first, where it can place them: its blocks are read there, not fetched.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    ray_private.place_first_on(ctx, here)
    ctx.execution_options.preserve_order = True
    block = block_bytes(memory)
    limit = max(block, memory - 3 * 1.5 * block)
    ctx.execution_options.resource_limits = ExecutionResources(cpu=cpus, object_store_memory=limit)
    ctx.target_max_block_size = block
    ctx.print_on_execution_start = False
    ctx.enable_progress_bars = False
    return ds


class _Stream:
    """One execution's rows as this worker reads them: its blocks in order, each epoch's rows
    until the next epoch's first (``stop_at``), the node column counted and taken off."""

    def __init__(self, execution: Execution, units: list[tuple[int, int, int]]):
        self.execution = execution
        self.last_epoch = units[-1][0] if units else -1
        self._held: dict[str, np.ndarray] | None = None  # a block of a later epoch, read too soon

    def epoch(self, epoch: int) -> Iterator[dict[str, Any]]:
        """The rows of ``epoch`` left in this stream (those of an earlier epoch not read are dropped)."""
        self.execution.resume()  # the stream before this one may have interrupted a wait as it closed
        while True:
            block = self._held if self._held is not None else self.execution.next()
            self._held = None
            if block is None:
                return
            at = int(block[EPOCH][0])
            if at < epoch:
                continue
            if at > epoch:
                self._held = block
                return
            block.pop(EPOCH)
            node = block.pop(NODE)
            with _COUNTING:
                PREPROCESSED_ON[str(node[0])] += len(node)
            # Read-only views of the object store: copied, so that collate may write in place as it can locally.
            yield {k: v if v.flags.writeable else v.copy() for k, v in block.items()}


class RayPreprocessing:
    """The :data:`~raytrain_loops.runtime.batches.Preprocessing` of a Ray worker: Ray Data
    executions of this worker's windows, the train split's one kept from epoch to epoch."""

    def __init__(self, world: int, say: Callable[[str], None] = print):
        self.world, self.say = world, say
        self._train: _Stream | None = None
        self._next: tuple[int, int] | None = None  # (epoch, row) where the train stream continues
        self._ahead: EpochPlans | None = None

    def __call__(
        self,
        task: Task,
        data: DataConfig,
        plan: Plan,
        index: Any,
        start_row: int,
        seeds: tuple[int, int],
        train: bool,
        ahead: EpochPlans | None = None,
    ) -> Iterable[dict[str, Any]]:
        seed, epoch = seeds
        p = data.preprocess
        share = budget_bytes(p) / self.world
        if plan.locate(start_row)[0] >= plan.windows:
            return iter(())
        if not train or ahead is None:  # an evaluation: an execution of its own, ended with it
            work = _Work(task.preprocessing_copy(), index, epoch, plan, None, seed, p.batch_rows, train)
            units = [(epoch, w, s) for w, s in feed_units(plan, start_row)]
            stream = _Stream(self._start(work, units, p, share * EVAL_SHARE), units)
            return _Rows(_ended(stream.epoch(epoch), stream.execution), stream.execution)
        if self._train is None or self._next != (epoch, start_row) or self._ahead != ahead:
            self.close()
            work = _Work(task.preprocessing_copy(), index, epoch, plan, ahead, seed, p.batch_rows, train)
            units = self._train_units(plan, start_row, epoch, ahead)
            self._train = _Stream(self._start(work, units, p, share * (1 - EVAL_SHARE)), units)
            self._ahead = ahead
        stream = self._train
        self._next = (epoch + 1, 0) if epoch < stream.last_epoch else None
        return _Rows(stream.epoch(epoch), stream.execution)

    @staticmethod
    def _train_units(plan: Plan, start_row: int, epoch: int, ahead: EpochPlans) -> list[tuple[int, int, int]]:
        """The train split's windows from ``start_row`` of ``epoch`` on, then the following epochs'
        whole, up to :data:`AHEAD_EPOCHS` of them and :data:`MAX_UNITS` windows (at least the
        first epoch's)."""
        units = [(epoch, w, s) for w, s in feed_units(plan, start_row)]
        for e in range(epoch + 1, min(ahead.last, epoch + AHEAD_EPOCHS) + 1):
            later = [(e, w, 0) for w in range(ahead(e).windows)]
            if len(units) + len(later) > MAX_UNITS:
                break
            units += later
        return units

    def _start(self, work: _Work, units: list[tuple[int, int, int]], p: PreprocessConfig, memory: float) -> Execution:
        ask = {"CPU": p.num_cpus, "GPU": p.num_gpus, **p.resources}
        starvation = Starvation(ask, p.warn_after_s, p.timeout_s, self.say)
        return Execution(_dataset(work, units, p, self.world, memory), starvation)

    def close(self) -> None:
        """End the train split's execution (its tasks cancelled)."""
        if self._train is not None:
            self._train.execution.close()
        self._train, self._next = None, None


class _Rows:
    """A stream's rows, with what a thread that reads them ahead of the loop needs of its execution:
    ``wanted``, set while the loop waits (the starvation bounds count then), and ``interrupt``, to
    end the thread's wait when the loop closes the stream."""

    def __init__(self, rows: Iterator[dict[str, Any]], execution: Execution):
        self.rows, self.wanted, self.interrupt = rows, execution.wanted, execution.interrupt

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.rows

    def close(self) -> None:
        close(self.rows)


def _ended(rows: Iterator[dict[str, Any]], execution: Execution) -> Iterator[dict[str, Any]]:
    """``rows``, the execution ended with them (read to the end or closed early)."""
    try:
        yield from rows
    finally:
        close(rows)
        execution.close()


__all__ = ["PREPROCESSED_ON", "RayPreprocessing", "block_bytes", "budget_bytes", "ray_batches"]
