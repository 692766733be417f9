"""Box geometry, Hungarian matching and a split-level mean average precision, without torchvision.

torchvision's wheels pin their own torch build, so it does not install beside this project's CPU
torch; torchmetrics' ``MeanAveragePrecision`` needs it (``torchvision.ops``). The pieces here are
small and tested instead: :func:`generalized_box_iou`, :func:`hungarian_match` and
:class:`MeanAveragePrecision`, a ``torchmetrics.Metric`` whose state is fixed-size histograms
summed across workers (one all-reduce per state, no ragged gathers, and a worker without a single
evaluation batch still joins).
"""

from __future__ import annotations

import torch
from scipy.optimize import linear_sum_assignment
from torchmetrics import Metric

IOU_THRESHOLDS = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))  # COCO's 0.5:0.95


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
    """COCO-style box mAP over a whole split: per class and IoU threshold, detections of all
    images ranked by score and matched greedily (highest score first, to the unmatched ground
    truth of the same class with the highest IoU at or above the threshold); precision made
    monotone and read at 101 recall points; the mean over classes that have ground truth.
    ``compute`` gives ``map`` (IoU 0.5:0.95), ``map50`` and ``map75``.

    Scores are kept as a histogram of ``bins`` bins per class and threshold (true and false
    positives), so the state is fixed-size and summed across workers; detections whose scores
    share a bin are ranked together, which moves the result by at most the precision change
    within one bin (tested against an exact ranking).
    """

    full_state_update = False

    def __init__(self, num_classes: int, bins: int = 4096, max_detections: int = 100, prefix: str = "", **kwargs):
        super().__init__(**kwargs)
        self.num_classes, self.bins, self.max_detections = num_classes, bins, max_detections
        self.prefix = prefix  # of the result keys: a second model's figures beside the first's
        self.register_buffer("thresholds", torch.tensor(IOU_THRESHOLDS, dtype=torch.float64), persistent=False)
        shape = (len(IOU_THRESHOLDS), num_classes, bins)
        self.add_state("tp", torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("fp", torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("n_gt", torch.zeros(num_classes, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, preds: list[dict[str, torch.Tensor]], targets: list[dict[str, torch.Tensor]]) -> None:
        """One entry per image: ``preds`` with ``boxes`` (xyxy), ``scores``, ``labels``;
        ``targets`` with ``boxes`` (xyxy) and ``labels``."""
        for p, t in zip(preds, targets, strict=True):
            self._update_image(p, t)

    def _update_image(self, p: dict[str, torch.Tensor], t: dict[str, torch.Tensor]) -> None:
        scores, order = p["scores"].double().sort(descending=True)
        order = order[: self.max_detections]
        scores = scores[: self.max_detections]
        boxes, labels = p["boxes"][order].double(), p["labels"][order]
        tboxes, tlabels = t["boxes"].double(), t["labels"]
        self.n_gt += torch.bincount(tlabels.to(self.n_gt.device), minlength=self.num_classes).double()
        bins = (scores * self.bins).long().clamp(0, self.bins - 1)
        thr = self.thresholds.to(boxes.device)
        for c in labels.unique().tolist():
            det = (labels == c).nonzero().flatten()
            gt = (tlabels == c).nonzero().flatten()
            tp = torch.zeros(len(thr), len(det), dtype=torch.bool, device=boxes.device)
            if len(gt):
                iou = box_iou(boxes[det], tboxes[gt])[0]
                matched = torch.zeros(len(thr), len(gt), dtype=torch.bool, device=boxes.device)
                for j in range(len(det)):  # by descending score
                    candidates = iou[j][None, :].expand(len(thr), -1).masked_fill(matched, -1.0)
                    best, which = candidates.max(1)
                    hit = best >= thr
                    tp[:, j] = hit
                    matched[hit, which[hit]] = True
            b = bins[det].to(self.tp.device)
            self.tp[:, c].index_add_(1, b, tp.double().to(self.tp.device))
            self.fp[:, c].index_add_(1, b, (~tp).double().to(self.tp.device))

    def compute(self) -> dict[str, torch.Tensor]:
        ap = average_precision(self.tp, self.fp, self.n_gt)  # (thresholds, classes)
        has_gt = self.n_gt > 0
        if not bool(has_gt.any()):
            nan = torch.tensor(float("nan"))
            return {f"{self.prefix}{k}": nan for k in ("map", "map50", "map75")}
        ap = ap[:, has_gt]
        out = {"map": ap.mean(), "map50": ap[0].mean(), "map75": ap[5].mean()}
        return {f"{self.prefix}{k}": v for k, v in out.items()}


def average_precision(tp: torch.Tensor, fp: torch.Tensor, n_gt: torch.Tensor) -> torch.Tensor:
    """101-point interpolated AP from score histograms (..., classes, bins), highest bin first."""
    ctp = tp.flip(-1).cumsum(-1)
    cfp = fp.flip(-1).cumsum(-1)
    recall = ctp / n_gt.clamp(min=1)[:, None]
    precision = ctp / (ctp + cfp).clamp(min=1e-12)
    # The envelope: the best precision at this recall or any higher one.
    precision = precision.flip(-1).cummax(-1).values.flip(-1)
    points = torch.linspace(0, 1, 101, dtype=recall.dtype, device=recall.device)
    flat_r = recall.reshape(-1, recall.shape[-1]).contiguous()
    flat_p = precision.reshape(-1, precision.shape[-1])
    idx = torch.searchsorted(flat_r, points.expand(len(flat_r), -1).contiguous(), side="left")
    inside = idx < flat_r.shape[-1]
    q = torch.where(
        inside, flat_p.gather(1, idx.clamp(max=flat_r.shape[-1] - 1)), torch.zeros_like(idx, dtype=flat_p.dtype)
    )
    return q.mean(-1).reshape(recall.shape[:-1])
