"""Tasks: model + criterion + data + evaluation, one per seed family.

The built-in tasks are imported when first named (``build_task``, or an attribute of this
package): each pulls in its own libraries (torchmetrics and SciPy for detection), and every Ray
actor that imports this package (the workers, the Train controller, the console's feed) would
otherwise pay for all of them at start-up.
"""

from __future__ import annotations

import importlib
from typing import Any

from raytrain_loops.tasks.base import (
    BUILTIN_CLASSES,
    BUILTIN_PATHS,
    DatasetSplit,
    EvalOutput,
    MapSplit,
    ParquetSplit,
    Task,
    build_task,
    builtin,
    has_actor_setup,
    has_preprocess,
    set_up_once,
)


def __getattr__(attr: str) -> Any:  # ``from raytrain_loops.tasks import DetrTask`` imports it then
    if attr in BUILTIN_CLASSES:
        return getattr(importlib.import_module(BUILTIN_CLASSES[attr]), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


__all__ = [
    "BUILTIN_PATHS",
    "CvnetsTask",
    "DetrTask",
    "DigitsTask",
    "DinoTask",
    "EvalOutput",
    "HFLMTask",
    "ImagesTask",
    "LMTask",
    "MapSplit",
    "DatasetSplit",
    "ParquetSplit",
    "SeamsegTask",
    "Task",
    "build_task",
    "builtin",
    "has_actor_setup",
    "has_preprocess",
    "set_up_once",
]
