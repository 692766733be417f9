"""A converted set as the vision tasks read it (:class:`ConvertedSet`), and the seeds' image
augmentations on decoded images (PIL), each draw from a row's own generator
(``np.random.default_rng(row_seed)``), so a row gets the same views in an epoch whatever the
group size or a resume:

- torchvision's ``RandomResizedCrop`` (ml-cvnets' and DINO's), the horizontal flip, and the
  evaluation's resize and centre crop;
- DINO's colour jitter, grayscale, Gaussian blur and solarisation (``DataAugmentationDINO``).

Images leave :func:`chw` as (C, H, W) uint8: the channels-first layout a CNN takes, made here
on the preprocessing CPUs rather than on the training worker.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

from raytrain_loops import storage
from raytrain_loops.config import ConfigError
from raytrain_loops.data.formats.layout import read_meta


class ConvertedSet:
    """The output of ``raytrain-loops convert`` at ``source`` (a local path or a URI), of format
    ``kind``; errors name ``task.params.source``."""

    def __init__(self, source: str, kind: str):
        if not source:
            raise ConfigError("task.params.source", f"names the converted {kind} set (raytrain-loops convert {kind} ...)")
        self.source, self.kind = source if storage.is_uri(source) else storage.join(source), kind
        self._meta: dict[str, Any] | None = None

    @property
    def meta(self) -> dict[str, Any]:
        if self._meta is None:
            meta = read_meta(self.source)
            if meta is None:
                raise ConfigError(
                    "task.params.source",
                    f"{self.source} holds no meta.json: convert the data first "
                    f"(raytrain-loops convert {self.kind} SOURCE {self.source})",
                )
            if meta.get("options", {}).get("format") != self.kind:
                raise ConfigError("task.params.source", f"{self.source} holds a {meta['options']['format']} set, not {self.kind}")
            self._meta = meta
        return self._meta

    @property
    def channels(self) -> int:
        """1 when every image is single-channel, else 3 (alpha left out)."""
        return 1 if self.meta["channels"] == [1] else 3

    @property
    def digest(self) -> str:
        """The set's identity as ``convert`` recorded it (paths, sizes, row counts): what a run
        on it pins (``Task.data_digest``)."""
        return self.meta["digest"]

    def split(self, name: str) -> str | None:
        """The directory of split ``name`` (``train``, ``eval``), or None when the set has none."""
        return storage.join(self.source, name) if self.meta["splits"].get(name) else None


def decode(raw: bytes, channels: int):
    """An encoded image as a PIL image of ``channels`` (1: ``L``, 3: ``RGB``)."""
    from PIL import Image

    image = Image.open(io.BytesIO(raw))
    return image.convert("L" if channels == 1 else "RGB")


def random_resized_crop(image, size: int, scale: tuple[float, float], rng: np.random.Generator, ratio=(3 / 4, 4 / 3)):
    """torchvision's ``RandomResizedCrop``: a crop of a random area fraction in ``scale`` and
    aspect ratio in ``ratio`` (10 tries, then the centre crop of the nearest ratio), resized to
    ``size`` x ``size`` (bilinear)."""
    from PIL import Image

    width, height = image.size
    area = width * height
    box = None
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            x, y = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            box = (x, y, x + w, y + h)
            break
    if box is None:
        w, h = width, height
        if width / height < ratio[0]:
            h = round(width / ratio[0])
        elif width / height > ratio[1]:
            w = round(height * ratio[1])
        x, y = (width - w) // 2, (height - h) // 2
        box = (x, y, x + w, y + h)
    return image.resize((size, size), Image.BILINEAR, box=box)


def flip(image, rng: np.random.Generator, p: float = 0.5):
    from PIL import Image

    return image.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < p else image


def center_crop(image, size: int, crop_ratio: float = 0.875):
    """The evaluation's view: the shorter side resized to ``size / crop_ratio``, the centre
    ``size`` x ``size`` cut out."""
    from PIL import Image

    width, height = image.size
    short = max(size, round(size / crop_ratio))
    w, h = (short, max(size, round(height * short / width))) if width <= height else (max(size, round(width * short / height)), short)
    image = image.resize((w, h), Image.BILINEAR)
    x, y = (w - size) // 2, (h - size) // 2
    return image.crop((x, y, x + size, y + size))


def colour_jitter(image, rng: np.random.Generator, p: float = 0.8, strength=(0.4, 0.4, 0.2, 0.1), grey_p: float = 0.2):
    """DINO's ``ColorJitter(0.4, 0.4, 0.2, 0.1)`` with probability ``p`` (brightness, contrast,
    saturation, hue, in a random order), then ``RandomGrayscale(grey_p)``; RGB images only."""
    from PIL import Image, ImageEnhance

    if image.mode != "RGB":
        return image
    if rng.random() < p:
        for k in rng.permutation(4):
            if k == 3:
                hsv = np.asarray(image.convert("HSV")).copy()
                hsv[..., 0] = (hsv[..., 0].astype(np.int16) + round(rng.uniform(-1, 1) * strength[3] * 255)) % 256
                image = Image.fromarray(hsv, "HSV").convert("RGB")
            else:
                enhance = (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color)[k]
                image = enhance(image).enhance(rng.uniform(1 - strength[k], 1 + strength[k]))
    if rng.random() < grey_p:
        image = image.convert("L").convert("RGB")
    return image


def blur(image, rng: np.random.Generator, p: float, radius=(0.1, 2.0)):
    """DINO's ``GaussianBlur``: with probability ``p``, a radius drawn in ``radius``."""
    from PIL import ImageFilter

    return image.filter(ImageFilter.GaussianBlur(rng.uniform(*radius))) if rng.random() < p else image


