"""The split-level box mAP against pycocotools' COCOeval, run here on the same detections built
into COCO's json form: spread, saturated, raw-logit and tied scores, in one process and over two
gloo workers with an uneven split (the same figures), and its errors. Without Ray."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from raytrain_loops.tasks.detection import MeanAveragePrecision
from tests.support.gloo import run_gloo

CLASSES = 3

# How a detector's scores may be spread: uniform; saturated near 1, all within one of 4,096
# equal bins (a trained DETR's softmax); raw logits, negative and above 1; a few values shared by
# many detections within and across images.
SCORES = {
    "spread": lambda g, n: torch.rand(n, generator=g),
    "saturated": lambda g, n: 1 - torch.rand(n, generator=g) * 2e-4,
    "logits": lambda g, n: torch.randn(n, generator=g) * 4,
    "tied": lambda g, n: torch.randint(1, 4, (n,), generator=g) / 4,
}


def _images(kind: str, count: int = 100, seed: int = 0) -> list[tuple[dict, dict]]:
    """Images of 1-4 objects of random classes, each found by a jittered box (its class right
    four times in five) among three stray ones; image ids spaced and out of order."""
    g = torch.Generator().manual_seed(seed)
    images = []
    for i in range(count):
        n = int(torch.randint(1, 5, (1,), generator=g))
        xy = torch.rand(n, 2, generator=g) * 40
        gt = torch.cat([xy, xy + 8 + torch.rand(n, 2, generator=g) * 16], 1)
        labels = torch.randint(0, CLASSES, (n,), generator=g)
        extra = torch.rand(3, 2, generator=g) * 50
        boxes = torch.cat([gt + torch.randn(n, 4, generator=g) * 1.5, torch.cat([extra, extra + 10], 1)])
        det_labels = torch.cat(
            [
                torch.where(torch.rand(n, generator=g) < 0.8, labels, (labels + 1) % CLASSES),
                torch.randint(0, CLASSES, (3,), generator=g),
            ]
        )
        pred = {"boxes": boxes, "scores": SCORES[kind](g, n + 3), "labels": det_labels}
        images.append((pred, {"boxes": gt, "labels": labels, "image_id": 1000 + 37 * ((i * 7) % count)}))
    return images


def _cocoeval(images, image_ids=None) -> np.ndarray:
    """COCOeval's AP at IoU 0.5:0.95, 0.5 and 0.75 (``stats[:3]``) of ``images``, their ids
    replaced by ``image_ids`` when given."""
    ids = image_ids or [t["image_id"] for _, t in images]

    def xywh(b):
        x1, y1, x2, y2 = b.double().tolist()
        return [x1, y1, x2 - x1, y2 - y1]

    gt = {"images": [{"id": i} for i in ids], "categories": [{"id": c} for c in range(CLASSES)], "annotations": []}
    results = []
    for image_id, (p, t) in zip(ids, images, strict=True):
        for box, label in zip(t["boxes"], t["labels"].tolist(), strict=True):
            w, h = xywh(box)[2:]
            ann = {"id": len(gt["annotations"]) + 1, "image_id": image_id, "category_id": label, "iscrowd": 0}
            gt["annotations"].append({**ann, "bbox": xywh(box), "area": w * h})
        for box, score, label in zip(p["boxes"], p["scores"].tolist(), p["labels"].tolist(), strict=True):
            results.append({"image_id": image_id, "category_id": label, "bbox": xywh(box), "score": score})
    with contextlib.redirect_stdout(io.StringIO()):
        truth = COCO()
        truth.dataset = gt
        truth.createIndex()
        ev = COCOeval(truth, truth.loadRes(results), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev.stats[:3]


def _metric(images, batch_sizes=(3, 5, 1, 7)) -> np.ndarray:
    """The metric's (map, map50, map75) of ``images`` fed in batches of the given sizes, in turn."""
    metric = MeanAveragePrecision(CLASSES)
    at, k = 0, 0
    while at < len(images):
        batch = images[at : at + batch_sizes[k % len(batch_sizes)]]
        metric.update([p for p, _ in batch], [t for _, t in batch])
        at, k = at + len(batch), k + 1
    out = metric.compute()
    return np.array([float(out[key]) for key in ("map", "map50", "map75")])


