"""How ``task.name: module:callable`` is resolved: only Task classes and Task factories are called."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrain_loops.config import ConfigError
from raytrain_loops.tasks import DigitsTask, Task, build_task


def touch_marker(marker: str):
    """Not a task factory (no return annotation): writes a file if it is ever called."""
    Path(marker).write_text("called")
    return DigitsTask()


def digits_factory(width: int = 8) -> DigitsTask:
    """A factory whose return annotation names a Task subclass."""
    return DigitsTask(width=width)


def lying_factory() -> Task:
    """Annotated as a Task factory, but returns something else."""
    return "not a task"


class NotATask:
    """A class, but not a Task: writes a file if it is ever constructed."""

    def __init__(self, marker: str):
        Path(marker).write_text("constructed")


def test_a_task_class_and_an_annotated_factory_are_built():
    assert isinstance(build_task("raytrain_loops.tasks.digits:DigitsTask", {"width": 8}), DigitsTask)
    assert build_task(f"{__name__}:digits_factory", {"width": 4}).width == 4


@pytest.mark.parametrize(
    "name, found",
    [
        ("os:system", "builtin_function_or_method"),
        (f"{__name__}:touch_marker", "a function without a Task return annotation"),
        (f"{__name__}:NotATask", "class tests.recipes.test_task_name_resolution.NotATask"),
    ],
)
def test_a_callable_that_is_not_a_task_is_refused_without_being_called(tmp_path, name, found):
    marker = tmp_path / "called"
    params = {"marker": str(marker)} if name != "os:system" else {"command": f"touch {marker}"}
    with pytest.raises(ConfigError, match=r"^task\.name: ") as err:
        build_task(name, params)
    assert name in str(err.value) and found in str(err.value)
    assert not marker.exists(), "the callable ran"


def test_a_factory_that_returns_something_else_is_refused():
    with pytest.raises(ConfigError, match=r"task\.name: .*lying_factory' returned str, not a raytrain_loops Task"):
        build_task(f"{__name__}:lying_factory", {})


def test_unknown_names_and_bad_params_are_config_errors():
    with pytest.raises(ConfigError, match=r"task\.name: 'no_such_task': not a built-in task"):
        build_task("no_such_task", {})
    with pytest.raises(ConfigError, match=r"task\.name: 'no.such.module:X': cannot import it") as info:
        build_task("no.such.module:X", {})
    assert "run the command from the directory that holds no.py (or the no/ package), add that directory to " in str(
        info.value
    ) and "submit it with `raytrain-loops submit --working-dir DIR`" in str(info.value)
    with pytest.raises(ConfigError, match=r"task\.params: .*unexpected keyword argument 'nope'"):
        build_task("digits", {"nope": 1})
