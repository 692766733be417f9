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
    DatasetSplit,
    EvalOutput,
    MapSplit,
    ParquetSplit,
    Task,
    build_task,
    has_actor_setup,
    has_preprocess,
    set_up_once,
)

# name -> (module, class) of the built-in tasks.
BUILTIN_PATHS = {
    "digits": ("raytrain_loops.tasks.digits", "DigitsTask"),
    "cvnets": ("raytrain_loops.tasks.cvnets", "CvnetsTask"),
    "dino": ("raytrain_loops.tasks.dino", "DinoTask"),
    "detr": ("raytrain_loops.tasks.detr", "DetrTask"),
    "lm": ("raytrain_loops.tasks.lm", "LMTask"),
    "seamseg": ("raytrain_loops.tasks.seamseg", "SeamsegTask"),
    "images": ("raytrain_loops.tasks.images", "ImagesTask"),
    "hf_lm": ("raytrain_loops.tasks.hf_lm", "HFLMTask"),
}
_CLASSES = {cls: module for module, cls in BUILTIN_PATHS.values()}


def builtin(name: str) -> type[Task]:
    """The built-in task class called ``name`` (a key of ``BUILTIN_PATHS``), imported now."""
    module, cls = BUILTIN_PATHS[name]
    return getattr(importlib.import_module(module), cls)


def __getattr__(attr: str) -> Any:  # ``from raytrain_loops.tasks import DetrTask`` imports it then
    if attr in _CLASSES:
        return getattr(importlib.import_module(_CLASSES[attr]), attr)
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
