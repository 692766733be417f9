"""Which of the loop's metrics are series of their own in TensorBoard and MLflow, under one name each,
the name the console, the JSON lines and the reports use: an interval's ``loss``, an evaluation's
``eval_accuracy``, an epoch's average ``train_loss``. Every series is plotted against the step, so
the loop's position (``step``, ``epoch``) is none.

What the steps cost and how fast they went (throughput, memory, step times) and each worker's own
values (``<name>/rank<r>``) are series only with ``logging.system_series``: for a small model they
are most of the plots; the progress line shows them either way."""

from __future__ import annotations

from raytrain_loops.callbacks import throughput

POSITION = frozenset(["step", "epoch"])
SYSTEM = throughput.METRICS | frozenset(["sample_size", "sample_size_per_s", "compute_time", "data_time", "batch_time"])


def is_system(name: str) -> bool:
    """A throughput, memory or step-time figure (an epoch's average of one too), or a worker's own."""
    return "/rank" in name or name.removeprefix("train_") in SYSTEM


def series(metrics: dict[str, float], system: bool) -> dict[str, float]:
    """The metrics that are series: the loop's position left out, the system figures
    (:func:`is_system`) only when ``system``."""
    return {k: v for k, v in metrics.items() if k not in POSITION and (system or not is_system(k))}
