"""DETR set prediction on the generated ``shapes`` data (raytrain_loops/tasks/datasets/shapes.py).

A small ResNet-style backbone of stride 8 (:class:`Backbone`: a stride-2 stem and three stages
of ``depth`` basic residual blocks at ``width``, 2x and 4x its channels; ``depth=0`` makes it a
plain stack of four conv blocks), a Transformer encoder layer over its feature map with learned
2-D position embeddings, and an ``nn.TransformerDecoder`` over ``num_queries`` learned queries;
class and box heads (shared) read every decoder layer, so the last gives the predictions and the
others the auxiliary outputs. Each image's predictions are matched one-to-one to its objects by
the Hungarian algorithm on class + L1 + GIoU costs. The loss is DETR's weighted sum of terms:
``loss_ce`` (cross-entropy over all queries, the no-object class down-weighted by ``eos_coef``),
``loss_bbox`` (L1) and ``loss_giou`` (1 - GIoU) of the matched pairs, and their ``_<i>`` copies
on decoder layer ``i``'s outputs, weighted by ``weight_dict``. The box terms are divided by the
number of boxes over the whole update on all workers, which the engine sums before the forward
passes (``count_keys``/``counts``, read as ``ctx.per_slot("boxes")``): no collective in the
criterion. ``class_error`` and ``cardinality_error`` are logged as in DETR.

Evaluation: the same terms on the validation split, and the COCO box mAP of pycocotools'
``COCOeval`` over the whole split on all workers (``eval_map``, ``eval_map50``, ``eval_map75``)
through :class:`~raytrain_loops.tasks.detection.MeanAveragePrecision`: every query is a detection
(DETR's evaluation), scored by its best real class's probability, each image known by
:func:`image_id`. Each evaluation also scores the model as initialised on the same images
(``eval_init_map50``), the baseline training must beat.
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from raytrain_loops.config import ConfigError
from raytrain_loops.data.formats.images import ConvertedSet, coco_view, decode
from raytrain_loops.data.parquet import ROW_SEED
from raytrain_loops.engine import LossOutput, StepContext
from raytrain_loops.tasks.base import EvalOutput, ParquetSplit, Task, params_at_least
from raytrain_loops.tasks.cvnets import load_backbone
from raytrain_loops.tasks.datasets.shapes import CLASSES, COLUMNS, ShapesSpec, decode_image, write_shapes
from raytrain_loops.tasks.detection import (
    MeanAveragePrecision,
    cxcywh_to_xyxy,
    generalized_box_iou,
    hungarian_match,
)
from raytrain_loops.tasks.images import Block

BASE_TERMS = ("loss_ce", "loss_bbox", "loss_giou")
COCO_COLUMNS = ["image", "image_id", "category_ids", "boxes", "iscrowd"]
MEAN = torch.tensor([0.5, 0.5, 0.5]).view(1, 3, 1, 1)
STD = torch.tensor([0.25, 0.25, 0.25]).view(1, 3, 1, 1)


class Backbone(nn.Module):
    """(B, 3, H, W) -> (B, 4 * width, H/8, W/8). ``depth`` 0: four 3x3 conv blocks with BatchNorm,
    the first three of stride 2. ``depth`` >= 1: a ResNet-style stack, a 3x3 stem of stride 2 and
    three stages of ``depth`` basic residual blocks each (``width``, 2x and 4x its channels; the
    second and third stages start at stride 2)."""

    def __init__(self, width: int, depth: int = 1):
        super().__init__()

        def block(cin, cout, stride):
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
            )

        if depth == 0:
            layers = [block(3, width, 2), block(width, 2 * width, 2), block(2 * width, 4 * width, 2)]
            layers.append(block(4 * width, 4 * width, 1))
        else:
            layers, cin = [block(3, width, 2)], width
            for stage, cout in enumerate((width, 2 * width, 4 * width)):
                for k in range(depth):
                    layers.append(Block(cin, cout, 2 if stage and not k else 1))
                    cin = cout
        self.body = nn.Sequential(*layers)
        self.channels = 4 * width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class MLP(nn.Sequential):
    def __init__(self, dim: int, out: int, layers: int):
        mods: list[nn.Module] = []
        for _ in range(layers - 1):
            mods += [nn.Linear(dim, dim), nn.ReLU(inplace=True)]
        super().__init__(*mods, nn.Linear(dim, out))


class DETR(nn.Module):
    """Backbone, encoder, decoder over learned queries, class and box heads on every layer."""

    def __init__(
        self,
        num_classes: int,
        num_queries: int,
        dim: int,
        heads: int,
        enc_layers: int,
        dec_layers: int,
        width: int,
        size: int,
        dropout: float,
        depth: int = 1,
    ):
        super().__init__()
        self.backbone = Backbone(width, depth)
        self.proj = nn.Conv2d(self.backbone.channels, dim, 1)
        tokens = (size // 8) ** 2
        self.pos = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout, batch_first=True, norm_first=True),
            enc_layers,
            enable_nested_tensor=False,
        )
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(dim, heads, 2 * dim, dropout, batch_first=True, norm_first=True),
            dec_layers,
            norm=nn.LayerNorm(dim),
        )
        self.queries = nn.Parameter(torch.randn(1, num_queries, dim) * 0.02)
        self.class_head = nn.Linear(dim, num_classes + 1)
        self.box_head = MLP(dim, 4, 3)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (L, B, Q, C+1) and boxes (L, B, Q, 4) cxcywh in [0, 1], one row per decoder layer."""
        memory = self.proj(self.backbone(images)).flatten(2).transpose(1, 2) + self.pos
        memory = self.encoder(memory)
        x = self.queries.expand(len(images), -1, -1)
        hidden = []
        for layer in self.decoder.layers:
            x = layer(x, memory)
            hidden.append(self.decoder.norm(x))
        h = torch.stack(hidden)
        return self.class_head(h), self.box_head(h).sigmoid()


