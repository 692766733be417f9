"""Image classification from encoded images streamed off disk: the ``patterns`` set
(:mod:`raytrain_loops.tasks.datasets.patterns`, about 4.5 GB of PNG at its default size), decoded and
augmented in :meth:`ImagesTask.preprocess` by Ray tasks on the cluster's CPUs, a small
residual CNN on the workers (cvnets-style: BatchNorm, AdamW, cosine lr with warm-up).

Training images get a random crop of ``size - 8`` pixels and a horizontal flip, drawn from each
row's own seed (the same for the same row in the same epoch whatever the number of workers or a
resume); evaluation images the centre crop.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from raytrain_loops.data.parquet import ROW_SEED
from raytrain_loops.engine import LossOutput, StepContext
from raytrain_loops.tasks.base import ParquetSplit, Task
from raytrain_loops.tasks.datasets.patterns import CLASSES, PatternsSpec, write_patterns

MEAN, STD = 127.5, 64.0
CROP_MARGIN = 8


def decode(raw: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))


def crops(raws, seeds: np.ndarray, size: int, train: bool) -> np.ndarray:
    """Decoded images cropped to ``size - CROP_MARGIN`` (train: at a random place, flipped half of
    the time, drawn from each row's seed; eval: the centre), as (n, crop, crop, 3) uint8."""
    crop = size - CROP_MARGIN
    out = np.empty((len(raws), crop, crop, 3), dtype=np.uint8)
    for i, raw in enumerate(raws):
        image = decode(raw)
        if train:
            rng = np.random.default_rng(int(seeds[i]))
            y, x = rng.integers(0, CROP_MARGIN + 1, 2)
            image = image[y : y + crop, x : x + crop]
            out[i] = image[:, ::-1] if rng.random() < 0.5 else image
        else:
            m = CROP_MARGIN // 2
            out[i] = image[m : m + crop, m : m + crop]
    return out


class Block(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a shortcut (1x1, strided, where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class ResNetSmall(nn.Module):
    def __init__(self, width: int, classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(Block(width, width, 1), Block(width, 2 * width, 2), Block(2 * width, 4 * width, 2))
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class ImagesTask(Task):
    """Classify the ``patterns`` images (10 classes: 5 shapes, filled or outlined)."""

    def __init__(
        self, train_images: int = 409_600, eval_images: int = 8192, size: int = 64, width: int = 32, seed: int = 0
    ):
        self.spec = PatternsSpec(train_images, eval_images, size, seed)
        self.width = width

    def prepare(self, data_dir: Path) -> None:
        write_patterns(data_dir, self.spec)

    def splits(self, data_dir: Path) -> dict[str, ParquetSplit]:
        base = self.spec.directory(data_dir)
        return {name: ParquetSplit(str(base / name), ["image", "label"]) for name in ("train", "eval")}

    def preprocess(self, batch: dict[str, np.ndarray], train: bool) -> dict[str, np.ndarray]:
        return {"image": crops(batch["image"], batch[ROW_SEED], self.spec.size, train), "label": batch["label"]}

    def collate(self, batch: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.from_numpy(np.ascontiguousarray(batch["image"])).permute(0, 3, 1, 2)
        return (images.float() - MEAN) / STD, torch.as_tensor(np.asarray(batch["label"]), dtype=torch.long)

    def build_model(self) -> nn.Module:
        return ResNetSmall(self.width, len(CLASSES))

    def criterion(self, model: nn.Module, batch, ctx: StepContext) -> LossOutput:
        x, y = batch
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        return LossOutput(loss, sample_size=len(y), logs={"acc": (logits.argmax(1) == y).float().mean()})

    def evaluate(self, model: nn.Module, batch):
        x, y = batch
        return {"accuracy": ((model(x).argmax(1) == y).float().mean(), len(y))}
