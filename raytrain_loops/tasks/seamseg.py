"""Seamseg-style multi-head training on the generated ``shapes`` data, whose images come in two
or more aspect ratios (``widths``; raytrain_loops/tasks/datasets/shapes.py).

A small encoder-decoder (stride 16 at the bottom, skips at strides 8, 4 and 2) with three heads:
semantic segmentation (background and every class of :data:`~raytrain_loops.tasks.datasets.shapes.CLASSES`,
predicted at stride 2 and upsampled), and a one-stage, class-agnostic detector at stride 4: an
objectness heatmap with a peak at each object's centre cell, and the box as its distances to the
four sides from that cell's centre. The named loss terms, in this order:

- ``obj``: CenterNet's focal loss on the heatmap against Gaussian bumps at the centres, divided
  by the number of objects of the whole update on all workers (the engine's ``counts`` path);
- ``bbx``: L1 of the four distances (in units of :data:`BOX_SCALE` pixels) at the centre cells,
  divided by the same number;
- ``sem``: per-pixel cross-entropy.

Padding (evaluation batches pad smaller images) counts in no loss term: ``sem`` ignores its
pixels, ``obj`` its heatmap cells.

They are combined with ``task.params.loss_weights`` (one weight per term, in that order, as
seamseg's ``loss_weights``); each is logged weighted under its name and as is under
``<name>_unscaled``, averaged over all workers.

Data: the splits are map-style (:class:`ShapesRows`, the Parquet file read into memory in the
process that uses it); each row's index is its image's id. A training batch must hold images of
one shape (its rows share a group of :func:`row_groups`); evaluation batches are padded to their
largest image, the padding ignored by every loss and metric: its pixels and heatmap cells count
nowhere, and it holds no detection. (The network's outputs near an image's bottom and right edges
still see the padding within their receptive field, as in any padded batch.)

Evaluation: the terms on the validation split, and over the whole split on all workers:
``eval_miou``, the mean IoU over the classes (background included) present in the split's
targets or predictions, as torchmetrics' macro average; ``eval_iou_<class>`` for each (NaN for
a class absent from both); and the detections' COCO box mAP (``eval_map``, ``eval_map50``,
``eval_map75``; pycocotools' ``COCOeval`` through
:class:`~raytrain_loops.tasks.detection.MeanAveragePrecision`), a detection labelled by the
segmentation's class at its box's centre.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassJaccardIndex

from raytrain_loops.config import ConfigError
from raytrain_loops.data.samplers import GroupedBatchSampler
from raytrain_loops.engine import LossOutput, StepContext
from raytrain_loops.tasks.base import EvalOutput, MapSplit, Task, params_at_least
from raytrain_loops.tasks.datasets.shapes import CLASSES, COLUMNS, ShapesSpec, decode_image, decode_masks, write_shapes
from raytrain_loops.tasks.detection import MeanAveragePrecision

TERMS = ("obj", "bbx", "sem")
SEGMENTS = ("background", *CLASSES)
IGNORE = 255  # the semantic label of padding
STRIDE = 4  # of the detection heads
BOX_SCALE = 16.0  # pixels per unit of the box regression
MEAN, STD = 127.5, 64.0


# ---------------------------------------------------------------------- data


class ShapesRows(torch.utils.data.Dataset):
    """The rows of one ``shapes`` Parquet file: per row the image (H, W, 3) uint8, its semantic
    map (H, W) (0 background, ``1 + class`` on each object), boxes (n, 4) xyxy in pixels and
    labels (n,).

    Only the row count is read where the object is made (the driver); the file is read into
    memory on first use, in the process that uses it, and left out when the object is pickled,
    so a worker's payload stays small."""

    def __init__(self, path: str | Path, size: int):
        import pyarrow.parquet as pq

        self.path, self.size = str(path), size
        self.rows = pq.read_metadata(self.path).num_rows
        self._columns: dict[str, list] | None = None

    def __len__(self) -> int:
        return self.rows

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_columns": None}

    def columns(self) -> dict[str, list]:
        if self._columns is None:
            import pyarrow.parquet as pq

            table = pq.read_table(self.path, columns=COLUMNS)
            self._columns = {name: table.column(name).to_pylist() for name in COLUMNS}
        return self._columns

    def widths(self) -> np.ndarray:
        """Every row's image width (its byte length over 3 x height)."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        lengths = pc.binary_length(pq.read_table(self.path, columns=["image"]).column("image"))
        return np.asarray(lengths.to_numpy(zero_copy_only=False)) // (3 * self.size)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        cols = self.columns()
        image = decode_image(cols["image"][i], self.size)
        h, w = image.shape[:2]
        labels = np.asarray(cols["labels"][i], dtype=np.int64)
        sem = np.zeros((h, w), dtype=np.uint8)
        for label, mask in zip(labels, decode_masks(cols["masks"][i], h, w), strict=True):
            sem[mask] = 1 + label
        cx, cy, bw, bh = np.asarray(cols["boxes"][i], dtype=np.float32).reshape(-1, 4).T
        boxes = np.stack([(cx - bw / 2) * w, (cy - bh / 2) * h, (cx + bw / 2) * w, (cy + bh / 2) * h], 1)
        return {"image": image, "sem": sem, "boxes": boxes.astype(np.float32), "labels": labels, "id": i}


def row_groups(dataset: ShapesRows) -> list[int]:
    """Each row's group id: the rank of its image width among the split's widths. Rows of one
    group have one shape, so a batch sampler that keeps groups apart gives batches that stack."""
    widths = dataset.widths()
    distinct = np.unique(widths)
    return np.searchsorted(distinct, widths).tolist()


def centre_targets(boxes: np.ndarray, h: int, w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The detection targets of one image at stride :data:`STRIDE`: the heatmap (h/S, w/S) with a
    Gaussian of peak 1 at each object's centre cell, those cells (n, 2) as (y, x), and the box's
    distances (left, top, right, bottom) from each cell's centre in units of :data:`BOX_SCALE`."""
    gh, gw = h // STRIDE, w // STRIDE
    heat = np.zeros((gh, gw), dtype=np.float32)
    cells = np.zeros((len(boxes), 2), dtype=np.int64)
    ltrb = np.zeros((len(boxes), 4), dtype=np.float32)
    yy, xx = np.mgrid[0:gh, 0:gw]
    for k, (x1, y1, x2, y2) in enumerate(boxes):
        cy = min(int((y1 + y2) / 2 // STRIDE), gh - 1)
        cx = min(int((x1 + x2) / 2 // STRIDE), gw - 1)
        # The bump's width follows the object's size, as CenterNet's radius does.
        sigma = max(min(x2 - x1, y2 - y1) / STRIDE / 6.0, 0.5)
        heat = np.maximum(heat, np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * sigma**2)))
        px, py = (cx + 0.5) * STRIDE, (cy + 0.5) * STRIDE
        cells[k] = (cy, cx)
        ltrb[k] = (px - x1, py - y1, x2 - px, y2 - py)
    return heat, cells, ltrb / BOX_SCALE


def collate(items: Sequence[dict[str, np.ndarray]], pad: bool = False) -> dict[str, Any]:
    """Stack rows into a batch: ``images`` (B, 3, H, W) normalised, ``sem`` (B, H, W),
    ``heat`` (B, 1, H/S, W/S), ``centres`` (N, 3) as (image, y, x) cells with ``ltrb`` (N, 4),
    per image ``boxes`` (xyxy pixels) and ``labels``, and ``sizes`` (B, 2), each image's
    (height, width) before padding, and ``ids`` (B,), its row's ``id``.

    Without ``pad`` (training) every image must have the same shape, and a batch that mixes
    shapes is an error; with ``pad`` (evaluation) smaller images are padded at the bottom and
    right to the largest, their padding labelled :data:`IGNORE`."""
    shapes = sorted({item["image"].shape[:2] for item in items})
    if len(shapes) > 1 and not pad:
        raise ValueError(
            f"a training batch mixes image shapes {shapes}: its rows must share one group of "
            "row_groups() (give the train split a batch sampler that groups rows by it)"
        )
    h, w = max(s[0] for s in shapes), max(s[1] for s in shapes)
    images = np.full((len(items), h, w, 3), MEAN, dtype=np.float32)
    sem = np.full((len(items), h, w), IGNORE, dtype=np.int64)
    heat = np.zeros((len(items), 1, h // STRIDE, w // STRIDE), dtype=np.float32)
    centres, ltrbs = [], []
    for b, item in enumerate(items):
        ih, iw = item["image"].shape[:2]
        images[b, :ih, :iw] = item["image"]
        sem[b, :ih, :iw] = item["sem"]
        hm, cells, ltrb = centre_targets(item["boxes"], ih, iw)
        heat[b, 0, : hm.shape[0], : hm.shape[1]] = hm
        centres.append(np.concatenate([np.full((len(cells), 1), b), cells], 1))
        ltrbs.append(ltrb)
    x = torch.from_numpy(images).permute(0, 3, 1, 2).sub_(MEAN).div_(STD).contiguous()
    return {
        "images": x,
        "sem": torch.from_numpy(sem),
        "heat": torch.from_numpy(heat),
        "centres": torch.from_numpy(np.concatenate(centres).astype(np.int64)),
        "ltrb": torch.from_numpy(np.concatenate(ltrbs)),
        "boxes": [torch.from_numpy(item["boxes"]) for item in items],
        "labels": [torch.from_numpy(item["labels"]) for item in items],
        "sizes": torch.tensor([item["image"].shape[:2] for item in items], dtype=torch.long).reshape(-1, 2),
        "ids": torch.tensor([item["id"] for item in items], dtype=torch.long),
    }


# ---------------------------------------------------------------------- model


def conv(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class SeamsegNet(nn.Module):
    """Encoder to stride 16, a decoder back to stride 2 through skips, and the three heads."""

    def __init__(self, num_classes: int, width: int):
        super().__init__()
        w = width
        self.down2 = nn.Sequential(conv(3, w, 2), conv(w, w))
        self.down4 = nn.Sequential(conv(w, 2 * w, 2), conv(2 * w, 2 * w))
        self.down8 = nn.Sequential(conv(2 * w, 4 * w, 2), conv(4 * w, 4 * w))
        self.down16 = nn.Sequential(conv(4 * w, 8 * w, 2), conv(8 * w, 8 * w))
        self.up8 = conv(12 * w, 4 * w)
        self.up4 = conv(6 * w, 2 * w)
        self.up2 = conv(3 * w, w)
        self.sem_head = nn.Conv2d(w, num_classes + 1, 1)
        self.obj_head = nn.Sequential(conv(2 * w, 2 * w), nn.Conv2d(2 * w, 1, 1))
        self.bbx_head = nn.Sequential(conv(2 * w, 2 * w), nn.Conv2d(2 * w, 4, 1))
        # Objectness starts near its prior (a tenth of the cells), as CenterNet's heatmap bias.
        nn.init.constant_(self.obj_head[-1].bias, -2.19)

    @staticmethod
    def _up(x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False), skip], 1)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """``sem`` (B, C+1, H, W) logits, ``obj`` (B, 1, H/4, W/4) logits, ``bbx`` (B, 4, H/4, W/4)."""
        s2 = self.down2(images)
        s4 = self.down4(s2)
        s8 = self.down8(s4)
        d8 = self.up8(self._up(self.down16(s8), s8))
        d4 = self.up4(self._up(d8, s4))
        d2 = self.up2(self._up(d4, s2))
        sem = F.interpolate(self.sem_head(d2), size=images.shape[-2:], mode="bilinear", align_corners=False)
        return {"sem": sem, "obj": self.obj_head(d4), "bbx": self.bbx_head(d4)}


# ---------------------------------------------------------------------- losses and metrics


def focal_heatmap_loss(logits: torch.Tensor, heat: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """CenterNet's penalty-reduced focal loss, summed over the cells where ``valid`` (all of
    them when None; divide by the number of objects)."""
    p = logits.float().sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = heat.eq(1).float()
    pos_loss = -((1 - p) ** 2) * p.log() * pos
    neg_loss = -((1 - heat) ** 4) * p**2 * (1 - p).log() * (1 - pos)
    loss = pos_loss + neg_loss
    return (loss if valid is None else loss * valid).sum()


def inside(sizes: torch.Tensor, shape: Sequence[int], stride: int = 1) -> torch.Tensor:
    """(B, 1, *shape) bool: which cells of a batch's map at ``stride`` lie within each image of
    ``sizes`` (B, 2) (its height and width in pixels), not in its padding."""
    rows = torch.arange(shape[0], device=sizes.device) * stride
    cols = torch.arange(shape[1], device=sizes.device) * stride
    return ((rows[None, :, None] < sizes[:, 0, None, None]) & (cols[None, None, :] < sizes[:, 1, None, None]))[:, None]


class SegmentationIoU(MulticlassJaccardIndex):
    """Per-class IoU from a confusion matrix summed over every batch on every worker (pixels
    labelled ``ignore_index``, the padding, left out); ``compute`` gives ``miou``, the mean over
    the classes present in the targets or the predictions (torchmetrics' ``average="macro"``),
    and ``iou_<name>`` for each, NaN for a class absent from both: its IoU is 0/0, which no
    figure stands for, and the key stays, so every evaluation of a run logs the same names."""

    def __init__(self, names: Sequence[str], ignore_index: int = IGNORE, **kwargs: Any):
        super().__init__(len(names), average="none", ignore_index=ignore_index, validate_args=False, **kwargs)
        self.names = tuple(names)

    def compute(self) -> dict[str, torch.Tensor]:
        iou = super().compute()
        present = (self.confmat.sum(0) + self.confmat.sum(1)) > 0
        iou = torch.where(present, iou, torch.nan)
        return {"miou": iou[present].mean(), **{f"iou_{name}": v for name, v in zip(self.names, iou, strict=True)}}


def detections(
    out: dict[str, torch.Tensor], sizes: torch.Tensor, top_k: int, threshold: float
) -> list[dict[str, torch.Tensor]]:
    """Per image, the heatmap's local maxima above ``threshold`` (at most ``top_k``) as boxes
    (xyxy pixels), labelled by the segmentation's most likely class at the box's centre and
    scored by objectness times that class's share of the foreground probability there.

    ``sizes`` (B, 2): each image's height and width before padding. The padding holds no
    detection: its heatmap cells are zero before the local maxima are found (so they neither
    take a place among the ``top_k`` nor suppress an image's own peak at its edge), and a
    detection whose box centre lies outside its image is dropped."""
    heat = out["obj"].float().sigmoid() * inside(sizes, out["obj"].shape[-2:], STRIDE)
    peaks = heat * (F.max_pool2d(heat, 3, 1, 1) == heat)
    sem = out["sem"].float().softmax(1)[:, 1:]
    gw = heat.shape[-1]
    results = []
    for b, (h, w) in enumerate(sizes.tolist()):
        scores, idx = peaks[b, 0].flatten().topk(min(top_k, peaks[b, 0].numel()))
        cy, cx = (idx // gw).float(), (idx % gw).float()
        ltrb = out["bbx"][b, :, idx // gw, idx % gw].float().T * BOX_SCALE
        px, py = (cx + 0.5) * STRIDE, (cy + 0.5) * STRIDE
        boxes = torch.stack([px - ltrb[:, 0], py - ltrb[:, 1], px + ltrb[:, 2], py + ltrb[:, 3]], 1)
        mx, my = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
        cell_inside = (py < h) & (px < w)
        keep = (scores > threshold) & cell_inside & (mx >= 0) & (mx < w) & (my >= 0) & (my < h)
        scores, boxes, mx, my = scores[keep], boxes[keep], mx[keep].long(), my[keep].long()
        fg = sem[b, :, my, mx].T  # (n, classes)
        share, labels = (fg / fg.sum(1, keepdim=True).clamp_min(1e-6)).max(1)
        results.append({"boxes": boxes, "scores": scores * share, "labels": labels})
    return results


# ---------------------------------------------------------------------- task


class SeamsegTask(Task):
    """Semantic segmentation, objectness and box regression on ``shapes`` of several aspect
    ratios; see the module docstring. ``task.params``: the network's ``width``, ``loss_weights``
    (one per term of :data:`TERMS`, in order), the detections kept per image (``top_k``, above
    ``score_threshold``), and the data set's parameters (``ShapesSpec``; ``widths`` defaults to
    two aspect ratios). ``task.params.data=coco`` builds its COCO counterpart instead
    (``tasks/converted/seamseg_coco.py``, whose :func:`build_seamseg` the name ``seamseg`` resolves to)."""

    count_keys = ("objects",)

    def __init__(
        self,
        width: int = 16,
        loss_weights: Sequence[float] = (1.0, 1.0, 1.0),
        top_k: int = 10,
        score_threshold: float = 0.05,
        widths: Sequence[int] = (64, 96),
        **generated: Any,
    ):
        params_at_least(("width", width, 1), ("top_k", top_k, 1))
        self.weights = term_weights(loss_weights)
        unknown = sorted(set(generated) - set(ShapesSpec.__dataclass_fields__))
        if unknown:
            raise ConfigError("task.params", f"unknown key(s) {unknown} for task 'seamseg'")
        try:
            self.spec = ShapesSpec(**generated, widths=tuple(widths))
        except ValueError as err:
            raise ConfigError("task.params", str(err)) from None
        for key, value in [("size", self.spec.size), *(("widths", w) for w in self.spec.widths)]:
            if value % STRIDE:
                raise ConfigError(
                    f"task.params.{key}", f"must be a multiple of {STRIDE} (the detection heads' stride); got {value}"
                )
        self.width, self.top_k, self.score_threshold = width, top_k, score_threshold

    # ------------------------------------------------------------------ data

    def prepare(self, data_dir: Path) -> None:
        write_shapes(data_dir, self.spec)

    def splits(self, data_dir: Path) -> dict[str, MapSplit]:
        base = self.spec.directory(data_dir)
        train = ShapesRows(base / "train.parquet", self.spec.size)
        validation = ShapesRows(base / "validation.parquet", self.spec.size)
        # A training batch holds images of one shape (seamseg's aspect-ratio batch sampler).
        grouped = functools.partial(GroupedBatchSampler, row_groups(train))
        return {
            "train": MapSplit(train, functools.partial(collate, pad=False), batch_sampler=grouped),
            "eval": MapSplit(validation, functools.partial(collate, pad=True)),
        }

    def counts(self, batch: dict[str, Any]) -> dict[str, float]:
        return {"objects": float(len(batch["centres"]))}

    # ------------------------------------------------------------------ model and loss

    def build_model(self) -> nn.Module:
        return SeamsegNet(len(CLASSES), self.width)

    def losses(self, out: dict[str, torch.Tensor], batch: dict[str, Any], objects: float) -> dict[str, torch.Tensor]:
        """The terms of :data:`TERMS`; ``obj`` and ``bbx`` are sums over objects divided by ``objects``."""
        b, y, x = batch["centres"].unbind(1)
        pred = out["bbx"][b, :, y, x].float()  # (N, 4)
        valid = inside(batch["sizes"], out["obj"].shape[-2:], STRIDE)
        return {
            "obj": focal_heatmap_loss(out["obj"], batch["heat"], valid) / objects,
            "bbx": F.l1_loss(pred, batch["ltrb"], reduction="sum") / objects,
            "sem": F.cross_entropy(out["sem"].float(), batch["sem"], ignore_index=IGNORE),
        }

    def criterion(self, model: nn.Module, batch: dict[str, Any], ctx: StepContext) -> LossOutput:
        out = model(batch["images"])
        # Every worker's objects of this update, at least one: the update's mean per object.
        objects = max(ctx.per_slot("objects"), 1.0 / ctx.slots)
        terms = self.losses(out, batch, objects)
        return LossOutput(terms=terms, weights=self.weights, sample_size=len(batch["images"]))

    # ------------------------------------------------------------------ evaluation

    def eval_metrics(self) -> dict[str, Any]:
        return {"seg": SegmentationIoU(SEGMENTS), "det": MeanAveragePrecision(len(CLASSES))}

    def evaluate(self, model: nn.Module, batch: dict[str, Any], metrics: dict[str, Any] | None = None) -> EvalOutput:
        out = model(batch["images"])
        n = float(len(batch["images"]))
        terms = self.losses(out, batch, max(float(len(batch["centres"])), 1.0))
        result: EvalOutput = {k: (v, n) for k, v in terms.items()}
        result["loss"] = (sum(self.weights[k] * v for k, v in terms.items()), n)
        if metrics:
            metrics["seg"].update(out["sem"].argmax(1), batch["sem"])
            targets = [
                {"boxes": b, "labels": lab, "image_id": i}
                for b, lab, i in zip(batch["boxes"], batch["labels"], batch["ids"].tolist(), strict=True)
            ]
            metrics["det"].update(detections(out, batch["sizes"], self.top_k, self.score_threshold), targets)
        return result


def term_weights(loss_weights: Sequence[float]) -> dict[str, float]:
    """``task.params.loss_weights`` (a list in the order of :data:`TERMS`) by term name."""
    if isinstance(loss_weights, (str, bytes)) or not isinstance(loss_weights, Sequence):
        raise ConfigError("task.params.loss_weights", f"must be a list of {len(TERMS)} numbers; got {loss_weights!r}")
    if len(loss_weights) != len(TERMS):
        raise ConfigError(
            "task.params.loss_weights",
            f"needs one weight per loss term {list(TERMS)}, in that order; got {len(loss_weights)}: {list(loss_weights)}",
        )
    try:
        return {name: float(w) for name, w in zip(TERMS, loss_weights, strict=True)}
    except (TypeError, ValueError):
        raise ConfigError("task.params.loss_weights", f"must be numbers; got {list(loss_weights)}") from None
