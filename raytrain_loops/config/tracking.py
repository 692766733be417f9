"""Config section of experiment tracking (``logging.mlflow``)."""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_loops.config.base import opt

__all__ = ["MlflowConfig"]


@dataclass(kw_only=True, slots=True)
class MlflowConfig:
    """MLflow tracking: the config as params, metrics with their step, the run's files as artifacts."""

    tracking_uri: str = opt(
        "",
        "Empty: off. Any MLflow tracking URI: sqlite:///path/mlflow.db, a directory, or a tracking server "
        "(http://host:5000). Needs the extra: pip install 'raytrain-loops[mlflow]'.",
    )
    experiment: str = opt(
        "", "Experiment name (created when missing); empty: 'raytrain-loops', or the sweep's name for tune."
    )
