"""``shapes``: a seeded synthetic detection and instance-segmentation data set, written once to Parquet.

Each image (``size`` x ``size`` RGB, uint8; or ``size`` high and one of ``widths`` wide, drawn
per image, when ``widths`` is given) has a noisy background of a random colour and 1 to
``max_objects`` objects of :data:`CLASSES`, of random size, position and colour, placed so that
their boxes do not overlap (every object is fully visible, so its mask is its drawn shape). Per
object: the class, the box ``(cx, cy, w, h)`` normalised to [0, 1] by the image's width and
height (the tight box of its mask), and the instance mask.

Parquet columns (ragged targets as list columns): ``image`` (binary, ``size*width*3`` bytes, HWC:
an image's width is its byte length over ``3*size``), ``labels`` (list<int64>), ``boxes``
(list<float32>, 4 per object), ``masks`` (list<binary>, one ``np.packbits`` of the
``size*width`` mask per object). Splits ``train`` and ``validation`` are
drawn from distinct seeds. The directory is keyed by every parameter, and each file is written
under a temporary name and renamed; ``meta.json`` is written last, as the mark of a complete set.
Detection (DETR) and segmentation (seamseg) tasks read the same files.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from raytrain_loops.storage import StorePath

CLASSES = ("rectangle", "ellipse", "triangle")
COLUMNS = ["image", "labels", "boxes", "masks"]
SPLITS = ("train", "validation")
FORMAT = 1  # bump when the drawing or the layout changes: a new cache directory


@dataclass(frozen=True)
class ShapesSpec:
    """What the generated set depends on (the cache key)."""

    train_images: int = 4096
    validation_images: int = 512
    size: int = 64
    min_objects: int = 1
    max_objects: int = 4
    min_extent: int = 10
    max_extent: int = 24
    noise: float = 12.0
    seed: int = 0
    widths: tuple[int, ...] = ()
    """Image widths, one drawn per image; empty: square images (``size`` wide), drawn exactly as
    before this option existed (the same random draws, the same files, the same cache key)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(self.widths))  # a YAML list; hashable like the rest
        for key in ("train_images", "validation_images", "size", "min_objects", "min_extent"):
            if getattr(self, key) < 1:
                raise ValueError(f"task.params.{key} must be >= 1; got {getattr(self, key)}")
        if self.max_objects < self.min_objects:
            raise ValueError(f"task.params.max_objects={self.max_objects} is below min_objects={self.min_objects}")
        if not 3 <= self.min_extent <= self.max_extent <= self.size:
            raise ValueError(
                f"task.params.min_extent={self.min_extent} and max_extent={self.max_extent} must satisfy "
                f"3 <= min_extent <= max_extent <= size={self.size}"
            )
        if any(not isinstance(w, int) or w < self.max_extent for w in self.widths):
            raise ValueError(
                f"task.params.widths must be integers >= max_extent={self.max_extent}; got {list(self.widths)}"
            )

    def key(self) -> dict:
        """The parameters that name the set; ``widths`` only when given, so the square sets
        written before it existed keep their directories."""
        out = asdict(self)
        if not self.widths:
            del out["widths"]
        else:
            out["widths"] = list(self.widths)
        return out

    def directory(self, data_dir: Path | StorePath) -> Path | StorePath:
        """The set's directory under ``data_dir``: a local one, or a URI's (``data.dir`` on a store)."""
        key = json.dumps([FORMAT, self.key()], sort_keys=True)
        base = data_dir if isinstance(data_dir, StorePath) else Path(data_dir)
        return base / "shapes" / hashlib.sha256(key.encode()).hexdigest()[:12]


