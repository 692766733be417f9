"""Image data sets in the seeds' formats, written by the tests: an ImageFolder tree of PNG and JPEG
files (examples/imagefolder.py's), and a COCO directory (``annotations/instances_train.json`` beside ``train/``, a ``val`` split alike) whose
objects have polygons, and one ``iscrowd`` object an uncompressed RLE, as COCO's crowds do."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from examples.imagefolder import CLASSES, encoded, write_tree

__all__ = ["CLASSES", "write_coco", "write_imagefolder"]

def write_imagefolder(root: Path, per_class: int = 100, size: int = 16, seed: int = 0) -> Path:
    """``root/<class>/<k>.png|jpg``: ``per_class`` images of each of :data:`CLASSES`, PNG and JPEG
    alternately, ``size`` pixels square, drawn from ``seed`` (the example's generator)."""
    return write_tree(root, per_class, size, seed)


CATEGORIES = [{"id": 3, "name": "triangle", "supercategory": "shape"}, {"id": 7, "name": "box", "supercategory": "shape"}]


def _polygon(rng: np.random.Generator, w: int, h: int, box: bool) -> list[float]:
    x0, y0 = float(rng.uniform(0, w / 2)), float(rng.uniform(0, h / 2))
    x1, y1 = float(rng.uniform(x0 + 3, w - 0.5)), float(rng.uniform(y0 + 3, h - 0.5))
    if box:
        return [x0, y0, x1, y0, x1, y1, x0, y1]
    return [x0, y1, (x0 + x1) / 2, y0, x1, y1]


def _crowd_rle(w: int, h: int) -> dict:
    """An uncompressed RLE (column-major counts, as COCO's crowd annotations) of a block."""
    mask = np.zeros((h, w), dtype=np.uint8)
    mask[h // 4 : h // 2, w // 4 : 3 * w // 4] = 1
    flat = mask.flatten(order="F")
    counts, value, run = [], 0, 0
    for v in flat:
        if v != value:
            counts.append(run)
            value, run = v, 0
        run += 1
    counts.append(run)
    return {"size": [h, w], "counts": counts}


def write_coco(
    root: Path, images: int = 200, width: int = 20, height: int = 14, seed: int = 0, split: str = "train"
) -> Path:
    """``root/annotations/instances_<split>.json`` and ``root/<split>/<id>.png``: ``images`` images
    (``width`` x ``height``), 1-3 polygon objects each, one ``iscrowd`` object (an RLE) in the first.
    A second call with another ``split`` (``val``) and ``seed`` adds that split beside it."""
    from pycocotools import mask as mask_utils

    rng = np.random.default_rng(seed)
    (root / split).mkdir(parents=True, exist_ok=True)
    (root / "annotations").mkdir(exist_ok=True)
    data = {"images": [], "annotations": [], "categories": CATEGORIES}
    ann_id = 1
    for i in range(images):
        image_id = 1000 + 3 * i
        name = f"{image_id:06d}.png"
        pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
        (root / split / name).write_bytes(encoded(pixels, "PNG"))
        data["images"].append({"id": image_id, "file_name": name, "width": width, "height": height})
        for _ in range(int(rng.integers(1, 4))):
            cat = CATEGORIES[int(rng.integers(2))]
            poly = _polygon(rng, width, height, cat["id"] == 7)
            rle = mask_utils.frPyObjects([poly], height, width)
            bbox = [float(v) for v in mask_utils.toBbox(rle)[0]]
            area = float(mask_utils.area(rle)[0])
            data["annotations"].append(
                {"id": ann_id, "image_id": image_id, "category_id": cat["id"], "segmentation": [poly],
                 "bbox": bbox, "area": area, "iscrowd": 0}
            )  # fmt: skip
            ann_id += 1
        if i == 0:
            data["annotations"].append(
                {"id": ann_id, "image_id": image_id, "category_id": 7, "segmentation": _crowd_rle(width, height),
                 "bbox": [5.0, 3.0, 10.0, 4.0], "area": 40.0, "iscrowd": 1}
            )  # fmt: skip
            ann_id += 1
    (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(data))
    return root