@pytest.mark.parametrize("kind", sorted(SCORES))
def test_map_equals_cocoeval_on_the_same_detections(kind):
    images = _images(kind)
    expected = _cocoeval(images)
    assert 0.2 < expected[1] < 0.9 and expected[0] < expected[1]  # neither all hits nor all misses
    np.testing.assert_allclose(_metric(images), expected, rtol=0, atol=1e-6)


def test_tied_scores_are_ranked_by_image_id_as_cocoeval_ranks_them():
    """Among tied scores the order matters: COCOeval with the image ids reversed gives other
    figures, and the metric follows the ids it is given, not the order the images came in."""
    images = _images("tied")
    reversed_ids = [t["image_id"] for _, t in images][::-1]
    expected, other = _cocoeval(images), _cocoeval(images, reversed_ids)
    assert np.abs(expected - other).max() > 1e-3
    renamed = [(p, {**t, "image_id": i}) for (p, t), i in zip(images, reversed_ids, strict=True)]
    np.testing.assert_allclose(_metric(renamed), other, rtol=0, atol=1e-6)
    np.testing.assert_allclose(_metric(images[::-1], batch_sizes=(4,)), expected, rtol=0, atol=1e-6)


def _map_on_two_workers(rank: int, world: int, kind: str):
    """An uneven split: rank 0 the last quarter of the images (the highest ids), rank 1 the rest."""
    images = _images(kind)
    ordered = sorted(images, key=lambda image: image[1]["image_id"])
    cut = 3 * len(ordered) // 4
    mine = ordered[cut:] if rank == 0 else ordered[:cut]
    return _metric(mine, batch_sizes=(2, 9) if rank == 0 else (5,)).tolist()


@pytest.mark.parametrize("kind", ["tied", "logits"])
def test_two_workers_with_an_uneven_split_give_the_one_process_figures(kind):
    images = _images(kind)
    expected = _metric(images)
    np.testing.assert_allclose(expected, _cocoeval(images), rtol=0, atol=1e-6)
    outcomes = run_gloo(2, _map_on_two_workers, kind)
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message + outcomes[1].message
    for o in outcomes:
        np.testing.assert_allclose(o.value, expected, rtol=0, atol=1e-6)


def test_the_metric_refuses_targets_without_ids_and_ids_given_twice():
    p, t = _images("spread", count=2)[0]
    metric = MeanAveragePrecision(CLASSES)
    with pytest.raises(ValueError, match=r"each target needs an 'image_id'"):
        metric.update([p], [{"boxes": t["boxes"], "labels": t["labels"]}])
    metric.update([p, p], [t, t])
    with pytest.raises(ValueError, match=r"image ids \[\d+\] were given for more than one image"):
        metric.compute()
    bad = MeanAveragePrecision(CLASSES)
    bad.update([{**p, "labels": p["labels"] + CLASSES}], [t])
    with pytest.raises(ValueError, match=r"detection labels \[.*\] are not classes in \[0, 3\)"):
        bad.compute()


def _same_image_on_both_workers(rank: int, world: int):
    p, t = _images("spread", count=1)[0]
    metric = MeanAveragePrecision(CLASSES)
    metric.update([p], [t])
    return metric.compute()


def test_an_error_on_rank_0_stops_every_worker_instead_of_leaving_them_waiting():
    outcomes = run_gloo(2, _same_image_on_both_workers)
    assert [o.error for o in outcomes] == ["ValueError", "RuntimeError"], outcomes
    assert "given for more than one image" in outcomes[0].message
    assert "the box mAP failed on rank 0: ValueError: image ids" in outcomes[1].message