def solarize(image, rng: np.random.Generator, p: float):
    from PIL import ImageOps

    return ImageOps.solarize(image, 128) if rng.random() < p else image


def chw(image) -> np.ndarray:
    """A PIL image as (C, H, W) uint8."""
    array = np.asarray(image)
    return (array[None] if array.ndim == 2 else array.transpose(2, 0, 1)).copy()


def multi_crop(image, rng: np.random.Generator, size: int, local_size: int, local_crops: int, global_scale, local_scale):
    """DINO's ``DataAugmentationDINO`` views of one image: 2 global crops of ``size`` (flip,
    colour jitter; the first always blurred, the second blurred a tenth of the time and solarised
    a fifth) and ``local_crops`` crops of ``local_size`` (flip, jitter, blurred half of the time).
    Returns (globals (2, C, size, size), locals (local_crops, C, local_size, local_size)) uint8."""

    def view(crop: int, scale, blur_p: float, solarize_p: float = 0.0):
        out = colour_jitter(flip(random_resized_crop(image, crop, scale, rng), rng), rng)
        return chw(solarize(blur(out, rng, blur_p), rng, solarize_p))

    globals_ = np.stack([view(size, global_scale, 1.0), view(size, global_scale, 0.1, 0.2)])
    channels = globals_.shape[1]
    locals_ = [view(local_size, local_scale, 0.5) for _ in range(local_crops)]
    return globals_, np.stack(locals_) if locals_ else np.zeros((0, channels, local_size, local_size), np.uint8)


def coco_view(image, xyxy: np.ndarray, size: int, train: bool, rng: np.random.Generator):
    """DETR's view of a detection image and its boxes (``xyxy`` in pixels), at most ``size``
    pixels a side: training, a flip, a random resize (the longer side to 0.75 to 1.25 of
    ``size``) and a random crop of ``size`` x ``size`` with the boxes clipped to it; evaluation,
    the longer side resized to ``size``. Returns the (C, H, W) uint8 image and the boxes."""
    from PIL import Image

    width, height = image.size
    boxes = np.asarray(xyxy, dtype=np.float64).reshape(-1, 4).copy()
    if train and rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
        boxes[:, [0, 2]] = width - boxes[:, [2, 0]]
    scale = size / max(width, height) * (rng.uniform(0.75, 1.25) if train else 1.0)
    w, h = max(1, round(width * scale)), max(1, round(height * scale))
    image, boxes = image.resize((w, h), Image.BILINEAR), boxes * [w / width, h / height, w / width, h / height]
    x, y = (int(rng.integers(0, w - size + 1)) if w > size else 0), (int(rng.integers(0, h - size + 1)) if h > size else 0)
    image = image.crop((x, y, min(w, x + size), min(h, y + size)))
    boxes = boxes - [x, y, x, y]
    boxes = np.clip(boxes, 0, [image.size[0], image.size[1], image.size[0], image.size[1]])
    return chw(image), boxes
