"""The run config: every section composed, loadable from a recipe YAML with dotted overrides."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_loops.config.base import ConfigError, apply_overrides, from_dict, opt, read_yaml, to_dict
from raytrain_loops.config.engine import (
    AccumConfig,
    ClipConfig,
    EMAConfig,
    FreezeConfig,
    LoggingConfig,
    LossConfig,
    NonFiniteConfig,
    OOMConfig,
    OptimConfig,
    PrecisionConfig,
    Schedule,
    default_schedules,
)

__all__ = ["Config", "LoopConfig", "TaskConfig", "load_config"]


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """What is trained: a built-in task name or ``package.module:factory``, and its parameters."""

    name: str = opt("digits", "Built-in task name, or 'package.module:callable' returning a Task.")
    params: dict[str, Any] = opt({}, "Keyword arguments for the task.")


@dataclass(kw_only=True, slots=True)
class LoopConfig:
    """Length of training. Counted in optimizer steps; epochs are derived from the data."""

    max_steps: int = opt(0, "Optimizer steps to run; 0 means epochs x steps per epoch.")
    epochs: int = opt(1, "Passes over the training data when max_steps is 0.")
    seed: int = opt(0, "Seed for initialisation, data order and dropout (each worker offsets it by its rank).")

    def __post_init__(self) -> None:
        if self.max_steps < 0:
            raise ConfigError("max_steps", f"must be >= 0; got {self.max_steps}")
        if self.epochs < 1:
            raise ConfigError("epochs", f"must be >= 1; got {self.epochs}")


@dataclass(kw_only=True, slots=True)
class Config:
    """Everything a run needs. Sections are addressed by dotted keys: ``precision.dtype=bf16``."""

    task: TaskConfig = opt(TaskConfig(), "The task: model, criterion and data.")
    loop: LoopConfig = opt(LoopConfig(), "Length of training.")
    optim: OptimConfig = opt(OptimConfig(), "Optimizer and parameter groups.")
    schedules: dict[str, Schedule] = opt(
        default_schedules(),
        "Values as functions of the step: lr, weight_decay, ema_momentum, and any named value for the criterion.",
    )
    precision: PrecisionConfig = opt(PrecisionConfig(), "Autocast and loss scaling.")
    accum: AccumConfig = opt(AccumConfig(), "Gradient accumulation.")
    loss: LossConfig = opt(LossConfig(), "Loss reduction across micro-batches and workers.")
    clip: ClipConfig = opt(ClipConfig(), "Gradient clipping.")
    freeze: FreezeConfig = opt(FreezeConfig(), "Last-layer freezing.")
    ema: EMAConfig = opt(EMAConfig(), "Weight EMA / momentum teacher.")
    nonfinite: NonFiniteConfig = opt(NonFiniteConfig(), "Non-finite loss or gradient policy.")
    oom: OOMConfig = opt(OOMConfig(), "Out-of-memory policy.")
    logging: LoggingConfig = opt(LoggingConfig(), "Metric cadence.")

    def __post_init__(self) -> None:
        for name in ("lr", "weight_decay", "ema_momentum"):
            if name not in self.schedules:
                raise ConfigError(f"schedules.{name}", "is required")
        lr = self.schedules["lr"]
        if lr.value < 0 or lr.end < 0:
            raise ConfigError("schedules.lr", f"learning rates must be >= 0; got value={lr.value}, end={lr.end}")
        m = self.schedules["ema_momentum"]
        for what, v in (("value", m.value), ("end", m.end if m.kind in ("cosine", "linear") else m.value)):
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"schedules.ema_momentum.{what}", f"must be in [0, 1]; got {v}")

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (YAML/JSON-safe) of the whole config."""
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Config:
        """Build and validate a config from a plain dict."""
        return from_dict(cls, data)


def load_config(source: str | Path | dict[str, Any] | None = None, overrides: list[str] | None = None) -> Config:
    """Load a config from a YAML path or a dict, then apply dotted ``key=value`` overrides.

    Overrides are applied to the fully resolved config (defaults included), so they can address
    any key, and are validated with the same rules as the file.
    """
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, dict):
        data = source
    else:
        data = read_yaml(source)
    base = Config.from_dict(data)
    if not overrides:
        return base
    return Config.from_dict(apply_overrides(base.to_dict(), overrides))
