"""What a sweep's trials take of the cluster; runs on the driver: each trial's driver function, its
Train workers and their preprocessing, how many trials run at once, and the refusal of a sweep
whose one trial the cluster cannot hold."""

from __future__ import annotations

import math
from typing import Any

from raytrain_loops.config import Config, ConfigError
from raytrain_loops.config.sweep import SweepConfig
from raytrain_loops.driver.ray_start import ensure_ray
from raytrain_loops.tasks import ParquetSplit, Task, has_preprocess

DRIVER_CPUS = 0.25  # the per-trial driver function only waits on its TorchTrainer


def preprocess_cpus_per_worker(config: Config, task: Task, splits: dict[str, Any]) -> float:
    """The CPUs a training worker's preprocessing holds while it trains: one preprocessing task's
    (``data.preprocess.num_cpus``) for a task with ``preprocess`` over a Parquet split, none
    otherwise."""
    if not has_preprocess(task) or not any(isinstance(s, ParquetSplit) for s in splits.values()):
        return 0.0
    return config.data.preprocess.num_cpus


def trial_cpus(config: Config, per_worker_preprocess: float) -> float:
    """The CPUs one trial holds: its driver function, its Train workers (``cpus_per_worker`` each,
    on GPUs too) and their preprocessing."""
    s = config.scaling
    return DRIVER_CPUS + s.num_workers * (s.cpus_per_worker + per_worker_preprocess)


def local_cpus(sweep: SweepConfig, per_trial: float) -> float:
    """The logical CPUs a local Ray started for the sweep needs: ``max_concurrent_trials`` trials
    (at least one) side by side."""
    return max(1, sweep.max_concurrent_trials) * per_trial


def concurrency(sweep: SweepConfig, per_trial: float) -> int:
    """``max_concurrent_trials``, or as many trials as the cluster's GPUs (or CPUs, each trial's
    preprocessing counted in ``per_trial``) hold at once."""
    import ray

    if sweep.max_concurrent_trials:
        return sweep.max_concurrent_trials
    resources = ray.cluster_resources()
    t = sweep.trial
    if t.use_gpu:
        by_gpus = int(resources.get("GPU", 0) // t.num_workers)
        return max(1, min(by_gpus, math.floor(resources.get("CPU", 0) / per_trial)))
    return max(1, math.floor(resources.get("CPU", 0) / per_trial))


def check_trial_fits(config: Config, per_worker_preprocess: float) -> None:
    """Refuse a sweep whose one trial, with its preprocessing, is more than the cluster's CPUs: its
    preprocessing tasks would wait for CPUs that never free. A cluster that cannot hold the
    trial's training workers yet is scaling up (its nodes come from zero) and is not judged."""
    import ray

    s = config.scaling
    there = float(ray.cluster_resources().get("CPU", 0))
    workers = s.num_workers * s.cpus_per_worker
    needed = trial_cpus(config, per_worker_preprocess)
    if there < workers or needed <= there:
        return
    raise ConfigError(
        "trial",
        f"one trial needs {needed:g} CPUs ({DRIVER_CPUS:g} for its driver, {workers:g} for its "
        f"{s.num_workers} workers, {s.num_workers * per_worker_preprocess:g} for their preprocessing at "
        f"data.preprocess.num_cpus={config.data.preprocess.num_cpus:g} each), but the cluster has {there:g}: "
        "its preprocessing tasks would wait for CPUs that never free. Lower trial.num_workers, "
        "trial.cpus_per_worker or data.preprocess.num_cpus, or add CPUs",
    )


def start_ray(base: Config, sweep: SweepConfig, task: Task, splits: dict[str, Any]) -> float:
    """Join the cluster, or start a local Ray that holds the trials asked to run at once, each with
    its workers' preprocessing (logical CPUs may exceed the cores); refuse a sweep whose one trial
    the cluster cannot hold. The CPUs one trial holds."""
    preprocessing = preprocess_cpus_per_worker(base, task, splits)
    per_trial = trial_cpus(base, preprocessing)
    ensure_ray(base, num_cpus=local_cpus(sweep, per_trial))
    check_trial_fits(base, preprocessing)
    return per_trial
