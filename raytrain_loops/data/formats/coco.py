"""A COCO directory (DETR's ``datasets/coco.py`` format): ``annotations/instances_<name>.json``
(or ``instances_<name>.json`` at the top) beside the image directory ``<name>/`` (or
``images/<name>/``). ``<name>`` gives the split: one holding ``train`` is ``train``, ``val`` is
``eval``, ``test`` is ``test``.

Rows, one per image of the JSON's ``images`` (by id): the image columns, ``image_id`` (int64),
and per annotation, in the JSON's order: ``ann_ids`` (int64), ``category_ids`` (int64, COCO's
ids; ``meta.json``'s ``categories`` lists them in order), ``boxes`` (float64, COCO's
``[x, y, w, h]`` in pixels, 4 per annotation), ``areas`` (float64), ``iscrowd`` (int8) and
``masks`` (binary: the annotation's compressed RLE counts at the image's height and width, from
its polygons or RLE as pycocotools' ``COCO.annToRLE`` makes it; empty for an annotation without
a segmentation). :func:`decode_mask` gives the mask ``COCO.annToMask`` gives.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from raytrain_loops.data.formats import identity
from raytrain_loops.data.formats.layout import Plan, SourceError, dirs, read_json, sub

KIND = "coco"
ANNOTATIONS = re.compile(r"^instances_(.+)\.json$")


def schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("image", pa.binary()),
            ("image_id", pa.int64()),
            ("ann_ids", pa.list_(pa.int64())),
            ("category_ids", pa.list_(pa.int64())),
            ("boxes", pa.list_(pa.float64())),
            ("areas", pa.list_(pa.float64())),
            ("iscrowd", pa.list_(pa.int8())),
            ("masks", pa.list_(pa.binary())),
            ("width", pa.int32()),
            ("height", pa.int32()),
            ("channels", pa.int8()),
            ("path", pa.string()),
        ]
    )


def split_of(name: str) -> str:
    for word, split in (("train", "train"), ("val", "eval"), ("test", "test")):
        if word in name:
            return split
    return name


def _annotation_files(src: str) -> dict[str, str]:
    """``<name>`` -> the path of ``instances_<name>.json``, relative to ``src``."""
    found = {}
    for rel in identity.stamps(src):
        parts = rel.split("/")
        match = ANNOTATIONS.match(parts[-1])
        if match and (len(parts) == 1 or (len(parts) == 2 and parts[0] == "annotations")):
            found[match.group(1)] = rel
    if not found:
        raise SourceError(f"{src} holds no instances_*.json (at its top or in annotations/)")
    return found


def _image_dir(src: str, name: str) -> str:
    top = dirs(src)
    if name in top:
        return name
    if "images" in top and name in dirs(sub(src, "images")):
        return f"images/{name}"
    raise SourceError(f"{src}: instances_{name}.json has no image directory {name}/ (nor images/{name}/)")


def _check(data: dict[str, Any], where: str, files: set[str]) -> None:
    """Every annotation's image and category exist, and every image's file."""
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            raise SourceError(f"{where} has no list {key!r}")
    images = {img["id"]: img for img in data["images"]}
    categories = {c["id"] for c in data["categories"]}
    for ann in data["annotations"]:
        if ann["image_id"] not in images:
            raise SourceError(f"{where}: annotation {ann['id']} refers to image id {ann['image_id']}, not in 'images'")
        if ann["category_id"] not in categories:
            raise SourceError(
                f"{where}: annotation {ann['id']} has category id {ann['category_id']}, not in 'categories' "
                f"{sorted(categories)}"
            )
    for img in data["images"]:
        if img["file_name"] not in files:
            anns = [a["id"] for a in data["annotations"] if a["image_id"] == img["id"]]
            raise SourceError(
                f"{where}: image {img['id']} ({img['file_name']}, annotations {anns[:5]}) is missing from its image directory"
            )


def plan(src: str) -> Plan:
    """The splits of the COCO source ``src`` (local or URI); raises :class:`SourceError` naming
    an annotation whose image or category is not there, or an image file that is missing."""
    splits, names, categories = {}, {}, None
    for name, rel in sorted(_annotation_files(src).items()):
        split = split_of(name)
        if split in splits:
            raise SourceError(f"{src}: instances_{names[split]}.json and instances_{name}.json are both the {split} split")
        folder = _image_dir(src, name)
        data = read_json(sub(src, *rel.split("/")), "annotation file")
        _check(data, rel, set(identity.stamps(sub(src, *folder.split("/")))))
        cats = sorted(data["categories"], key=lambda c: c["id"])
        if categories is not None and [c["id"] for c in cats] != [c["id"] for c in categories]:
            raise SourceError(f"{rel}: its categories differ from instances_{names['train']}.json's")
        categories, names[split] = cats, name
        by_image: dict[int, list] = {}
        for ann in data["annotations"]:
            by_image.setdefault(ann["image_id"], []).append(ann)
        splits[split] = [
            {"path": f"{folder}/{img['file_name']}", "image_id": img["id"], "width": img["width"],
             "height": img["height"], "anns": by_image.get(img["id"], [])}
            for img in sorted(data["images"], key=lambda img: img["id"])
        ]  # fmt: skip
    meta = {"categories": [{k: c.get(k) for k in ("id", "name", "supercategory")} for c in categories]}
    return Plan(KIND, splits, {**meta, "layout": names})


def rle(segmentation: Any, height: int, width: int) -> bytes:
    """An annotation's segmentation (polygons, or RLE compressed or not) as compressed RLE
    counts at ``height`` x ``width``, as pycocotools' ``COCO.annToRLE`` makes it."""
    from pycocotools import mask as mask_utils

    if not segmentation:
        return b""
    if isinstance(segmentation, list):
        out = mask_utils.merge(mask_utils.frPyObjects(segmentation, height, width))
    elif isinstance(segmentation["counts"], list):
        out = mask_utils.frPyObjects(segmentation, height, width)
    else:
        out = segmentation
    counts = out["counts"]
    return counts.encode() if isinstance(counts, str) else bytes(counts)


def decode_mask(counts: bytes, height: int, width: int) -> np.ndarray:
    """A ``masks`` cell as the (height, width) uint8 mask ``COCO.annToMask`` gives (zeros when empty)."""
    from pycocotools import mask as mask_utils

    if not counts:
        return np.zeros((height, width), dtype=np.uint8)
    return mask_utils.decode({"size": [height, width], "counts": counts})


def row(item: dict[str, Any], size: tuple[int, int, int]) -> dict[str, Any]:
    """The row of one image beside its columns ``image`` and ``path``; raises ValueError when
    the header's size is not the annotation file's."""
    width, height, channels = size
    if (width, height) != (item["width"], item["height"]):
        raise ValueError(f"its header says {width}x{height}, the annotation file {item['width']}x{item['height']}")
    anns = item["anns"]
    return {
        "image_id": item["image_id"],
        "ann_ids": [a["id"] for a in anns],
        "category_ids": [a["category_id"] for a in anns],
        "boxes": [float(v) for a in anns for v in a["bbox"]],
        "areas": [float(a.get("area", 0.0)) for a in anns],
        "iscrowd": [int(a.get("iscrowd", 0)) for a in anns],
        "masks": [rle(a.get("segmentation"), height, width) for a in anns],
        "width": width,
        "height": height,
        "channels": channels,
    }
