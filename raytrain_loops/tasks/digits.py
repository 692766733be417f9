"""Classification of scikit-learn's bundled 8x8 digits (1,797 real images, no download)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from raytrain_loops.engine import LossOutput, StepContext
from raytrain_loops.tasks.base import EvalOutput, ParquetSplit, Task

COLUMNS = ["image", "label"]


def write_digits_parquet(out_dir: Path, test_size: float = 0.25, seed: int = 0) -> dict[str, Path]:
    """Write the stratified train/test split once (atomically) and return the two paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    paths = {split: out_dir / f"{split}.parquet" for split in ("train", "test")}
    if all(p.exists() for p in paths.values()):
        return paths
    out_dir.mkdir(parents=True, exist_ok=True)
    digits = load_digits()
    images = (digits.data / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(
        images, digits.target, test_size=test_size, stratify=digits.target, random_state=seed
    )
    for split, (x, y) in {"train": (x_tr, y_tr), "test": (x_te, y_te)}.items():
        table = pa.table(
            {
                "image": pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(x)),
                "label": pa.array(y.astype(np.int64)),
            }
        )
        tmp = paths[split].with_suffix(f".tmp{os.getpid()}")
        pq.write_table(table, tmp)
        os.replace(tmp, paths[split])
    return paths


class SmallCNN(nn.Module):
    """Three 3x3 conv blocks with BatchNorm, one pooling, global average, linear head."""

    def __init__(self, width: int = 32, num_classes: int = 10, dropout: float = 0.1, in_channels: int = 1):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
            )

        self.features = nn.Sequential(
            block(in_channels, width),
            block(width, 2 * width),
            nn.MaxPool2d(2),
            block(2 * width, 4 * width),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(4 * width, num_classes)
        self.feature_dim = 4 * width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.features(x)))


def random_shift(x: torch.Tensor, max_shift: int = 1) -> torch.Tensor:
    """Shift each image by up to ``max_shift`` pixels (zero padding), with tensor ops only."""
    n, _, h, w = x.shape
    padded = F.pad(x, (max_shift,) * 4)
    dy = torch.randint(0, 2 * max_shift + 1, (n,))
    dx = torch.randint(0, 2 * max_shift + 1, (n,))
    rows = (dy[:, None] + torch.arange(h)[None, :]).to(x.device)
    cols = (dx[:, None] + torch.arange(w)[None, :]).to(x.device)
    idx = torch.arange(n, device=x.device)[:, None, None]
    return padded[idx, 0, rows[:, :, None], cols[:, None, :]].unsqueeze(1)


class DigitsTask(Task):
    """The default task: a small CNN on 8x8 digits, cross-entropy, accuracy."""

    def __init__(self, width: int = 32, dropout: float = 0.1, label_smoothing: float = 0.0, shift: int = 1):
        self.width, self.dropout, self.label_smoothing, self.shift = width, dropout, label_smoothing, shift

    def prepare(self, data_dir: Path) -> None:
        write_digits_parquet(data_dir / "digits")

    def splits(self, data_dir: Path) -> dict[str, ParquetSplit]:
        base = data_dir / "digits"
        return {
            "train": ParquetSplit(str(base / "train.parquet"), COLUMNS),
            "eval": ParquetSplit(str(base / "test.parquet"), COLUMNS),
        }

    def build_model(self) -> nn.Module:
        return SmallCNN(self.width, dropout=self.dropout)

    def collate(self, batch: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        images = np.stack(batch["image"]) if batch["image"].dtype == object else batch["image"]
        images = torch.tensor(images, dtype=torch.float32)  # a copy: Arrow-backed arrays are read-only
        return images.reshape(-1, 1, 8, 8), torch.tensor(batch["label"], dtype=torch.long)

    def criterion(self, model: nn.Module, batch, ctx: StepContext) -> LossOutput:
        x, y = batch
        if self.shift:
            x = random_shift(x, self.shift)
        logits = model(x)
        loss = F.cross_entropy(logits, y, label_smoothing=self.label_smoothing)
        return LossOutput(loss, sample_size=len(y), logs={"acc": (logits.argmax(1) == y).float().mean()})

    def evaluate(self, model: nn.Module, batch) -> EvalOutput:
        x, y = batch
        logits = model(x).float()
        n = float(len(y))
        return {"accuracy": ((logits.argmax(1) == y).float().mean(), n), "loss": (F.cross_entropy(logits, y), n)}
