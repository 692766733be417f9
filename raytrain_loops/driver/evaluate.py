"""``raytrain-loops evaluate``; runs on the driver: a checkpoint evaluated again on its run's eval
split, with its run's config (``config.yaml`` beside it, overrides on top), on Ray with the run's
``scaling`` or in this process (``scaling.num_workers=0``). The same evaluation as the loop's at
the checkpoint's step (:mod:`raytrain_loops.runtime.evaluate`): with the buffers of rank 0 that
the checkpoint holds, an evaluation at step N and ``evaluate`` of checkpoint N agree.

Nothing read runs code: the checkpoint is checked (manifests, checksums) before any work and read
with ``weights_only=True``, and a task named in ``config.yaml`` is built only when it is a built-in
one, or when the caller names it again (``task.name=...``)."""

from __future__ import annotations

import dataclasses
import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import yaml

from raytrain_loops import storage
from raytrain_loops.checkpoint import CheckpointError, check_sharded, is_sharded, manifest_name, verify
from raytrain_loops.config import Config, load_config
from raytrain_loops.driver.preflight import DataError, prepare
from raytrain_loops.engine.update import precision
from raytrain_loops.errors import EvaluateError
from raytrain_loops.rundir.layout import PRECISION_FILE
from raytrain_loops.runtime.wiring import WorkerPayload
from raytrain_loops.tasks import BUILTIN_PATHS

CONFIG_FILE = "config.yaml"
EVALUATION_ONLY = ["run.max_failures=0", "scaling.min_workers=0", "fault.plan=[]"]
"""What an evaluation leaves out of its run's config: retries, an elastic group, injected faults
(refused in local mode, meaningless in one evaluation)."""


def checked_checkpoint(path: str) -> str:
    """``path`` as a checkpoint directory of a run, its files checked (a local one: manifests and
    checksums, a sharded one's metadata; one in an object store is checked by the workers that
    read it). Raises :class:`EvaluateError` naming it."""
    if storage.is_uri(path):
        if not storage.exists(storage.join(path, manifest_name(0))):
            raise EvaluateError(f"{path} is not a checkpoint: it holds no {manifest_name(0)}")
        return path.rstrip("/")
    local = Path(path).expanduser().resolve()
    if not local.is_dir():
        raise EvaluateError(f"{path} is not a checkpoint: no such directory")
    if not (local / manifest_name(0)).is_file():
        raise EvaluateError(
            f"{path} is not a checkpoint: it holds no {manifest_name(0)} (a run's checkpoint_<step>)"
        )
    try:
        verify(local)
        if is_sharded(local):
            check_sharded(local)
    except CheckpointError as err:
        raise EvaluateError(f"{path} is damaged: {err}") from None
    return str(local)


def run_config(checkpoint: str, overrides: list[str]) -> tuple[str, Config]:
    """The run directory holding ``checkpoint`` and its ``config.yaml`` with ``overrides`` on top
    (and :data:`EVALUATION_ONLY`), ``precision.dtype=auto`` as the run's
    ``precision.json`` recorded it."""
    run_dir = checkpoint.rsplit("/", 1)[0] if storage.is_uri(checkpoint) else str(Path(checkpoint).parent)
    where = storage.join(run_dir, CONFIG_FILE)
    text = storage.read_text(where)
    if text is None:
        raise EvaluateError(f"{where} does not exist: {checkpoint} is not in a run directory with its config")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise EvaluateError(f"{where} is not YAML: {err}") from None
    if not isinstance(data, dict):
        raise EvaluateError(f"{where} is not a mapping of config sections")
    name = (data.get("task") or {}).get("name", "")
    if name not in BUILTIN_PATHS and not any(o.startswith("task.name=") for o in overrides):
        raise EvaluateError(
            f"{where} names the task {name!r}, not a built-in one: evaluate imports no module named in a "
            f"run's files; name it yourself to import it (task.name={name})"
        )
    config = load_config(data, [*EVALUATION_ONLY, *overrides])
    if config.precision.dtype == "auto":  # the dtype the run resolved it to, as a resumed run takes it
        text = storage.read_text(storage.join(run_dir, PRECISION_FILE))
        recorded = json.loads(text).get("dtype") if text else None
        if recorded in precision.RESOLVED:
            config = dataclasses.replace(config, precision=dataclasses.replace(config.precision, dtype=recorded))
    return run_dir, config


def evaluate_checkpoint(checkpoint: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """The eval metrics of ``checkpoint`` (``eval_*``, ``eval_ema_*``, its ``step`` and ``epoch``)
    on its run's eval split, on Ray or, with ``scaling.num_workers=0`` among ``overrides``, here.
    Raises :class:`EvaluateError`, ``ConfigError`` or ``DataError`` before any work starts."""
    checkpoint = checked_checkpoint(checkpoint)
    run_dir, config = run_config(checkpoint, list(overrides or []))
    task, splits, rows = prepare(config, None)
    if "eval" not in splits:
        raise DataError(f"task {config.task.name!r} has no 'eval' split to evaluate {checkpoint} on")
    payload = WorkerPayload(config, task, splits, rows, run_dir, None, init_checkpoint=checkpoint)
    if config.scaling.local:
        from raytrain_loops.runtime.local import evaluate_local

        return evaluate_local(payload)
    return _on_ray(payload)


def _on_ray(payload: WorkerPayload) -> dict[str, Any]:
    """One evaluation by a Ray Train group of the run's scaling; Ray Train's own files in a scratch
    directory (the run's directory is only read), the metrics through a :class:`MetricsBox`."""
    import ray
    import ray.train
    from ray.train.torch import TorchConfig

    from raytrain_loops.driver.ray_start import ensure_ray
    from raytrain_loops.driver.trainer import Trainer, place_parquet, ray_datasets, scaling_config
    from raytrain_loops.worker.evaluate import MetricsBox, evaluate_per_worker

    config = payload.config
    s = config.scaling
    ensure_ray(config, s.num_workers * s.cpus_per_worker + config.data.preprocess.num_cpus)
    place_parquet(payload.splits, config)
    datasets, splits = ray_datasets(payload.splits)
    payload = dataclasses.replace(payload, splits=splits)
    box = MetricsBox.remote()
    with tempfile.TemporaryDirectory(prefix="raytrain-evaluate-") as scratch:
        trainer = Trainer(
            functools.partial(evaluate_per_worker, payload, box),
            torch_config=TorchConfig(backend="nccl" if s.use_gpu else "gloo"),
            scaling_config=scaling_config(config),
            run_config=ray.train.RunConfig(
                name="evaluate", storage_path=scratch, failure_config=ray.train.FailureConfig(max_failures=0)
            ),
            datasets=datasets or None,
            dataset_config=ray.train.DataConfig(datasets_to_split=list(datasets)) if datasets else None,
        )
        trainer.fit()
    metrics = ray.get(box.get.remote(), timeout=60)
    if not metrics:
        raise RuntimeError(f"the evaluation of {payload.init_checkpoint} ended without metrics")
    return metrics
