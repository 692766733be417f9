"""Your own Ray Dataset as the data, with its own ``map_batches`` as preprocessing, trained with
raytrain_loops.fit.

    .venv/bin/python examples/ray_dataset.py --make-data my_data        # a small table to try it on
    .venv/bin/python examples/ray_dataset.py --data my_data             # 2 Ray workers
    .venv/bin/python examples/ray_dataset.py --data my_data --local     # one training process

The splits are ``ray.data.read_parquet`` Datasets of ``--data``'s ``train/`` and ``eval/`` files
(as ``examples/parquet_task.py`` writes them: a ``features`` column of floats, a ``label``),
each with a ``map_batches`` that standardises the features. They are trained as Ray Train trains a
Dataset: the trainer gets them in ``datasets=`` and every worker reads its ``streaming_split``
shard, ``data.batch_size`` rows at a time, through the task's ``collate``. ``Task.preprocess`` is
not used (the Dataset's own ``map_batches`` are its preprocessing). A resumed epoch starts over
from the Dataset's first rows: docs/data.md, "A Ray Dataset as a split".
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: examples.* importable

import raytrain_loops  # noqa: E402
from examples.parquet_task import CONFIG as PARQUET_CONFIG  # noqa: E402
from examples.parquet_task import TableTask, command  # noqa: E402
from raytrain_loops import DatasetSplit, Task  # noqa: E402
from raytrain_loops.config import load_config  # noqa: E402
from raytrain_loops.driver.ray_start import ensure_ray  # noqa: E402


class Standardised:
    """The Dataset's preprocessing (its ``map_batches``): each feature standardised."""

    def __init__(self, mean: list[float], std: list[float]):
        self.mean, self.std = np.asarray(mean, np.float32), np.asarray(std, np.float32)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = (np.stack(batch["features"]).astype(np.float32) - self.mean) / self.std
        return {"features": x, "label": batch["label"]}


class DatasetTask(TableTask):
    """``examples/parquet_task.py``'s MLP on the ``features`` of a Ray Dataset, cross-entropy on
    ``label``: its model, collate, criterion and evaluation, without its ``preprocess``."""

    preprocess = Task.preprocess  # the Dataset's map_batches preprocess it

    def dataset(self, split: str):
        """The split as a Ray Dataset with its own preprocessing."""
        import ray.data

        standardised = Standardised(self.mean.tolist(), self.std.tolist())
        return ray.data.read_parquet(f"{self.data}/{split}").map_batches(standardised)

    def splits(self, data_dir):
        return {split: DatasetSplit(self.dataset(split)) for split in ("train", "eval")}


CONFIG = {**PARQUET_CONFIG, "task": {"name": "dataset"}, "data": {"batch_size": 64}}


def train(config: dict, data: str, mean: list[float], std: list[float]):
    # The Datasets are built (Task.splits) before fit starts Ray: start it first, sized for the run
    # (or join the cluster in RAY_ADDRESS), rather than let Ray Data start one of its own.
    ensure_ray(load_config(config))
    return raytrain_loops.fit(config, task=DatasetTask(data, mean, std))


def main(argv: list[str] | None = None):
    """The command line above; the run's result (None after ``--make-data``)."""
    return command(argv, __doc__, CONFIG, train)


if __name__ == "__main__":
    main()
