"""This worker's batches on Ray: :class:`~raytrain_loops.runtime.batches.Batches` on this worker's
device, a task's :meth:`~raytrain_loops.tasks.Task.preprocess` run by Ray Data tasks on the
cluster's CPUs (:func:`preprocessed`). The loop's :class:`~raytrain_loops.engine.loop.BatchSource`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import ray.train
import ray.train.torch

from raytrain_loops.config import Config
from raytrain_loops.config.run import DataConfig
from raytrain_loops.runtime.batches import Batches, Plan, read_and_preprocess
from raytrain_loops.streams import close
from raytrain_loops.tasks import Task


def ray_batches(task: Task, config: Config, splits: dict[str, Any], rows: dict[str, int], rank: int, world: int):
    """This worker's batch source: pinned batches on a GPU worker (the engine's non_blocking
    copies are then asynchronous), preprocessing by Ray Data."""
    return Batches(task, config, splits, rows, rank, world, ray.train.torch.get_device(), preprocessed)


NODE = "_preprocessed_on"
"""The column a Ray Data task adds to its rows: the id of the node it ran on (taken off on the worker)."""

PREPROCESSED_ON: Counter[str] = Counter()
"""Rows preprocessed for this worker process, per node: recorded in every checkpoint's rank file."""


def _read_and_preprocess(ids: dict[str, np.ndarray], *, first: int, **kwargs: Any) -> Iterator[dict[str, np.ndarray]]:
    """A Ray Data task's work: windows ``first + id`` of the plan, read and preprocessed, each row
    marked with this task's node."""
    node = ray.get_runtime_context().get_node_id()
    for batch in read_and_preprocess(windows=[first + int(i) for i in ids["id"]], first=first, **kwargs):
        n = len(next(iter(batch.values()))) if batch else 0
        yield {**batch, NODE: np.full(n, node, dtype=object)}


def _counted(batches: Iterable[dict[str, np.ndarray]]) -> Iterator[dict[str, np.ndarray]]:
    """``batches`` without the node column, its rows counted per node in :data:`PREPROCESSED_ON`."""
    try:
        for batch in batches:
            nodes, counts = np.unique(batch.pop(NODE).astype(str), return_counts=True)
            PREPROCESSED_ON.update(dict(zip(nodes.tolist(), counts.tolist(), strict=True)))
            yield batch
    finally:
        close(batches)  # Ray Data's iterator ends with the epoch, not with the garbage collector


def preprocessed(
    task: Task, data: DataConfig, plan: Plan, index: Any, start_row: int, seeds: tuple[int, int], train: bool
) -> Iterable[dict[str, Any]]:
    """The plan's windows (a re-cut part's: its segments) from ``start_row`` on, read and passed through ``task.preprocess`` by
    Ray Data tasks (``data.preprocess``: CPUs each, how many at once) wherever the cluster has
    CPUs, streamed to this worker in the plan's order. Ray Data's streaming executor runs on a
    thread of this process (a one-way ``streaming_split`` would move it to a coordinator actor,
    but at the cost of a process started for every epoch and evaluation: measured, not kept)."""
    import ray.data

    first, skip = plan.locate(start_row)
    count = plan.windows - first
    if count <= 0:
        return
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # the plan's order, whichever task finishes first
    context.enable_progress_bars = False  # they would interleave with the training progress lines
    p = data.preprocess
    ds = ray.data.range(count, override_num_blocks=count).map_batches(
        _read_and_preprocess,
        batch_size=1,
        fn_kwargs={
            "task": task.preprocessing_copy(),  # no weights, no driver paths
            "index": index,
            "plan": plan,
            "first": first,
            "skip": skip,
            "seeds": seeds,
            "rows": p.batch_rows,
            "train": train,
        },
        num_cpus=p.num_cpus,
        compute=ray.data.TaskPoolStrategy(size=p.concurrency or None),
    )
    yield from _counted(ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=data.prefetch_batches))
