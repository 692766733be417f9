"""This worker's batches on Ray: :class:`~raytrain_loops.runtime.batches.Batches` on this worker's
device, a task's :meth:`~raytrain_loops.tasks.Task.preprocess` run by Ray tasks on the cluster's
CPUs, one window of the plan each (:func:`preprocessed`). The loop's
:class:`~raytrain_loops.engine.loop.BatchSource`."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any

import ray.train
import ray.train.torch

from raytrain_loops.config import Config
from raytrain_loops.config.run import DataConfig
from raytrain_loops.data.parquet import prefetched
from raytrain_loops.runtime.batches import Batches, Plan, Unit, preprocess_unit, preprocessing_units
from raytrain_loops.streams import close
from raytrain_loops.tasks import Task


def ray_batches(task: Task, config: Config, splits: dict[str, Any], rows: dict[str, int], rank: int, world: int):
    """This worker's batch source: pinned batches on a GPU worker (the engine's non_blocking
    copies are then asynchronous), preprocessing by Ray tasks."""
    return Batches(task, config, splits, rows, rank, world, ray.train.torch.get_device(), preprocessed)


NODE = "_preprocessed_on"
"""The key a preprocessing task adds to each part it returns: the id of the node it ran on (taken
off on the worker)."""

PREPROCESSED_ON: Counter[str] = Counter()
"""Rows preprocessed for this worker process, per node: recorded in every checkpoint's rank file."""

WAIT_S = 600.0
"""The longest this worker waits for one of its preprocessing tasks to finish: a task that cannot
start (no node with ``data.preprocess.num_cpus`` free) or that hangs stops the epoch with an error
instead of holding the run."""


@ray.remote
def _read_and_preprocess(
    task: Task, index: Any, plan: Plan, unit: Unit, seeds: tuple[int, int], rows: int, train: bool
) -> list[dict[str, Any]]:
    """A preprocessing task's work: the parts of ``unit`` (a window or part of one), each marked
    with this task's node."""
    node = ray.get_runtime_context().get_node_id()
    return [{**part, NODE: node} for part in preprocess_unit(task, index, plan, unit, seeds, rows, train)]


def _ordered(submit: Callable[[Any], Any], units: Iterable[Any], running: int, waiting: int, why: str) -> Iterator[Any]:
    """The results of ``submit(unit)`` (a Ray task's object ref) for each of ``units``, in their
    order: at most ``running`` tasks unfinished at once, and at most ``waiting`` more finished and
    not yet taken. A task that finishes frees its place at once, whichever it is; each wait is
    bounded by :data:`WAIT_S` (``why``: what the error then says). The tasks not taken are
    cancelled when the stream closes."""
    left, ahead = iter(units), deque()
    try:
        while True:
            done, busy = ray.wait(list(ahead), num_returns=len(ahead), timeout=0) if ahead else ([], [])
            room = min(running - len(busy), running + waiting - len(ahead))
            for unit in islice(left, max(0, room)):
                ahead.append(submit(unit))
                busy.append(ahead[-1])
            if not ahead:
                return
            if ahead[0] in done:
                yield ray.get(ahead.popleft(), timeout=WAIT_S)
            elif not ray.wait(busy, num_returns=1, timeout=WAIT_S)[0]:
                raise TimeoutError(f"no preprocessing task finished in {WAIT_S:g} s: {why}")
    finally:
        for ref in ahead if ray.is_initialized() else ():
            ray.cancel(ref)


def _counted(batches: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """``batches`` without their node, their rows counted per node in :data:`PREPROCESSED_ON`."""
    try:
        for batch in batches:
            node = batch.pop(NODE)
            PREPROCESSED_ON[node] += len(next(iter(batch.values()))) if batch else 0
            yield batch
    finally:
        close(batches)  # the tasks ahead cancelled, the thread ended, with the epoch


def _cpus_allow(num_cpus: float) -> int:
    """How many tasks of ``num_cpus`` CPUs the cluster's CPUs run at once (at least one)."""
    cpus = ray.cluster_resources().get("CPU", 1.0)
    return max(1, int(cpus // num_cpus) if num_cpus > 0 else int(cpus))


def _parts(
    task: Task, data: DataConfig, plan: Plan, index: Any, start_row: int, seeds: tuple[int, int], train: bool
) -> Iterator[dict[str, Any]]:
    """The parts of the plan's windows from ``start_row`` on, in the plan's order, each marked with
    the node that preprocessed it."""
    p = data.preprocess
    shared = [ray.put(x) for x in (task.preprocessing_copy(), index, plan)]  # stored once, read by every task
    call = _read_and_preprocess.options(num_cpus=p.num_cpus, resources=p.resources, scheduling_strategy="SPREAD")

    def submit(unit: Unit) -> Any:
        return call.remote(*shared, unit, seeds, p.batch_rows, train)

    running = p.concurrency or _cpus_allow(p.num_cpus)
    why = f"is a node with data.preprocess.num_cpus={p.num_cpus:g} CPUs free?"
    units = preprocessing_units(plan, start_row, p.batch_rows)
    for window in _ordered(submit, units, running, max(1, data.prefetch_batches), why):
        yield from window


def preprocessed(
    task: Task, data: DataConfig, plan: Plan, index: Any, start_row: int, seeds: tuple[int, int], train: bool
) -> Iterable[dict[str, Any]]:
    """The plan's windows (a re-cut part's: its segments) from ``start_row`` on, read and passed
    through ``task.preprocess`` by Ray tasks (``data.preprocess``: CPUs each, how many at once)
    wherever the cluster has CPUs (spread over its nodes), streamed to this worker in the plan's
    order by a background thread that keeps the tasks going while the step runs.

    Plain Ray tasks, one window each, not Ray Data: a Ray Data execution per epoch and per
    evaluation took 2.5-5.8 s for rows one thread decodes in 1.3 s (its first batch 6-7 s on a
    loaded machine, against 0.5 s here); a task starts in milliseconds. Long-lived actors or
    pipelines would hold their CPUs between epochs, which other workers' tasks then wait for."""
    if plan.locate(start_row)[0] >= plan.windows:
        return iter(())
    parts = _parts(task, data, plan, index, start_row, seeds, train)
    return _counted(prefetched(parts, max(1, data.prefetch_batches)))
