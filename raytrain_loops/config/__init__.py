"""Typed configuration: one small dataclass per concern, composed into :class:`Config`."""

from raytrain_loops.config.base import ConfigError, apply_overrides, from_dict, to_dict
from raytrain_loops.config.engine import (
    AccumConfig,
    ClipConfig,
    EMAConfig,
    EngineConfig,
    FreezeConfig,
    GradSyncConfig,
    LoggingConfig,
    LossConfig,
    NonFiniteConfig,
    OOMConfig,
    OptimConfig,
    PrecisionConfig,
    Schedule,
)
from raytrain_loops.config.run import Config, LoopConfig, TaskConfig, load_config

__all__ = [
    "AccumConfig",
    "ClipConfig",
    "Config",
    "ConfigError",
    "EMAConfig",
    "EngineConfig",
    "FreezeConfig",
    "GradSyncConfig",
    "LoggingConfig",
    "LoopConfig",
    "LossConfig",
    "NonFiniteConfig",
    "OOMConfig",
    "OptimConfig",
    "PrecisionConfig",
    "Schedule",
    "TaskConfig",
    "apply_overrides",
    "from_dict",
    "load_config",
    "to_dict",
]
