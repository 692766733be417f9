"""The sweep file of Tune sweeps: every key checked against the recipe before Ray starts."""

from __future__ import annotations

import pytest

from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.config.sweep import load_sweep
from raytrain_loops.recipes import resolve


@pytest.mark.parametrize(
    "sweep,key,fragment",
    [
        ({"space": {"optim.lr": {"choice": [0.1]}}}, "space.optim.lr", "unknown key"),
        (
            {"space": {"schedules.lr.value": {"normal": [0, 1]}}},
            "space.schedules.lr.value",
            "must be one of {choice, uniform",
        ),
        (
            {"space": {"schedules.lr.value": {"loguniform": [0, 1]}}},
            "space.schedules.lr.value.loguniform",
            "needs low > 0",
        ),
        ({"space": {"precision.dtype": {"choice": ["fp8"]}}}, "space.precision.dtype", "'fp8' is not a valid value"),
        ({"space": {"accum.steps": {"randint": [0, 3]}}}, "space.accum.steps", "must be >= 1"),
        (
            {"space": {"accum.steps": {"grid": [1, 2]}}, "scheduler": {"name": "pbt"}},
            "scheduler.name",
            "cannot use grid",
        ),
        ({"space": {"accum.steps": {"grid": [1]}}, "mode": "maximum"}, "mode", "one of 'max', 'min'"),
        ({"space": {}}, "space", "is empty"),
    ],
)
def test_an_invalid_sweep_names_the_key(sweep, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_sweep(sweep, load_config(resolve("default")))
    assert info.value.key == key and fragment in str(info.value)
