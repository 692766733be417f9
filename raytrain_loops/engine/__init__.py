"""The per-worker training engine. It imports no Ray and runs with or without a process group."""

from raytrain_loops.engine.ema import EMA
from raytrain_loops.engine.guards import GradSyncError, LossScaleError, NonFiniteError, OOMError, TrainingError
from raytrain_loops.engine.schedules import schedule_value, schedule_values
from raytrain_loops.engine.step import Engine, LossFn, LossOutput, StepContext, StepResult, to_device, unwrap

__all__ = [
    "EMA",
    "Engine",
    "GradSyncError",
    "LossFn",
    "LossOutput",
    "LossScaleError",
    "NonFiniteError",
    "OOMError",
    "StepContext",
    "StepResult",
    "TrainingError",
    "schedule_value",
    "schedule_values",
    "to_device",
    "unwrap",
]