def image_id(raw: bytes) -> int:
    """An image's id over its split: 63 bits of a hash of its bytes. The rows of a Parquet split
    carry no index, and a Ray Data shard does not say which rows it holds; the hash is the same
    on whichever worker reads the image, so the mAP's ranking of tied scores (by image id) does
    not depend on the workers. The generated images are drawn with noise, so no two are alike;
    ids given twice are an error of the metric."""
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1


def expand_weights(weight_dict: dict[str, float], aux_layers: int) -> dict[str, float]:
    """The weight of every term: the base ones and their ``_<i>`` copies per auxiliary layer."""
    missing = [k for k in BASE_TERMS if k not in weight_dict]
    unknown = sorted(set(weight_dict) - set(BASE_TERMS))
    if missing or unknown:
        raise ConfigError(
            "task.params.weight_dict", f"needs exactly {list(BASE_TERMS)}; missing {missing}, unknown {unknown}"
        )
    out = {k: float(v) for k, v in weight_dict.items()}
    for i in range(aux_layers):
        out.update({f"{k}_{i}": float(weight_dict[k]) for k in BASE_TERMS})
    return out


class DetrTask(Task):
    """DETR on ``shapes``; see the module docstring. ``param_groups`` puts the backbone at
    ``backbone_lr_scale`` times the learning rate (``optim.param_groups=task``).
    ``data=coco`` makes a :class:`DetrCocoTask`."""

    def __new__(cls, *args: Any, data: str = "shapes", **params: Any):
        if data not in ("shapes", "coco"):
            raise ConfigError("task.params.data", f"must be one of ['shapes', 'coco']; got {data!r}")
        return super().__new__(DetrCocoTask if cls is DetrTask and data == "coco" else cls)

    count_keys = ("boxes",)

    def __init__(
        self,
        num_queries: int = 10,
        dim: int = 128,
        heads: int = 4,
        enc_layers: int = 1,
        dec_layers: int = 3,
        width: int = 32,
        dropout: float = 0.0,
        eos_coef: float = 0.1,
        weight_dict: dict[str, float] | None = None,
        cost_class: float = 1.0,
        cost_bbox: float = 5.0,
        cost_giou: float = 2.0,
        backbone_lr_scale: float = 0.1,
        aux_loss: bool = True,
        depth: int = 1,
        backbone_weights: str = "",
        data: str = "shapes",
        source: str = "",
        **generated: Any,
    ):
        params_at_least(
            ("num_queries", num_queries, 1),
            ("dim", dim, 1),
            ("heads", heads, 1),
            ("enc_layers", enc_layers, 0),
            ("dec_layers", dec_layers, 1),
            ("width", width, 1),
            ("depth", depth, 0),
        )
        if dim % heads:
            raise ConfigError("task.params.dim", f"must be a multiple of heads={heads}; got {dim}")
        if not 0.0 < eos_coef <= 1.0:
            raise ConfigError("task.params.eos_coef", f"must be in (0, 1]; got {eos_coef}")
        unknown = sorted(set(generated) - set(ShapesSpec.__dataclass_fields__))
        if unknown:
            raise ConfigError("task.params", f"unknown key(s) {unknown} for task 'detr'")
        try:
            self.spec = ShapesSpec(**generated)
        except ValueError as err:
            raise ConfigError("task.params", str(err)) from None
        if source and data == "shapes":
            raise ConfigError("task.params.source", "names a converted COCO set, for task.params.data=coco")
        if num_queries < self.spec.max_objects and data == "shapes":
            raise ConfigError(
                "task.params.num_queries", f"must be >= max_objects={self.spec.max_objects}; got {num_queries}"
            )
        self.num_queries, self.dim, self.heads = num_queries, dim, heads
        self.enc_layers, self.dec_layers, self.width, self.dropout = enc_layers, dec_layers, width, dropout
        self.depth, self.backbone_weights = depth, backbone_weights
        self.eos_coef, self.backbone_lr_scale, self.aux_loss = eos_coef, backbone_lr_scale, aux_loss
        self.costs = (cost_class, cost_bbox, cost_giou)
        base = weight_dict or {"loss_ce": 1.0, "loss_bbox": 5.0, "loss_giou": 2.0}
        self.weights = expand_weights(base, dec_layers - 1 if aux_loss else 0)
        self.num_classes = len(CLASSES)
        self._initial: nn.Module | None = None

    # ------------------------------------------------------------------ data

    def prepare(self, data_dir: Path) -> None:
        write_shapes(data_dir, self.spec)

    def splits(self, data_dir: Path) -> dict[str, ParquetSplit]:
        base = self.spec.directory(data_dir)
        return {
            "train": ParquetSplit(str(base / "train.parquet"), COLUMNS[:3]),
            "eval": ParquetSplit(str(base / "validation.parquet"), COLUMNS[:3]),
        }

    def collate(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """Images (B, 3, H, W) normalised; per image, labels (n,) and boxes (n, 4) cxcywh, and
        ``ids`` (B,), each image's :func:`image_id`."""
        s = self.spec.size
        images = np.stack([decode_image(raw, s) for raw in batch["image"]])
        x = torch.from_numpy(images).permute(0, 3, 1, 2).float().div_(255.0)
        labels = [torch.tensor(np.asarray(v, dtype=np.int64)) for v in batch["labels"]]
        boxes = [torch.tensor(np.asarray(v, dtype=np.float32)).reshape(-1, 4) for v in batch["boxes"]]
        ids = torch.tensor([image_id(raw) for raw in batch["image"]], dtype=torch.long)
        return {"images": (x - MEAN) / STD, "labels": labels, "boxes": boxes, "ids": ids}

    def counts(self, batch: dict[str, Any]) -> dict[str, float]:
        return {"boxes": float(sum(len(v) for v in batch["labels"]))}

    # ------------------------------------------------------------------ model

    def build_model(self) -> nn.Module:
        model = DETR(
            self.num_classes,
            self.num_queries,
            self.dim,
            self.heads,
            self.enc_layers,
            self.dec_layers,
            self.width,
            self.spec.size,
            self.dropout,
            self.depth,
        )
        if self.backbone_weights:
            load_backbone(model.backbone, self.backbone_weights)
        self._initial = copy.deepcopy(model).eval().requires_grad_(False)
        return model

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        backbone = [p for n, p in model.named_parameters() if n.startswith("backbone.")]
        rest = [p for n, p in model.named_parameters() if not n.startswith("backbone.")]
        return [{"params": rest}, {"params": backbone, "lr_scale": self.backbone_lr_scale}]

    # ------------------------------------------------------------------ loss

    def losses(
        self, logits: torch.Tensor, boxes: torch.Tensor, batch: dict[str, Any], num_boxes: float
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The terms of every layer (suffix ``_<i>`` for auxiliary layer ``i``) and the last
        layer's ``class_error`` and ``cardinality_error``."""
        targets = list(zip(batch["labels"], batch["boxes"], strict=True))
        terms: dict[str, torch.Tensor] = {}
        logs: dict[str, torch.Tensor] = {}
        last = len(logits) - 1
        layers = range(len(logits)) if self.aux_loss else [last]
        for layer in layers:
            suffix = "" if layer == last else f"_{layer}"
            t, extra = self._layer_losses(logits[layer], boxes[layer], targets, num_boxes)
            terms.update({f"{k}{suffix}": v for k, v in t.items()})
            if layer == last:
                logs = extra
        return terms, logs

    def _layer_losses(self, logits, boxes, targets, num_boxes):
        match = hungarian_match(logits, boxes, targets, *self.costs)
        batch_idx = torch.cat([torch.full_like(q, i) for i, (q, _) in enumerate(match)]).to(logits.device)
        query_idx = torch.cat([q for q, _ in match]).to(logits.device)
        matched_labels = torch.cat([t[0][j] for t, (_, j) in zip(targets, match, strict=True)])
        matched_boxes = torch.cat([t[1][j] for t, (_, j) in zip(targets, match, strict=True)]).float()
        classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.long, device=logits.device)
        classes[batch_idx, query_idx] = matched_labels
        weight = torch.ones(self.num_classes + 1, device=logits.device)
        weight[-1] = self.eos_coef
        loss_ce = F.cross_entropy(logits.float().transpose(1, 2), classes, weight)
        pred = boxes[batch_idx, query_idx].float()
        loss_bbox = F.l1_loss(pred, matched_boxes, reduction="sum") / num_boxes
        giou = torch.diag(generalized_box_iou(cxcywh_to_xyxy(pred), cxcywh_to_xyxy(matched_boxes)))
        loss_giou = (1 - giou).sum() / num_boxes
        with torch.no_grad():
            hit = logits[batch_idx, query_idx].argmax(-1) == matched_labels
            class_error = 100.0 - 100.0 * hit.float().mean() if len(hit) else logits.new_tensor(100.0)
            predicted = (logits.argmax(-1) != self.num_classes).sum(1).float()
            actual = torch.tensor([float(len(t[0])) for t in targets], device=logits.device)
            cardinality_error = (predicted - actual).abs().mean()
        terms = {"loss_ce": loss_ce, "loss_bbox": loss_bbox, "loss_giou": loss_giou}
        return terms, {"class_error": class_error, "cardinality_error": cardinality_error}

    def criterion(self, model: nn.Module, batch: dict[str, Any], ctx: StepContext) -> LossOutput:
        logits, boxes = model(batch["images"])
        # DETR's num_boxes: all workers' boxes of this update, at least one.
        num_boxes = max(ctx.per_slot("boxes"), 1.0 / ctx.slots)
        terms, logs = self.losses(logits, boxes, batch, num_boxes)
        weights = {k: self.weights[k] for k in terms}
        return LossOutput(terms=terms, weights=weights, sample_size=len(batch["labels"]), logs=logs)

    # ------------------------------------------------------------------ evaluation

    def eval_metrics(self) -> dict[str, Any]:
        return {
            "map": MeanAveragePrecision(self.num_classes),
            "init": MeanAveragePrecision(self.num_classes, prefix="init_"),
        }

    def detections(self, logits: torch.Tensor, boxes: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Every query as a detection: its best real class, that class's probability, its box (xyxy)."""
        prob = logits.float().softmax(-1)[..., :-1]
        scores, labels = prob.max(-1)
        xyxy = cxcywh_to_xyxy(boxes.float())
        return [{"boxes": xyxy[i], "scores": scores[i], "labels": labels[i]} for i in range(len(logits))]

    def evaluate(self, model: nn.Module, batch: dict[str, Any], metrics: dict[str, Any] | None = None) -> EvalOutput:
        logits, boxes = model(batch["images"])
        n_images = float(len(batch["labels"]))
        num_boxes = max(float(sum(len(v) for v in batch["labels"])), 1.0)
        terms, logs = self.losses(logits, boxes, batch, num_boxes)
        out: EvalOutput = {k: (v, n_images) for k, v in terms.items() if k in BASE_TERMS}
        out.update({k: (v, n_images) for k, v in logs.items()})
        out["loss"] = (sum(self.weights[k] * v for k, v in terms.items()), n_images)
        if metrics:
            targets = [
                {"boxes": cxcywh_to_xyxy(b.float()), "labels": lab, "image_id": i}
                for lab, b, i in zip(batch["labels"], batch["boxes"], batch["ids"].tolist(), strict=True)
            ]
            metrics["map"].update(self.detections(logits[-1], boxes[-1]), targets)
            if self._initial is not None:
                initial = self._initial.to(batch["images"].device)
                init_logits, init_boxes = initial(batch["images"])
                metrics["init"].update(self.detections(init_logits[-1], init_boxes[-1]), targets)
        return out


class DetrCocoTask(DetrTask):
    """DETR on a converted COCO directory (``data=coco``, the set at ``source``): each image
    decoded in ``preprocess``, its crowd annotations left out as DETR's ``ConvertCocoPolysToMask``
    does, the categories in ``meta.json``'s order as the classes. Training: DETR's flip, random
    resize (the longer side to 0.75 to 1.25 of ``size``) and random crop of ``size`` x ``size``
    (boxes clipped to it, emptied ones dropped); evaluation: the longer side resized to ``size``.
    Images are padded to ``size`` x ``size`` at the bottom and right (the encoder's positions are
    a fixed grid); boxes as (cx, cy, w, h) over ``size``. An image's id is its COCO id."""

    def __init__(self, source: str = "", data: str = "coco", **params: Any):
        super().__init__(**params)
        self.images = ConvertedSet(source, "coco")

    def prepare(self, data_dir: Path) -> None:
        self.num_classes = len(self.images.meta["categories"])

    def build_model(self) -> nn.Module:
        self.prepare(Path("."))
        return super().build_model()

    def data_digest(self) -> str:
        return self.images.digest

    def splits(self, data_dir: Path) -> dict[str, ParquetSplit]:
        found = {name: self.images.split(name) for name in ("train", "eval")}
        return {name: ParquetSplit(path, COCO_COLUMNS) for name, path in found.items() if path}

    def preprocess(self, batch: dict[str, np.ndarray], train: bool) -> dict[str, np.ndarray]:
        index = {c["id"]: i for i, c in enumerate(self.images.meta["categories"])}
        n, s = len(batch["image"]), self.spec.size
        images = np.zeros((n, 3, s, s), dtype=np.uint8)
        labels, boxes = np.empty(n, dtype=object), np.empty(n, dtype=object)
        for i in range(n):
            rng = np.random.default_rng(int(batch[ROW_SEED][i]))
            keep = np.asarray(batch["iscrowd"][i], dtype=np.int64) == 0
            xywh = np.asarray(batch["boxes"][i], dtype=np.float64).reshape(-1, 4)[keep]
            image = decode(batch["image"][i], 3)
            image, xyxy = coco_view(image, np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], 1), s, train, rng)
            cats = np.asarray(batch["category_ids"][i], dtype=np.int64)[keep]
            visible = (xyxy[:, 2] > xyxy[:, 0]) & (xyxy[:, 3] > xyxy[:, 1])
            xyxy, cats = xyxy[visible] / s, cats[visible]
            images[i, :, : image.shape[1], : image.shape[2]] = image
            labels[i] = np.asarray([index[c] for c in cats], dtype=np.int64)
            boxes[i] = np.concatenate([(xyxy[:, :2] + xyxy[:, 2:]) / 2, xyxy[:, 2:] - xyxy[:, :2]], 1).astype(np.float32)
        return {"image": images, "labels": labels, "boxes": boxes, "id": np.asarray(batch["image_id"], dtype=np.int64)}

    def collate(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        x = torch.from_numpy(np.ascontiguousarray(batch["image"])).float().div_(255.0)
        labels = [torch.as_tensor(v, dtype=torch.long) for v in batch["labels"]]
        boxes = [torch.as_tensor(v, dtype=torch.float32).reshape(-1, 4) for v in batch["boxes"]]
        ids = torch.as_tensor(np.asarray(batch["id"]), dtype=torch.long)
        return {"images": (x - MEAN) / STD, "labels": labels, "boxes": boxes, "ids": ids}
