"""seamseg on a converted COCO directory (``task.params.data=coco``, the set at
``task.params.source``), read through the Parquet plan.

Each image decoded in ``preprocess``, its semantic map drawn from its annotations' masks (``1 +
category index`` on an object, :data:`~raytrain_loops.tasks.seamseg.IGNORE` on a crowd, as seamseg's
COCO conversion marks crowds void), and seamseg's scale jitter for training: the shorter side
resized to ``size`` times a factor drawn in ``scale``, and a horizontal flip (evaluation: the
shorter side at ``size``). Both sides are rounded to a multiple of :data:`NET_STRIDE`, the network's
stride; a batch is padded to its largest image, the padding counted in no loss or metric."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from raytrain_loops.config import ConfigError
from raytrain_loops.data.formats.coco import decode_mask
from raytrain_loops.data.formats.images import ConvertedSet, decode
from raytrain_loops.data.parquet import ROW_SEED
from raytrain_loops.tasks.base import ParquetSplit
from raytrain_loops.tasks.detection import MeanAveragePrecision
from raytrain_loops.tasks.seamseg import IGNORE, SeamsegNet, SeamsegTask, SegmentationIoU, collate

COLUMNS = ["image", "image_id", "category_ids", "boxes", "iscrowd", "masks", "width", "height"]
NET_STRIDE = 16


def semantic(row: dict[str, Any], index: dict[int, int]) -> np.ndarray:
    """The (H, W) uint8 semantic map of one converted row: 0 background, ``1 + index[category]``
    on each object, :data:`IGNORE` on a crowd (drawn last)."""
    h, w = int(row["height"]), int(row["width"])
    sem = np.zeros((h, w), dtype=np.uint8)
    anns = list(zip(row["masks"], row["category_ids"], row["iscrowd"], strict=True))
    for counts, cat, crowd in sorted(anns, key=lambda a: a[2]):
        sem[decode_mask(counts, h, w) > 0] = IGNORE if crowd else 1 + index[int(cat)]
    return sem


def jittered(image, sem: np.ndarray, boxes: np.ndarray, size: int, factor: float, flip: bool):
    """The image, semantic map and boxes (xyxy pixels) with the shorter side at ``size * factor``
    (sides rounded to :data:`NET_STRIDE`), flipped when ``flip``."""
    from PIL import Image

    width, height = image.size
    scale = size * factor / min(width, height)
    w, h = (max(NET_STRIDE, round(v * scale / NET_STRIDE) * NET_STRIDE) for v in (width, height))
    image = image.resize((w, h), Image.BILINEAR)
    sem = np.asarray(Image.fromarray(sem).resize((w, h), Image.NEAREST))
    boxes = boxes * [w / width, h / height, w / width, h / height]
    if flip:
        image, sem = image.transpose(Image.FLIP_LEFT_RIGHT), sem[:, ::-1]
        boxes[:, [0, 2]] = w - boxes[:, [2, 0]]
    return np.asarray(image), np.ascontiguousarray(sem), boxes.astype(np.float32)


class SeamsegCocoTask(SeamsegTask):
    """See the module docstring; ``size``: the shorter side, ``scale``: the training jitter's
    range of factors."""

    def __init__(self, source: str = "", size: int = 64, scale: Sequence[float] = (0.75, 1.25), **params: Any):
        super().__init__(**params)
        self.images = ConvertedSet(source, "coco")
        self.size, self.scale = size, tuple(scale)

    def prepare(self, data_dir: Path) -> None:
        self.images.meta  # noqa: B018  (read and checked on the driver, carried to the workers)

    def data_digest(self) -> str:
        return self.images.digest

    def splits(self, data_dir: Path) -> dict[str, ParquetSplit]:
        found = {name: self.images.split(name) for name in ("train", "eval")}
        return {name: ParquetSplit(path, COLUMNS) for name, path in found.items() if path}

    def preprocess(self, batch: dict[str, np.ndarray], train: bool) -> dict[str, np.ndarray]:
        index = {c["id"]: i for i, c in enumerate(self.images.meta["categories"])}
        n = len(batch["image"])
        out = {k: np.empty(n, dtype=object) for k in ("image", "sem", "boxes", "labels")}
        for i in range(n):
            row = {k: batch[k][i] for k in COLUMNS}
            rng = np.random.default_rng(int(batch[ROW_SEED][i]))
            keep = np.asarray(row["iscrowd"], dtype=np.int64) == 0
            xywh = np.asarray(row["boxes"], dtype=np.float64).reshape(-1, 4)[keep]
            xyxy = np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], 1)
            factor, flip = (rng.uniform(*self.scale), rng.random() < 0.5) if train else (1.0, False)
            image, sem, boxes = jittered(decode(row["image"], 3), semantic(row, index), xyxy, self.size, factor, flip)
            out["image"][i], out["sem"][i], out["boxes"][i] = image, sem, boxes
            out["labels"][i] = np.asarray([index[int(c)] for c in np.asarray(row["category_ids"])[keep]], dtype=np.int64)
        return {**out, "id": np.asarray(batch["image_id"], dtype=np.int64)}

    def collate(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        keys = ("image", "sem", "boxes", "labels", "id")
        return collate([{k: batch[k][i] for k in keys} for i in range(len(batch["id"]))], pad=True)

    def names(self) -> list[str]:
        return [c["name"] for c in self.images.meta["categories"]]

    def build_model(self) -> nn.Module:
        return SeamsegNet(len(self.names()), self.width)

    def eval_metrics(self) -> dict[str, Any]:
        return {"seg": SegmentationIoU(("background", *self.names())), "det": MeanAveragePrecision(len(self.names()))}


def build_seamseg(data: str = "shapes", **params: Any) -> SeamsegTask:
    """The built-in task ``seamseg``: on the generated shapes (:class:`SeamsegTask`), or with
    ``data=coco`` on a converted COCO directory (:class:`SeamsegCocoTask`)."""
    if data not in ("shapes", "coco"):
        raise ConfigError("task.params.data", f"must be one of ['shapes', 'coco']; got {data!r}")
    return SeamsegCocoTask(**params) if data == "coco" else SeamsegTask(**params)
