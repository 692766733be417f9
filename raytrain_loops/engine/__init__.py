"""The per-worker training engine. It imports no Ray and runs with or without a process group."""

from raytrain_loops.engine.ema import EMA
from raytrain_loops.engine.guards import (
    GradSyncError,
    GroupBrokenError,
    LossScaleError,
    NonFiniteError,
    OOMError,
    TrainingError,
)
from raytrain_loops.engine.schedules import schedule_value, schedule_values
from raytrain_loops.engine.step import (
    Decision,
    Engine,
    LossFn,
    LossOutput,
    Reduced,
    StepContext,
    StepResult,
    decide,
    to_device,
    unwrap,
)

__all__ = [
    "Decision",
    "EMA",
    "Engine",
    "GradSyncError",
    "GroupBrokenError",
    "LossFn",
    "LossOutput",
    "LossScaleError",
    "NonFiniteError",
    "OOMError",
    "Reduced",
    "StepContext",
    "StepResult",
    "TrainingError",
    "decide",
    "schedule_value",
    "schedule_values",
    "to_device",
    "unwrap",
]
