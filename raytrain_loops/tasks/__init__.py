"""Tasks: model + criterion + data + evaluation, one per seed family."""

from raytrain_loops.tasks.base import EvalOutput, MapSplit, ParquetSplit, Task, build_task
from raytrain_loops.tasks.cvnets import CvnetsTask
from raytrain_loops.tasks.detr import DetrTask
from raytrain_loops.tasks.digits import DigitsTask
from raytrain_loops.tasks.dino import DinoTask
from raytrain_loops.tasks.lm import LMTask
from raytrain_loops.tasks.seamseg import SeamsegTask

BUILTIN = {
    "digits": DigitsTask,
    "cvnets": CvnetsTask,
    "dino": DinoTask,
    "detr": DetrTask,
    "lm": LMTask,
    "seamseg": SeamsegTask,
}

__all__ = [
    "BUILTIN",
    "CvnetsTask",
    "DetrTask",
    "DigitsTask",
    "DinoTask",
    "EvalOutput",
    "LMTask",
    "MapSplit",
    "ParquetSplit",
    "SeamsegTask",
    "Task",
    "build_task",
]
