"""The sweep file of ``raytrain-loops tune``: a search space over the run config's dotted keys."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Literal

from raytrain_loops.config.base import ConfigError, at_least, from_dict, opt, read_yaml, set_dotted
from raytrain_loops.config.run import Config, ScalingConfig

DISTRIBUTIONS = ("choice", "uniform", "loguniform", "randint", "grid")


@dataclass(kw_only=True, slots=True)
class SearchConfig:
    """How trial configs are drawn."""

    algorithm: Literal["random", "grid", "optuna"] = opt(
        "random", "random (and grid entries), or Optuna's TPE (extra 'optuna')."
    )
    seed: int = opt(0, "Seed of the search.")
    points: list[dict[str, Any]] = opt(
        [], "Trials to run first, each a {dotted key: value} of the space (e.g. the recipe's own values)."
    )


@dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    """Which trials run on, stop early, or take over a better trial's weights. Times are steps."""

    name: Literal["fifo", "asha", "pbt"] = opt(
        "fifo", "fifo: all trials to the end; asha: early stopping; pbt: population-based training."
    )
    grace_period: int = opt(20, "asha: steps every trial runs before it may be stopped.")
    reduction_factor: float = opt(2.0, "asha: 1/reduction_factor of trials continue at each rung.")
    max_t: int = opt(0, "asha: the longest a trial runs, in steps; 0: the recipe's length.")
    perturbation_interval: int = opt(50, "pbt: steps between exploit/explore decisions.")
    quantile_fraction: float = opt(0.25, "pbt: the bottom fraction copies the top fraction.")
    resample_probability: float = opt(0.25, "pbt: chance of resampling a value instead of perturbing it.")
    synch: bool = opt(
        False,
        "pbt: decide only once every trial has reached the perturbation point (a fast trial waits), "
        "not on whatever the others have reported so far.",
    )

    def __post_init__(self) -> None:
        if self.grace_period < 1 or self.perturbation_interval < 1:
            raise ConfigError("grace_period" if self.grace_period < 1 else "perturbation_interval", "must be >= 1")
        if self.reduction_factor <= 1:
            raise ConfigError("reduction_factor", f"must be > 1; got {self.reduction_factor}")
        if not 0 < self.quantile_fraction <= 0.5:
            raise ConfigError("quantile_fraction", f"must be in (0, 0.5]; got {self.quantile_fraction}")


@dataclass(kw_only=True, slots=True)
class SweepConfig:
    """A hyperparameter search: space, objective, search algorithm, scheduler, trial resources."""

    space: dict[str, dict[str, Any]] = opt({}, "Dotted config key -> {choice|uniform|loguniform|randint|grid: ...}.")
    metric: str = opt("eval_accuracy", "The reported metric to optimise (aggregated over all workers).")
    mode: Literal["max", "min"] = opt("max", "Maximise or minimise the metric.")
    num_samples: int = opt(4, "Trials to draw (each grid point this many times).")
    max_concurrent_trials: int = opt(
        0, "Trials at once; 0: as many as the cluster's CPUs (or GPUs) hold, each with its workers' preprocessing."
    )
    search: SearchConfig = opt(SearchConfig(), "Search algorithm.")
    scheduler: SchedulerConfig = opt(SchedulerConfig(), "Trial scheduler.")
    trial: ScalingConfig = opt(
        ScalingConfig(), "Each trial's workers and resources (the scaling section of its Ray Train run)."
    )
    name: str = opt("", "Sweep name; empty: derived from the recipe and the sweep (deterministic).")
    storage_path: str = opt("./sweeps", "Where the sweep's results go.")

    def __post_init__(self) -> None:
        if not self.space:
            raise ConfigError("space", "is empty: give at least one dotted key to search over")
        at_least(self, 1, "num_samples")
        if self.trial.local:
            raise ConfigError("trial.num_workers", "a sweep's trials are Ray Train runs: local mode (0) cannot run them")
        for key, spec in self.space.items():
            _check_distribution(f"space.{key}", spec)
        if self.search.algorithm == "optuna" and any("grid" in spec for spec in self.space.values()):
            raise ConfigError("search.algorithm", "optuna cannot search grid entries; use choice instead")
        if self.scheduler.name == "pbt" and any("grid" in spec for spec in self.space.values()):
            raise ConfigError("scheduler.name", "pbt mutates values and cannot use grid entries; use choice instead")


def _check_distribution(key: str, spec: Any) -> None:
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in DISTRIBUTIONS:
        raise ConfigError(key, f"must be one of {{{', '.join(DISTRIBUTIONS)}: ...}}; got {spec!r}")
    ((kind, args),) = spec.items()
    if kind in ("choice", "grid"):
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{key}.{kind}", f"must be a non-empty list; got {args!r}")
        return
    if not (
        isinstance(args, list)
        and len(args) == 2
        and all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)
    ):
        raise ConfigError(f"{key}.{kind}", f"must be [low, high]; got {args!r}")
    low, high = args
    if not low < high:
        raise ConfigError(f"{key}.{kind}", f"low must be below high; got {args!r}")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{key}.{kind}", f"needs low > 0; got {args!r}")
    if kind == "randint" and not all(float(a).is_integer() for a in args):
        raise ConfigError(f"{key}.{kind}", f"needs integers; got {args!r}")


def _samples(spec: dict[str, Any]) -> list[Any]:
    ((kind, args),) = spec.items()
    if kind in ("choice", "grid"):
        return list(args)
    low, high = args
    if kind == "randint":
        return [int(low), int(high) - 1]
    if kind == "loguniform":
        return [low, math.sqrt(low * high)]
    return [low, (low + high) / 2]


def trial_config(base: dict[str, Any], values: dict[str, Any]) -> Config:
    """The run config of one trial: the recipe with the trial's values set at their dotted keys."""
    data = copy.deepcopy(base)
    for key, value in values.items():
        set_dotted(data, key, value)
    return Config.from_dict(data)


def load_sweep(source: str | dict[str, Any], base: Config) -> SweepConfig:
    """Read and check a sweep file against the recipe it searches: every key of the space must
    be a config key that accepts the values the space can give."""
    data = read_yaml(source) if not isinstance(source, dict) else source
    sweep = from_dict(SweepConfig, data)
    base_dict = base.to_dict()
    for key, spec in sweep.space.items():
        for value in _samples(spec):
            try:
                trial_config(base_dict, {key: value})
            except ConfigError as err:
                raise ConfigError(f"space.{key}", f"{value!r} is not a valid value there ({err})") from None
    for i, point in enumerate(sweep.search.points):
        where = f"search.points[{i}]"
        if not isinstance(point, dict) or set(point) != set(sweep.space):
            raise ConfigError(
                where, f"must give a value for each key of the space ({', '.join(sweep.space)}); got {point!r}"
            )
        try:
            trial_config(base_dict, point)
        except ConfigError as err:
            raise ConfigError(where, f"is not a valid trial ({err})") from None
    return sweep
