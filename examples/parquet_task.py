"""Your own Parquet data, with per-row preprocessing, trained with raytrain_loops.fit.

    .venv/bin/python examples/parquet_task.py --make-data my_data        # a small table to try it on
    .venv/bin/python examples/parquet_task.py --data my_data             # 2 Ray workers
    .venv/bin/python examples/parquet_task.py --data my_data --local     # one process, no Ray

Point ``--data`` at a directory holding ``train/`` and ``eval/`` Parquet files (one file or many,
a local path or an ``s3://`` / ``gs://`` URI) with a ``features`` column (a fixed-size list of
floats) and a ``label`` column (int64). The splits are read by the Parquet plan: the whole split
shuffled every epoch, each worker its share, an exact resume mid-epoch. ``preprocess`` runs on
Ray Data's CPUs (in the process itself in local mode), one row out per row in: it standardises
the features and, for training rows, adds noise drawn from the row's own seed, so a resumed or
resized run sees the same augmented rows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import raytrain_loops
from raytrain_loops import LossOutput, ParquetSplit, Task
from raytrain_loops.data.parquet import ROW_SEED

COLUMNS = ["features", "label"]
FEATURES = 16


def make_data(out: Path, rows: int = 4096, seed: int = 0) -> None:
    """Two Gaussian classes in ``FEATURES`` dimensions, with a scale and offset per feature (what
    ``preprocess`` undoes), written as ``out/train/part-0.parquet`` and ``out/eval/part-0.parquet``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    g = np.random.default_rng(seed)
    scale, offset = g.uniform(0.5, 20.0, FEATURES), g.normal(0.0, 50.0, FEATURES)
    for split, n in (("train", rows), ("eval", rows // 4)):
        label = g.integers(0, 2, n)
        x = g.normal(0.0, 1.0, (n, FEATURES)) + 1.2 * (label[:, None] * 2 - 1)
        features = (x * scale + offset).astype(np.float32)
        (out / split).mkdir(parents=True, exist_ok=True)
        table = pa.table({"features": pa.FixedShapeTensorArray.from_numpy_ndarray(features), "label": pa.array(label)})
        pq.write_table(table, out / split / "part-0.parquet")


class TableTask(Task):
    """An MLP on the ``features`` of the user's Parquet table, cross-entropy on ``label``."""

    def __init__(self, data: str, mean: list[float], std: list[float], noise: float = 0.1, hidden: int = 64):
        self.data, self.noise, self.hidden = data, noise, hidden
        self.mean, self.std = np.asarray(mean, np.float32), np.asarray(std, np.float32)

    def splits(self, data_dir):
        return {split: ParquetSplit(f"{self.data}/{split}", COLUMNS) for split in ("train", "eval")}

    def preprocess(self, batch: dict[str, np.ndarray], train: bool) -> dict[str, np.ndarray]:
        x = (np.stack(batch["features"]).astype(np.float32) - self.mean) / self.std
        if train:  # each row's noise from its own seed: the same rows, the same noise, on any resume
            for i, seed in enumerate(batch[ROW_SEED]):
                x[i] += np.random.default_rng(int(seed)).normal(0.0, self.noise, x.shape[1]).astype(np.float32)
        return {"features": x, "label": batch["label"]}

    def collate(self, batch: dict[str, np.ndarray]):
        return torch.as_tensor(np.stack(batch["features"])), torch.as_tensor(batch["label"], dtype=torch.long)

    def build_model(self) -> nn.Module:
        h = self.hidden
        return nn.Sequential(nn.Linear(FEATURES, h), nn.ReLU(), nn.Linear(h, 2))

    def criterion(self, model, batch, ctx) -> LossOutput:
        x, y = batch
        logits = model(x)
        return LossOutput(
            F.cross_entropy(logits, y), sample_size=len(y), logs={"acc": (logits.argmax(1) == y).float().mean()}
        )

    def evaluate(self, model, batch):
        x, y = batch
        return {"accuracy": ((model(x).argmax(1) == y).float().mean(), len(y))}


def statistics(data: str) -> tuple[list[float], list[float]]:
    """Each feature's mean and standard deviation over the training split (read once, on the driver)."""
    import pyarrow.dataset as ds

    x = np.stack(ds.dataset(f"{data}/train", format="parquet").to_table(columns=["features"])["features"].to_pylist())
    return x.mean(0).tolist(), (x.std(0) + 1e-6).tolist()


CONFIG = {
    "task": {"name": "table"},
    "loop": {"epochs": 5},
    "data": {"batch_size": 64, "preprocess": {"num_cpus": 0.5, "batch_rows": 256}},
    "schedules": {"lr": {"kind": "cosine", "value": 3e-3, "warmup_steps": 10}},
    "scaling": {"num_workers": 2},
    "run": {"storage_path": "./runs"},
}


def main(argv: list[str] | None = None):
    """The command line above; the run's result (None after ``--make-data``)."""
    return command(argv, __doc__, CONFIG, lambda config, data, mean, std: raytrain_loops.fit(config, task=TableTask(data, mean, std)))


def command(argv: list[str] | None, doc: str, base: dict, train):
    """An example's command line (the one above): ``--make-data``, or ``train(config, data, mean,
    std)`` with ``base`` at the scale and length asked; the run's result (None after ``--make-data``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--data", help="directory (or URI) with train/ and eval/ Parquet files")
    parser.add_argument("--make-data", metavar="DIR", help="write a small example table to DIR and stop")
    parser.add_argument("--local", action="store_true", help="one training process (scaling.num_workers=0)")
    parser.add_argument("--epochs", type=int, default=base["loop"]["epochs"])
    parser.add_argument("--storage-path", default=base["run"]["storage_path"])
    args = parser.parse_args(argv)
    if args.make_data:
        make_data(Path(args.make_data))
        print(f"wrote {args.make_data}/train and {args.make_data}/eval")
        return None
    if not args.data:
        parser.error("give --data DIR (or --make-data DIR first)")
    mean, std = statistics(args.data)
    config = {
        **base,
        "loop": {"epochs": args.epochs},
        "scaling": {"num_workers": 0 if args.local else 2},
        "run": {"storage_path": args.storage_path},
    }
    result = train(config, args.data, mean, std)
    print(f"accuracy {result.metrics['eval_accuracy']:.3f}; run directory {result.run_dir}")
    return result


if __name__ == "__main__":
    main()