def _mask(kind: int, h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """The filled shape of class ``kind`` in an ``h`` x ``w`` box (touching all four sides)."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    if kind == 0:
        return np.ones((h, w), dtype=bool)
    if kind == 1:
        return ((xx + 0.5 - w / 2) / (w / 2)) ** 2 + ((yy + 0.5 - h / 2) / (h / 2)) ** 2 <= 1.0
    # A triangle with its base on the bottom row and its apex somewhere on the top row.
    apex = rng.uniform(0, w)
    t = (yy + 0.5) / h  # 0 at the top, 1 at the bottom
    left, right = apex * (1 - t), apex + (w - apex) * t
    return (xx + 0.5 >= left - 0.5) & (xx + 0.5 <= right + 0.5)


def _overlaps(a: tuple[int, int, int, int], b: tuple[int, int, int, int], gap: int = 1) -> bool:
    return not (a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1])


def draw(spec: ShapesSpec, rng: np.random.Generator) -> tuple[np.ndarray, list[int], np.ndarray, list[np.ndarray]]:
    """One image (size, width, 3) uint8, its labels, boxes (n, 4) cxcywh normalised and masks."""
    s = spec.size
    # No draw for square sets: their random stream, hence their images, stay as they were.
    width = int(spec.widths[rng.integers(len(spec.widths))]) if spec.widths else s
    background = rng.uniform(40, 215, size=3)
    image = background + rng.normal(0, spec.noise, size=(s, width, 3))
    wanted = int(rng.integers(spec.min_objects, spec.max_objects + 1))
    placed: list[tuple[int, int, int, int]] = []
    labels, boxes, masks = [], [], []
    for _ in range(50 * wanted):
        if len(placed) == wanted:
            break
        h, w = (int(v) for v in rng.integers(spec.min_extent, spec.max_extent + 1, size=2))
        y0, x0 = int(rng.integers(0, s - h + 1)), int(rng.integers(0, width - w + 1))
        box = (x0, y0, x0 + w, y0 + h)
        if any(_overlaps(box, other) for other in placed):
            continue
        kind = int(rng.integers(len(CLASSES)))
        shape = _mask(kind, h, w, rng)
        # A colour far from the background in at least one channel, so every object is visible.
        colour = rng.uniform(0, 255, size=3)
        while np.abs(colour - background).max() < 80:
            colour = rng.uniform(0, 255, size=3)
        full = np.zeros((s, width), dtype=bool)
        full[y0 : y0 + h, x0 : x0 + w] = shape
        image[full] = colour + rng.normal(0, spec.noise / 2, size=(int(full.sum()), 3))
        ys, xs = np.nonzero(full)
        x1, y1, x2, y2 = xs.min(), ys.min(), xs.max() + 1, ys.max() + 1
        placed.append(box)
        labels.append(kind)
        boxes.append([(x1 + x2) / 2 / width, (y1 + y2) / 2 / s, (x2 - x1) / width, (y2 - y1) / s])
        masks.append(full)
    return np.clip(image, 0, 255).astype(np.uint8), labels, np.asarray(boxes, dtype=np.float32), masks


def _table(spec: ShapesSpec, n: int, seed: int):
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    images, labels, boxes, masks = [], [], [], []
    for _ in range(n):
        image, lab, box, mask = draw(spec, rng)
        images.append(image.tobytes())
        labels.append(lab)
        boxes.append(box.reshape(-1).tolist())
        masks.append([np.packbits(m.reshape(-1)).tobytes() for m in mask])
    return pa.table(
        {
            "image": pa.array(images, pa.binary()),
            "labels": pa.array(labels, pa.list_(pa.int64())),
            "boxes": pa.array(boxes, pa.list_(pa.float32())),
            "masks": pa.array(masks, pa.list_(pa.binary())),
        }
    )


def write_shapes(data_dir: Path, spec: ShapesSpec) -> dict[str, Path]:
    """Generate and write both splits once (idempotent, atomic per file); their paths."""
    import pyarrow.parquet as pq

    out = spec.directory(data_dir)
    paths = {split: out / f"{split}.parquet" for split in SPLITS}
    meta = out / "meta.json"
    if meta.exists() and all(p.exists() for p in paths.values()):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    sizes = {"train": spec.train_images, "validation": spec.validation_images}
    for i, split in enumerate(SPLITS):
        # Distinct streams per split: the validation images are not a prefix of the training ones.
        table = _table(spec, sizes[split], int(np.random.SeedSequence([spec.seed, i]).generate_state(1)[0]))
        tmp = out / f"{split}.parquet.tmp{os.getpid()}"
        pq.write_table(table, tmp)
        os.replace(tmp, paths[split])
    tmp = out / f"meta.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"format": FORMAT, "classes": list(CLASSES), **spec.key()}, indent=1) + "\n")
    os.replace(tmp, meta)
    return paths


def decode_image(raw: bytes, size: int) -> np.ndarray:
    """An ``image`` cell as (size, width, 3) uint8 (the width follows from its length)."""
    return np.frombuffer(raw, dtype=np.uint8).reshape(size, -1, 3)


def decode_masks(cells, size: int, width: int | None = None) -> np.ndarray:
    """A ``masks`` cell as (n, size, width) bool (``width`` defaults to ``size``)."""
    width = width or size
    return (
        np.stack(
            [np.unpackbits(np.frombuffer(c, dtype=np.uint8))[: size * width].reshape(size, width) for c in cells]
        ).astype(bool)
        if len(cells)
        else np.zeros((0, size, width), dtype=bool)
    )
