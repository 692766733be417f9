"""A Ray Train v2 ``TorchTrainer`` built from the config."""

from __future__ import annotations

import functools
from typing import Any

import ray.data
import ray.train
from ray.train.torch import TorchConfig, TorchTrainer

from raytrain_loops import storage
from raytrain_loops.callbacks.mlflow_log import TrackedRun
from raytrain_loops.config import Config
from raytrain_loops.console.feed import Sender
from raytrain_loops.controller.keep_best import KeepBest
from raytrain_loops.driver.stops import StopBoard
from raytrain_loops.tasks import ParquetSplit, Task
from raytrain_loops.worker.train import WorkerPayload, train_loop_per_worker


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
        failure_config=ray.train.FailureConfig(
            max_failures=config.run.max_failures,
            controller_failure_limit=3 if elastic(config) else 0,
        ),
        # Ray keeps the newest, so the one before the newest is always there to fall back to
        # (scored retention could delete it); the best by score_metric are KeepBest's.
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=c.keep or None),
        callbacks=callbacks or None,
    )


def data_config() -> ray.train.DataConfig:
    """How Parquet splits are sharded: equal shares whatever node each worker runs on.

    With shard locality on, Ray Data would hand a block to the worker on the node holding it,
    so the rows a worker gets would follow where the workers happened to be scheduled, and a
    restarted group placed differently would resume on other rows. Ray 2.60 already ignores
    locality under ``preserve_order`` (set below); this keeps the guarantee explicit.
    """
    return ray.train.DataConfig(enable_shard_locality=False)


MATERIALIZE_BELOW_BYTES = 1 << 30


def parquet_dataset(split: ParquetSplit, config: Config) -> ray.data.Dataset:
    """A Ray Data dataset over the split's columns.

    Small data (under 1 GiB with ``data.materialize=auto``) is read once on the driver with
    pyarrow and put in Ray's object store: no read tasks to schedule, and no re-reading of the
    files every epoch. Larger data streams from the files (``always`` materializes it first).
    """
    import pyarrow.dataset as pads

    mode = config.data.materialize
    if mode != "never":
        files = pads.dataset(split.path, format="parquet")
        size = sum(files.filesystem.get_file_info(f).size or 0 for f in files.files)
        if size < MATERIALIZE_BELOW_BYTES:
            return ray.data.from_arrow(files.to_table(columns=split.columns))
    ds = ray.data.read_parquet(split.path).select_columns(split.columns)
    return ds.materialize() if mode == "always" else ds


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
    """The trainer for one run. Parquet splits become Ray Data datasets sharded per worker.
    ``init_checkpoint`` starts the run from another run's checkpoint (a PBT donor's); ``board``
    is where its workers post a stop (read it back with :func:`~raytrain_loops.driver.stops.fit_or_stop`);
    ``console``, where rank 0 sends its progress and evaluation lines (none: its own stdout);
    ``tracking``, the MLflow run rank 0 logs to; ``precision_warned``, that the driver warned of an
    emulated bf16 (rank 0 warns otherwise)."""
    datasets = {
        split_name: parquet_dataset(split, config)
        for split_name, split in splits.items()
        if isinstance(split, ParquetSplit)
    }
    # Every worker's shard in the same order on every run: with the seeded shuffle in the worker,
    # an epoch's batches depend on the seed only, which an exact mid-epoch resume needs. Ray Train
    # copies the driver's DataContext when the trainer is built.
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    payload = WorkerPayload(
        config, task, splits, rows, run_dir, board, init_checkpoint, console, tracking, precision_warned
    )
    return TorchTrainer(
        functools.partial(train_loop_per_worker, payload),
        torch_config=TorchConfig(backend="nccl" if config.scaling.use_gpu else "gloo"),
        scaling_config=scaling_config(config),
        run_config=run_config(config, name, callbacks),
        datasets=datasets or None,
        dataset_config=data_config(),
    )
