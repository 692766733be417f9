"""Tasks: model + criterion + data + evaluation, one per seed family."""

from raytrain_loops.tasks.base import EvalOutput, MapSplit, ParquetSplit, Task, build_task
from raytrain_loops.tasks.digits import DigitsTask

BUILTIN = {"digits": DigitsTask}

__all__ = ["BUILTIN", "DigitsTask", "EvalOutput", "MapSplit", "ParquetSplit", "Task", "build_task"]
