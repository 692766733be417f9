"""``patterns``: a seeded synthetic image-classification set stored as encoded PNG images, large
enough to stream (several GB), written once to Parquet.

Each image is ``size`` x ``size`` RGB: a background of a random two-colour gradient under Gaussian
noise, and one shape of :data:`CLASSES` (5 kinds, each filled or drawn as an outline: 10 classes)
of random size, position, rotation and colour, kept inside the central region so that a random
crop of ``size - 8`` pixels keeps it whole. The noise makes each PNG about 11 KB at 64 x 64.

Columns: ``image`` (binary: the PNG bytes), ``label`` (int64). Each split is a directory of files
of :data:`ROWS_PER_FILE` rows in row groups of :data:`ROW_GROUP_ROWS` rows (the unit the Parquet
path deals out; see ``data/parquet.py``); file ``k`` of a split is drawn from the seed
(``seed``, split, ``k``) alone, so the files are written by a pool of processes in any order and
are the same on every machine. A file is written under a temporary name and renamed;
``meta.json`` is written last, as the mark of a complete set.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from raytrain_loops.storage import StorePath

KINDS = ("rectangle", "ellipse", "triangle", "cross", "diamond")
CLASSES = tuple(f"{kind} {style}" for kind in KINDS for style in ("filled", "outline"))
ROWS_PER_FILE = 8192
ROW_GROUP_ROWS = 128
SPLITS = ("train", "eval")
FORMAT = 1  # bump when the drawing or the layout changes: a new cache directory


@dataclass(frozen=True)
class PatternsSpec:
    """What the generated set depends on (the cache key)."""

    train_images: int = 409_600
    eval_images: int = 8192
    size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("train_images", "eval_images"):
            if getattr(self, key) < 1:
                raise ValueError(f"task.params.{key} must be >= 1; got {getattr(self, key)}")
        if self.size < 32:
            raise ValueError(f"task.params.size must be >= 32; got {self.size}")

    def directory(self, data_dir: Path | StorePath) -> Path | StorePath:
        """The set's directory under ``data_dir``: a local one, or a URI's (``data.dir`` on a store)."""
        digest = hashlib.sha256(json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True).encode()).hexdigest()
        return data_dir / f"patterns-{digest[:10]}"


def _polygon(kind: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    if kind == "triangle":
        corners = [0.0, 2 * np.pi / 3, 4 * np.pi / 3]
        radii = [r] * 3
    elif kind == "diamond":
        corners = [0.0, np.pi / 2, np.pi, 3 * np.pi / 2]
        radii = [r, 0.55 * r, r, 0.55 * r]
    else:  # cross: 12 corners of a plus sign
        t, corners, radii = 0.35, [], []
        for k in range(4):
            base = k * np.pi / 2
            for da, rr in ((-np.arctan(t), r), (np.arctan(t), r), (np.pi / 4, t * r * np.sqrt(2))):
                corners.append(base + da)
                radii.append(np.hypot(r, t * r) if rr == r else rr)
    return [(cx + rr * np.cos(a + angle), cy + rr * np.sin(a + angle)) for a, rr in zip(corners, radii, strict=True)]


def draw(label: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """One image of class ``label`` (HWC uint8)."""
    from PIL import Image, ImageDraw

    ramp = np.linspace(0.0, 1.0, size, dtype=np.float32)
    direction = rng.uniform(0, 2 * np.pi)
    t = np.clip(0.5 + (ramp[None, :] - 0.5) * np.cos(direction) + (ramp[:, None] - 0.5) * np.sin(direction), 0, 1)
    a, b = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    background = a + t[..., None] * (b - a)
    image = Image.fromarray(np.clip(background + rng.normal(0, 20, (size, size, 3)), 0, 255).astype(np.uint8))
    kind, outline = KINDS[label // 2], label % 2 == 1
    margin = 8 + 1  # any crop of size - 8 keeps the shape whole
    high = min(0.3 * size, size / 2 - margin)
    r = rng.uniform(min(0.14 * size, high), high)
    cx, cy = rng.uniform(margin + r, size - margin - r, 2)
    colour = tuple(
        int(c) for c in np.where(background.mean((0, 1)) > 127, rng.uniform(0, 90, 3), rng.uniform(165, 255, 3))
    )
    pen = ImageDraw.Draw(image)
    fill, line = (None, colour) if outline else (colour, None)
    width = max(2, size // 24)
    if kind == "rectangle":
        w, h = r, r * rng.uniform(0.55, 1.0)
        pen.rectangle((cx - w, cy - h, cx + w, cy + h), fill=fill, outline=line, width=width)
    elif kind == "ellipse":
        w, h = r, r * rng.uniform(0.55, 1.0)
        pen.ellipse((cx - w, cy - h, cx + w, cy + h), fill=fill, outline=line, width=width)
    else:
        pen.polygon(_polygon(kind, cx, cy, r, rng.uniform(0, 2 * np.pi)), fill=fill, outline=line, width=width)
    return np.asarray(image)


def png(image: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG", compress_level=1)
    return out.getvalue()


def _write_file(out: Path, split: int, index: int, rows: int, spec: PatternsSpec) -> int:
    """File ``index`` of split ``split`` (0 train, 1 eval), drawn from (seed, split, index);
    returns its size in bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng([spec.seed, split, index])
    labels = rng.integers(0, len(CLASSES), rows)
    images = [png(draw(int(label), spec.size, rng)) for label in labels]
    path = out / f"part-{index:05d}.parquet"
    tmp = out / f".part-{index:05d}.parquet.tmp{os.getpid()}"
    pq.write_table(pa.table({"image": images, "label": labels}), tmp, row_group_size=ROW_GROUP_ROWS)
    os.replace(tmp, path)
    return path.stat().st_size


def write_patterns(data_dir: Path, spec: PatternsSpec, processes: int | None = None) -> dict[str, Path]:
    """Write the set once under ``data_dir`` (a process per CPU, a progress bar on stderr); the
    split directories, ``train`` and ``eval``."""
    from tqdm import tqdm

    out = spec.directory(data_dir)
    paths = {name: out / name for name in SPLITS}
    meta = out / "meta.json"
    if meta.exists():
        return paths
    jobs = []
    for s, name in enumerate(SPLITS):
        paths[name].mkdir(parents=True, exist_ok=True)
        total = spec.train_images if name == "train" else spec.eval_images
        for k, start in enumerate(range(0, total, ROWS_PER_FILE)):
            if not (paths[name] / f"part-{k:05d}.parquet").exists():  # kept from an interrupted run
                jobs.append((paths[name], s, k, min(ROWS_PER_FILE, total - start)))
    with ProcessPoolExecutor(processes or os.cpu_count() or 1) as pool:
        futures = [pool.submit(_write_file, path, split, k, rows, spec) for path, split, k, rows in jobs]
        with tqdm(total=sum(j[3] for j in jobs), unit="img", desc=f"writing {out.name}", disable=not jobs) as bar:
            for job, future in zip(jobs, futures, strict=True):
                future.result()  # in order: an error names its file through the traceback
                bar.update(job[3])
    tmp = out / f"meta.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"format": FORMAT, "classes": list(CLASSES), **asdict(spec)}, indent=1) + "\n")
    os.replace(tmp, meta)
    return paths
