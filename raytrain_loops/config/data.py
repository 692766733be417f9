"""The data sections: batching and ingestion (``data``), and where a task's ``preprocess`` runs
(``data.preprocess``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from raytrain_loops.config.base import ConfigError, at_least, opt

__all__ = ["DataConfig", "PreprocessConfig"]


@dataclass(kw_only=True, slots=True)
class PreprocessConfig:
    """Where a task's ``preprocess`` runs on Ray: a Ray Data execution per training worker over that
    worker's windows, in the plan's order, spread over the cluster's nodes, under one memory budget."""

    num_cpus: float = opt(1.0, "CPUs each preprocessing task (or actor) reserves.")
    num_gpus: float = opt(0.0, "GPUs each preprocessing task (or actor) reserves (GPU preprocessing).")
    concurrency: int = opt(
        0,
        "Most preprocessing tasks at once per training worker (0: the cluster's CPUs divided among the training "
        "workers). With data.preprocess.actors, the actors' count is set there instead.",
    )
    actors: list[int] = opt(
        [],
        "[min, max]: preprocess in a pool of between min and max actors per training worker, grown as the "
        "cluster has room (an autoscaling CPU pool is used as it grows); each builds Task.actor_setup's state "
        "once. Empty: Ray tasks, or for a task with actor_setup a pool of [1, the worker's share of the CPUs].",
    )
    batch_rows: int = opt(256, "Rows per call of Task.preprocess.")
    resources: dict[str, float] = opt(
        {},
        "Custom Ray resources each preprocessing task asks too (e.g. {preprocess: 1}: only on nodes that advertise it).",
    )
    memory_gb: float = opt(
        0.0,
        "Object-store memory for preprocessed rows in flight, summed over all training workers, each worker's "
        "executor holding its share (0: a quarter of the cluster's object store when training starts).",
    )
    warn_after_s: float = opt(
        30.0, "A worker that waits this long for preprocessed rows says so on the console, with what it asks for."
    )
    timeout_s: float = opt(600.0, "A worker that waits this long for preprocessed rows stops the run.")

    def __post_init__(self) -> None:
        at_least(self, 0, "num_cpus", "num_gpus", "concurrency", "memory_gb")
        at_least(self, 1, "batch_rows")
        at_least(self, 0.1, "warn_after_s", "timeout_s")
        for name, amount in self.resources.items():
            if name in ("CPU", "GPU", "memory") or amount <= 0:
                raise ConfigError(
                    f"resources.{name}",
                    f"must name a custom resource with an amount > 0 (CPUs: data.preprocess.num_cpus, GPUs: "
                    f"data.preprocess.num_gpus); got {amount}",
                )
        if self.actors and (len(self.actors) != 2 or not 1 <= self.actors[0] <= self.actors[1]):
            raise ConfigError("actors", f"must be [min, max] with 1 <= min <= max, or empty; got {self.actors}")
        if self.actors and self.concurrency:
            raise ConfigError("concurrency", "is the tasks' count: with data.preprocess.actors, set the pool's size there")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Batching and ingestion."""

    batch_size: int = opt(64, "Micro-batch size per worker.")
    eval_batch_size: int = opt(256, "Batch size per worker for evaluation.")
    shuffle_buffer: int = opt(
        10_000,
        "Parquet: rows of each window of a worker's share whose order is permuted (0: no shuffle, storage order); "
        "a window's raw rows are read whole by the task that preprocesses it, and its preprocessed rows travel in "
        "blocks under data.preprocess.memory_gb.",
    )
    shuffle_chunk_rows: int = opt(
        128,
        "Parquet: the split's row groups are cut into chunks of at most this many rows, permuted over the whole split "
        "every epoch and dealt out to the workers; row groups much larger than this are read more than once.",
    )
    dir: str = opt(
        "~/.cache/raytrain_loops",
        "Directory where bundled data sets are written as Parquet: a local path, or a URI pyarrow opens (s3://, gs://), "
        "prepared in a local staging directory and uploaded; a cluster whose nodes share no disk needs a URI.",
    )
    loader_workers: int = opt(0, "DataLoader worker processes for map-style data sets.")
    prefetch_batches: int = opt(
        2,
        "Batches of a Parquet split or a Ray Dataset made ahead on a thread: cut, collated, pinned (without "
        "preprocess, one window read ahead besides); 0: all in the loop's thread.",
    )
    preprocess: PreprocessConfig = opt(PreprocessConfig(), "Where Task.preprocess runs.")
    materialize: Literal["auto", "always", "never"] = opt(
        "auto", "Read Parquet once into Ray's object store instead of every epoch; auto: when under 1 GiB."
    )

    def __post_init__(self) -> None:
        at_least(self, 1, "batch_size", "eval_batch_size")
        at_least(self, 0, "shuffle_buffer", "loader_workers", "prefetch_batches")
        at_least(self, 1, "shuffle_chunk_rows")
