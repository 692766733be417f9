"""raytrain_loops: the research training loop as one configurable engine, scaled out with Ray.

``fit(config, task=None)`` trains on Ray Train; ``tune(config, sweep)`` runs a Ray Tune search
whose trials are Ray Train runs; ``Task`` is how your model, criterion and data
plug in; ``LossOutput`` is what a criterion returns.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raytrain_loops.config import Config, ConfigError, load_config
    from raytrain_loops.engine import LossOutput, StepContext
    from raytrain_loops.tasks import DatasetSplit, MapSplit, ParquetSplit, Task

# Imported when first asked for: a process that needs only a small part of the package (the
# console's feed actor, the CLI's argument errors) does not import torch through this file.
_LAZY = {
    "Config": "raytrain_loops.config",
    "ConfigError": "raytrain_loops.config",
    "load_config": "raytrain_loops.config",
    "LossOutput": "raytrain_loops.engine",
    "StepContext": "raytrain_loops.engine",
    "MapSplit": "raytrain_loops.tasks",
    "DatasetSplit": "raytrain_loops.tasks",
    "ParquetSplit": "raytrain_loops.tasks",
    "Task": "raytrain_loops.tasks",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Config",
    "ConfigError",
    "LossOutput",
    "MapSplit",
    "DatasetSplit",
    "ParquetSplit",
    "StepContext",
    "Task",
    "fit",
    "load_config",
    "tune",
]


def fit(config: Any, task: Task | None = None, overrides: list[str] | None = None):
    """Train on Ray Train; see :func:`raytrain_loops.driver.fit.fit`."""
    from raytrain_loops.driver.fit import fit as _fit

    return _fit(config, task=task, overrides=overrides)


def tune(config: Any, sweep: Any, task: Task | None = None, overrides: list[str] | None = None):
    """A Ray Tune search over ``config``; see :func:`raytrain_loops.sweeps.tune.tune`."""
    from raytrain_loops.sweeps.tune import tune as _tune

    return _tune(config, sweep, task=task, overrides=overrides)
