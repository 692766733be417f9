"""Box geometry, Hungarian matching and the split-level COCO box mAP, without torchvision.

torchvision's wheels pin their own torch build, so it does not install beside this project's CPU
torch; torchmetrics' ``MeanAveragePrecision`` needs it (``torchvision.ops``). The geometry and the
matching are small and tested here: :func:`generalized_box_iou`, :func:`hungarian_match`. The mAP
is pycocotools' ``COCOeval`` itself, run once per evaluation on the whole split's detections
(:class:`MeanAveragePrecision`, a ``torchmetrics.Metric`` that gathers them to rank 0).
"""

from __future__ import annotations

import contextlib
import io
import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from scipy.optimize import linear_sum_assignment
from torchmetrics import Metric


def cxcywh_to_xyxy(b: torch.Tensor) -> torch.Tensor:
    cx, cy, w, h = b.unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


def box_iou(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairwise IoU of ``xyxy`` boxes (N, 4) x (M, 4), and the union areas."""
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt = torch.max(a[:, None, :2], b[None, :, :2])
    rb = torch.min(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    union = area_a[:, None] + area_b[None, :] - inter
    return inter / union.clamp(min=1e-12), union


def generalized_box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise generalised IoU of ``xyxy`` boxes: IoU minus the share of the smallest enclosing
    box that the union leaves empty; in [-1, 1], 1 for identical boxes."""
    iou, union = box_iou(a, b)
    lt = torch.min(a[:, None, :2], b[None, :, :2])
    rb = torch.max(a[:, None, 2:], b[None, :, 2:])
    hull = (rb - lt).clamp(min=0).prod(-1)
    return iou - (hull - union) / hull.clamp(min=1e-12)


@torch.no_grad()
def hungarian_match(
    logits: torch.Tensor,
    boxes: torch.Tensor,
    targets: list[tuple[torch.Tensor, torch.Tensor]],
    cost_class: float,
    cost_bbox: float,
    cost_giou: float,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each image, the (query indices, target indices) of the assignment of least cost:
    ``cost_class * -p(target class) + cost_bbox * L1 + cost_giou * -GIoU``. ``logits`` (B, Q,
    C+1), ``boxes`` (B, Q, 4) cxcywh; ``targets`` per image (labels (n,), boxes (n, 4))."""
    b, q = logits.shape[:2]
    sizes = [len(labels) for labels, _ in targets]
    empty = torch.zeros(0, dtype=torch.long)
    if sum(sizes) == 0:
        return [(empty, empty)] * b
    # One cost matrix for all queries against all targets of the batch (as DETR), cut per image.
    prob = logits.float().flatten(0, 1).softmax(-1)
    pb = boxes.float().flatten(0, 1)
    labels = torch.cat([t[0] for t in targets])
    tb = torch.cat([t[1] for t in targets]).float()
    cost = (
        -cost_class * prob[:, labels]
        + cost_bbox * torch.cdist(pb, tb, p=1)
        - cost_giou * generalized_box_iou(cxcywh_to_xyxy(pb), cxcywh_to_xyxy(tb))
    )
    # Non-finite predictions still get a matching, so the loss comes out non-finite and the
    # engine's non-finite policy (not scipy's ValueError) decides what happens.
    cost = torch.nan_to_num(cost, nan=1e6, posinf=1e6, neginf=-1e6)
    blocks = cost.view(b, q, -1).cpu().numpy()
    out, at = [], 0
    for i, n in enumerate(sizes):
        if n == 0:
            out.append((empty, empty))
            continue
        rows, cols = linear_sum_assignment(blocks[i, :, at : at + n])
        out.append((torch.as_tensor(rows, dtype=torch.long), torch.as_tensor(cols, dtype=torch.long)))
        at += n
    return out


class MeanAveragePrecision(Metric):
    """COCO box mAP over a whole split, as pycocotools' ``COCOeval`` computes it (the figure
    detection papers report, and DETR's own evaluation): ``map`` (IoU 0.5:0.95), ``map50`` and
    ``map75``, its ``stats[0]``, ``stats[1]`` and ``stats[2]``, keys prefixed by ``prefix``.

    Each worker keeps its images' detections and objects as they come (memory in proportion to
    them). ``compute``, called on every worker, gathers them to rank 0, which runs ``COCOeval``
    on the whole split and broadcasts the figures (or its error) to the others; a worker that saw
    no image takes part all the same. ``COCOeval`` ranks the detections of all images by score
    and breaks ties by image id, then by the order of an image's detections: the figures depend
    on the images' ids, never on which worker saw an image or in what order.

    ``nan`` when the split has no object at all (``COCOeval``'s -1), 0 when it has objects but
    no detections.
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, num_classes: int, prefix: str = "", **kwargs: Any):
        # compute gathers the states itself (to rank 0, ragged, any worker possibly without
        # any), so torchmetrics' own synchronisation is off.
        super().__init__(sync_on_compute=False, **kwargs)
        self.num_classes = num_classes
        self.prefix = prefix  # of the result keys: a second model's figures beside the first's
        for name in ("image_ids", "det_ids", "dets", "gt_ids", "gts"):
            self.add_state(name, [], dist_reduce_fx=None)

    def update(self, preds: list[dict[str, torch.Tensor]], targets: list[dict[str, torch.Tensor]]) -> None:
        """One entry per image: ``preds`` with ``boxes`` (n, 4) xyxy, ``scores`` (n,) (any real
        numbers: probabilities or logits) and ``labels`` (n,) in [0, num_classes); ``targets``
        with ``boxes`` (m, 4) xyxy, ``labels`` (m,) and ``image_id``, an integer unique over the
        split and the same whichever worker sees the image (taken from the data)."""
        if len(preds) != len(targets):
            raise ValueError(f"{len(preds)} images of detections against {len(targets)} of targets")
        ids = []
        for t in targets:
            if "image_id" not in t:
                raise ValueError(
                    "each target needs an 'image_id': an integer unique over the split, taken from the data "
                    "(a row index, say), so that the ranking of tied scores does not depend on the workers"
                )
            ids.append(int(t["image_id"]))
        image_ids = torch.tensor(ids, dtype=torch.long)
        dets = [_rows(p, "preds", ("labels", "scores")) for p in preds]
        gts = [_rows(t, "targets", ("labels",)) for t in targets]
        self.image_ids.append(image_ids)
        self.det_ids.append(image_ids.repeat_interleave(torch.tensor([len(d) for d in dets], dtype=torch.long)))
        self.gt_ids.append(image_ids.repeat_interleave(torch.tensor([len(g) for g in gts], dtype=torch.long)))
        self.dets.append(torch.cat(dets) if dets else torch.zeros(0, 6, dtype=torch.float64))
        self.gts.append(torch.cat(gts) if gts else torch.zeros(0, 5, dtype=torch.float64))

    def compute(self) -> dict[str, torch.Tensor]:
        local = {
            name: _cat(getattr(self, name), width)
            for name, width in (("image_ids", 0), ("det_ids", 0), ("dets", 6), ("gt_ids", 0), ("gts", 5))
        }
        group = self.process_group
        parts = _gather_to_first(local, group)
        figures: tuple[float, ...] | None = None
        error: BaseException | None = None
        if parts is not None:  # rank 0
            try:
                whole = {name: np.concatenate([p[name] for p in parts]) for name in local}
                figures = coco_box_map(num_classes=self.num_classes, **whole)
            except Exception as err:  # sent to the other workers, so that every one raises
                error = err
        figures, message = _broadcast_from_first(
            (figures, None if error is None else f"{type(error).__name__}: {error}"), group
        )
        if error is not None:
            raise error
        if message is not None:
            raise RuntimeError(f"the box mAP failed on rank 0: {message}")
        return {f"{self.prefix}{k}": torch.tensor(v, dtype=torch.float64) for k, v in zip(KEYS, figures, strict=True)}


KEYS = ("map", "map50", "map75")  # COCOeval's stats[0], stats[1], stats[2]


def coco_box_map(
    image_ids: np.ndarray,
    det_ids: np.ndarray,
    dets: np.ndarray,
    gt_ids: np.ndarray,
    gts: np.ndarray,
    num_classes: int,
) -> tuple[float, float, float]:
    """``COCOeval``'s box AP at IoU 0.5:0.95, 0.5 and 0.75 (100 detections per image and class,
    every area) of the images ``image_ids``: detections ``dets`` (n, 6) as (label, score, x1, y1,
    x2, y2) of images ``det_ids`` (n,), objects ``gts`` (m, 5) as (label, x1, y1, x2, y2) of
    images ``gt_ids`` (m,); an image's rows in the order given. Classes without objects are left
    out of the means, as ``COCOeval`` leaves them out."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    keys, counts = np.unique(image_ids, return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            f"image ids {keys[counts > 1][:5].tolist()} were given for more than one image: "
            "an image's id must be unique over the split"
        )
    for what, labels in (("detection", dets[:, 0]), ("object", gts[:, 0])):
        bad = labels[(labels < 0) | (labels >= num_classes) | (labels != np.round(labels))]
        if len(bad):
            raise ValueError(f"{what} labels {bad[:5].tolist()} are not classes in [0, {num_classes})")
    if not len(gts):
        return (math.nan,) * 3
    if not len(dets):
        return (0.0,) * 3

    def xywh(xyxy: np.ndarray) -> list[list[float]]:
        return np.concatenate([xyxy[:, :2], xyxy[:, 2:] - xyxy[:, :2]], 1).tolist()

    # Annotation ids from 1: COCOeval takes a matched id of 0 for no match.
    gt_columns = zip(gt_ids.tolist(), gts[:, 0].astype(int).tolist(), xywh(gts[:, 1:]), strict=True)
    objects = [
        {"id": i + 1, "image_id": k, "category_id": c, "bbox": box, "area": box[2] * box[3], "iscrowd": 0}
        for i, (k, c, box) in enumerate(gt_columns)
    ]
    det_columns = zip(
        det_ids.tolist(), dets[:, 0].astype(int).tolist(), dets[:, 1].tolist(), xywh(dets[:, 2:]), strict=True
    )
    results = [{"image_id": k, "category_id": c, "score": score, "bbox": box} for k, c, score, box in det_columns]
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress and summary
        truth = COCO()
        truth.dataset = {
            "images": [{"id": k} for k in keys.tolist()],
            "annotations": objects,
            "categories": [{"id": c} for c in range(num_classes)],
        }
        truth.createIndex()
        evaluation = COCOeval(truth, truth.loadRes(results), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return tuple(math.nan if s < 0 else float(s) for s in evaluation.stats[:3])


def _rows(entry: dict[str, torch.Tensor], what: str, columns: tuple[str, ...]) -> torch.Tensor:
    """An image's entry as float64 rows: its ``columns`` (one value per box), then the box."""
    boxes = entry["boxes"]
    if boxes.ndim != 2 or boxes.shape[-1] != 4:
        raise ValueError(f"{what}: 'boxes' must be (n, 4) xyxy; got shape {tuple(boxes.shape)}")
    for name in columns:
        if entry[name].shape != boxes.shape[:1]:
            raise ValueError(f"{what}: {len(boxes)} boxes but {name!r} of shape {tuple(entry[name].shape)}")
    return torch.cat([*(entry[name].detach().double()[:, None] for name in columns), boxes.detach().double()], 1)


def _cat(parts: list[torch.Tensor], width: int) -> np.ndarray:
    """The rows of one state as a NumPy array on the host (``width`` 0: a vector)."""
    if not parts:
        return np.zeros((0, width) if width else 0, dtype=np.float64 if width else np.int64)
    return torch.cat([p.to("cpu", non_blocking=False) for p in parts]).numpy()


def _gather_to_first(obj: Any, group: Any) -> list[Any] | None:
    """Every worker's ``obj`` in rank order on the group's first rank, None on the others."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [obj]
    first = dist.get_rank(group) == 0
    out: list[Any] | None = [None] * dist.get_world_size(group) if first else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    return out


def _broadcast_from_first(obj: Any, group: Any) -> Any:
    """The group's first rank's ``obj`` on every worker."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    return box[0]
