"""A Ray Train v2 ``TorchTrainer`` built from the config."""

from __future__ import annotations

import functools
from typing import Any

import ray
import ray.train
from ray.train.torch import TorchConfig, TorchTrainer

from raytrain_loops import ray_private, storage
from raytrain_loops.callbacks.mlflow_log import TrackedRun
from raytrain_loops.checkpoint.ray_keep_best import KeepBest
from raytrain_loops.config import Config
from raytrain_loops.console.feed import Sender
from raytrain_loops.rundir.stops import StopBoard
from raytrain_loops.tasks import DatasetSplit, ParquetSplit, Task
from raytrain_loops.worker.train import WorkerPayload, train_loop_per_worker


class Trainer(TorchTrainer):
    """Ray Train's ``TorchTrainer`` without its Ray Data actor when no split is a Ray Dataset. The
    workers read their rows themselves (:mod:`raytrain_loops.worker.preprocessing`) and no Ray Dataset is passed, yet Ray Train
    starts a ``DatasetManager`` actor for every run: one more process, which imports Ray Data
    while the workers start, on the cores they start on. Where a
    Ray version has no such callback (:func:`raytrain_loops.ray_private.datasets_callback`),
    every callback is kept."""

    def _create_default_callbacks(self) -> list[Any]:
        callbacks = super()._create_default_callbacks()
        datasets_callback = None if self.datasets else ray_private.datasets_callback()
        if datasets_callback is None:
            return callbacks
        return [c for c in callbacks if not isinstance(c, datasets_callback)]


def elastic(config: Config) -> bool:
    return 1 <= config.scaling.min_workers < config.scaling.num_workers


def scaling_config(config: Config) -> ray.train.ScalingConfig:
    s = config.scaling
    resources = {"CPU": s.cpus_per_worker}
    if s.use_gpu:
        resources["GPU"] = 1
    return ray.train.ScalingConfig(
        num_workers=(s.min_workers, s.num_workers) if elastic(config) else s.num_workers,
        elastic_resize_monitor_interval_s=s.resize_interval_s,
        use_gpu=s.use_gpu,
        resources_per_worker=resources,
        placement_strategy=s.placement_strategy,
    )


def run_config(config: Config, name: str, callbacks: list[Any] | None = None) -> ray.train.RunConfig:
    c = config.checkpoint
    callbacks = list(callbacks or [])
    if c.score_metric:
        run_dir = storage.join(config.run.storage_path, name)
        callbacks.append(KeepBest(run_dir, c.score_metric, c.score_mode, c.keep))
    return ray.train.RunConfig(
        name=name,
        storage_path=config.run.storage_path
        if storage.is_uri(config.run.storage_path)
        else storage.join(config.run.storage_path),
        # A fixed-size group whose resources cannot be had fails the run at once instead of
        # retrying forever. An elastic group retries a start that timed out a few times: right
        # after a node goes, Ray may still count it and ask for one worker too many.
        # A preemption (a node drained with notice) is retried apart from run.max_failures.
        failure_config=ray.train.FailureConfig(
            max_failures=config.run.max_failures,
            max_preemption_failures=config.run.max_preemptions,
            controller_failure_limit=3 if elastic(config) else 0,
        ),
        # Ray keeps the newest, so the one before the newest is always there to fall back to
        # (scored retention could delete it); the best by score_metric are KeepBest's.
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=c.keep or None),
        callbacks=callbacks or None,
    )


MATERIALIZE_BELOW_BYTES = 1 << 30


def hold_in_memory(split: ParquetSplit, config: Config) -> bool:
    """Whether the split's columns are read once on the driver into Ray's object store, from which
    every worker slices its rows instead of reading the files every epoch: ``data.materialize``
    ``always``, or ``auto`` and the columns read under 1 GiB in memory (estimated from the
    footers, :func:`~raytrain_loops.data.footprint.memory_bytes`: the files' size understates a
    dictionary-encoded or compressed column many times over). Either way the rows and their order are
    the same (the plan is defined on the files' row groups)."""
    mode = config.data.materialize
    if mode != "auto":
        return mode == "always"
    return split.index.memory_bytes < MATERIALIZE_BELOW_BYTES


def place_parquet(splits: dict[str, Any], config: Config) -> None:
    """Put the Parquet splits held in memory (:func:`hold_in_memory`) in Ray's object store;
    warn, naming the file, when a streamed split's row groups are so large that every chunk read
    decodes a row group many times its size."""
    for name, split in splits.items():
        if not isinstance(split, ParquetSplit) or split.index.table is not None:
            continue
        if hold_in_memory(split, config):
            split.index.table = ray.put(split.index.read_all())
            continue
        largest, chunk = split.index.largest_group(), config.data.shuffle_chunk_rows
        if name == "train" and largest > 8 * chunk:
            print(
                f"warning: split '{name}' ({split.path}) has row groups of up to {largest} rows; each chunk of "
                f"data.shuffle_chunk_rows={chunk} rows reads a whole row group. Write the files with row groups "
                f"of about {chunk} rows (pyarrow.parquet.write_table(..., row_group_size={chunk})) or raise "
                "data.shuffle_chunk_rows.",
                flush=True,
            )


def build_trainer(
    config: Config,
    task: Task,
    splits: dict[str, Any],
    rows: dict[str, int],
    name: str,
    run_dir: str,
    callbacks: list[Any] | None = None,
    init_checkpoint: str | None = None,
    *,
    board: StopBoard,
    console: Sender | None = None,
    tracking: TrackedRun | None = None,
    precision_warned: bool = False,
) -> TorchTrainer:
    """The trainer for one run. Parquet splits are read by each worker in the epoch's order
    (:mod:`raytrain_loops.data.parquet`); those held in memory are put in Ray's object store here.
    ``init_checkpoint`` starts the run from another run's checkpoint (a PBT donor's); ``board``
    is where its workers post a stop (read it back with :func:`~raytrain_loops.rundir.stops.fit_or_stop`);
    ``console``, where rank 0 sends its progress and evaluation lines (none: its own stdout);
    ``tracking``, the MLflow run rank 0 logs to; ``precision_warned``, that the driver warned of an
    emulated bf16 (rank 0 warns otherwise)."""
    place_parquet(splits, config)
    datasets, splits = ray_datasets(splits)
    payload = WorkerPayload(
        config, task, splits, rows, run_dir, board, init_checkpoint, console, tracking, precision_warned
    )
    return Trainer(
        functools.partial(train_loop_per_worker, payload),
        torch_config=TorchConfig(backend="nccl" if config.scaling.use_gpu else "gloo"),
        scaling_config=scaling_config(config),
        run_config=run_config(config, name, callbacks),
        datasets=datasets or None,
        dataset_config=ray.train.DataConfig(datasets_to_split=list(datasets)) if datasets else None,
    )


def ray_datasets(splits: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The splits that are Ray Datasets, by name, for the trainer's ``datasets=`` (each worker
    reads its ``streaming_split`` shard, :func:`~raytrain_loops.worker.train.dataset_shards`), and
    the splits as they travel to the workers: those without their Dataset."""
    datasets = {name: split.dataset for name, split in splits.items() if isinstance(split, DatasetSplit)}
    return datasets, {name: DatasetSplit(None, split.rows) if name in datasets else split for name, split in splits.items()}
