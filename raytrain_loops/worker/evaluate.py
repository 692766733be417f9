"""What Ray Train runs on every worker of ``raytrain-loops evaluate``: the checkpoint evaluated as
in any process (:func:`raytrain_loops.runtime.evaluation.evaluate_checkpoint`) with the Ray parts
of a training worker (the model under DDP or FSDP2, Ray Data's preprocessing), and the metrics
reported to the driver."""

from __future__ import annotations

import ray.train
import ray.train.torch

from raytrain_loops.runtime.evaluation import evaluate_checkpoint
from raytrain_loops.runtime.wiring import WorkerPayload
from raytrain_loops.worker.batches import ray_batches
from raytrain_loops.worker.train import prepare_model


def evaluate_per_worker(payload: WorkerPayload) -> None:
    """Ray Train's entry point on every worker of an evaluation: rank 0's metrics are the result's."""
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    metrics = evaluate_checkpoint(payload, rank, world, device, prepare_model=prepare_model, batches=ray_batches)
    ray.train.report(metrics)
