"""Tasks: model + criterion + data + evaluation, one per seed family."""

from raytrain_loops.tasks.base import EvalOutput, MapSplit, ParquetSplit, Task, build_task
from raytrain_loops.tasks.digits import DigitsTask
from raytrain_loops.tasks.lm import LMTask

BUILTIN = {"digits": DigitsTask, "lm": LMTask}

__all__ = ["BUILTIN", "DigitsTask", "EvalOutput", "LMTask", "MapSplit", "ParquetSplit", "Task", "build_task"]
