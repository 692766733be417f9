"""Image data sets in the seeds' formats, written by the tests: an ImageFolder tree of PNG and JPEG
files, and a COCO directory (``annotations/instances_train.json`` beside ``train/``) whose
objects have polygons, and one ``iscrowd`` object an uncompressed RLE, as COCO's crowds do."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

CLASSES = ("circle", "square", "stripe")


def encoded(image: np.ndarray, fmt: str) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, format=fmt)
    return out.getvalue()


def _draw(label: int, size: int, rng: np.random.Generator) -> np.ndarray:
    image = Image.fromarray(rng.integers(0, 60, (size, size, 3), dtype=np.uint8))
    pen = ImageDraw.Draw(image)
    lo, hi = int(rng.integers(1, size // 3)), int(rng.integers(2 * size // 3, size - 1))
    colour = tuple(int(c) for c in rng.integers(150, 256, 3))
    if label == 0:
        pen.ellipse((lo, lo, hi, hi), fill=colour)
    elif label == 1:
        pen.rectangle((lo, lo, hi, hi), fill=colour)
    else:
        pen.rectangle((0, lo, size - 1, lo + 2), fill=colour)
    return np.asarray(image)


def write_imagefolder(root: Path, per_class: int = 100, size: int = 16, seed: int = 0) -> Path:
    """``root/<class>/<k>.png|jpg``: ``per_class`` images of each of :data:`CLASSES`, PNG and JPEG
    alternately, ``size`` pixels square, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    for label, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True, exist_ok=True)
        for k in range(per_class):
            fmt, ext = ("PNG", "png") if k % 2 == 0 else ("JPEG", "jpg")
            (root / name / f"{k:03d}.{ext}").write_bytes(encoded(_draw(label, size, rng), fmt))
    return root


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


def write_coco(root: Path, images: int = 200, width: int = 20, height: int = 14, seed: int = 0) -> Path:
    """``root/annotations/instances_train.json`` and ``root/train/<id>.png``: ``images`` images
    (``width`` x ``height``), 1-3 polygon objects each, one ``iscrowd`` object (an RLE) in the first."""
    from pycocotools import mask as mask_utils

    rng = np.random.default_rng(seed)
    (root / "train").mkdir(parents=True, exist_ok=True)
    (root / "annotations").mkdir(exist_ok=True)
    data = {"images": [], "annotations": [], "categories": CATEGORIES}
    ann_id = 1
    for i in range(images):
        image_id = 1000 + 3 * i
        name = f"{image_id:06d}.png"
        pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
        (root / "train" / name).write_bytes(encoded(pixels, "PNG"))
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
    (root / "annotations" / "instances_train.json").write_text(json.dumps(data))
    return root
