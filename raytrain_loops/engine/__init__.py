"""The per-worker training engine. It imports no Ray and runs with or without a process group."""

from raytrain_loops.engine.api import LossFn, LossOutput, StepContext, StepResult
from raytrain_loops.engine.devices import to_device, unwrap
from raytrain_loops.engine.optim.ema import EMA
from raytrain_loops.engine.optim.schedules import schedule_value, schedule_values
from raytrain_loops.engine.update.decision import Decision, Reduced, decide
from raytrain_loops.engine.update.step import Engine
from raytrain_loops.errors import (
    GradSyncError,
    GroupBrokenError,
    LossScaleError,
    NonFiniteError,
    OOMError,
    TrainingError,
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
