"""What Ray Train runs on every worker of ``raytrain-loops evaluate``: the checkpoint evaluated as
in any process (:func:`raytrain_loops.runtime.evaluate.evaluate_checkpoint`) with the Ray parts
of a training worker (the model under DDP or FSDP2, the preprocessing tasks); rank 0 hands the
metrics to the driver's :class:`MetricsBox` (Ray Train keeps only the metrics of reports that
carry a checkpoint, and an evaluation writes none)."""

from __future__ import annotations

from typing import Any

import ray
import ray.train
import ray.train.torch

from raytrain_loops.runtime.evaluate import evaluate_checkpoint
from raytrain_loops.runtime.wiring import WorkerPayload
from raytrain_loops.worker.preprocessing import ray_batches
from raytrain_loops.worker.train import dataset_shards, prepare_model

PUT_TIMEOUT_S = 60.0


@ray.remote(num_cpus=0)
class MetricsBox:
    """Holds the metrics rank 0 puts, for the driver that created it."""

    def __init__(self):
        self.metrics: dict[str, Any] | None = None

    def put(self, metrics: dict[str, Any]) -> None:
        self.metrics = metrics

    def get(self) -> dict[str, Any] | None:
        return self.metrics


def evaluate_per_worker(payload: WorkerPayload, box: Any) -> None:
    """Ray Train's entry point on every worker of an evaluation; rank 0 puts the metrics in ``box``."""
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    payload = dataset_shards(payload)  # a Ray Dataset's split: this worker's shard
    metrics = evaluate_checkpoint(payload, rank, world, device, prepare_model=prepare_model, batches=ray_batches)
    if rank == 0:
        ray.get(box.put.remote(metrics), timeout=PUT_TIMEOUT_S)
