"""Your own images: an ImageFolder tree (one directory per class) converted once into Parquet with
``raytrain-loops convert``, then the ``cvnets_cls`` recipe trained on it at a size of your choice.

    .venv/bin/python examples/imagefolder.py --make-data my_images   # train/ and val/, 3 classes, PNG and JPEG
    raytrain-loops convert imagefolder my_images my_images.converted
    raytrain-loops train cvnets_cls task.params.data=imagefolder task.params.source=my_images.converted task.params.size=32

or all of it in one go (``--local``: one process, no Ray for the training; the conversion runs
on Ray Data either way): ``.venv/bin/python examples/imagefolder.py --data my_images --local``.
Your own tree works the same: ``my_images/train/<class>/*.jpg`` and ``my_images/val/<class>/...``,
or a single tree without ``train/`` and ``val/`` (then there is no evaluation). The source and the
converted set may each be a local path or a URI (``s3://bucket/images``).
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np

CLASSES = ("circle", "square", "stripe")


def encoded(image: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image).save(out, format=fmt)
    return out.getvalue()


def draw(label: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """One ``size`` x ``size`` RGB image of class ``label``: a shape on dark noise."""
    from PIL import Image, ImageDraw

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


def write_tree(root: Path, per_class: int, size: int, seed: int = 0) -> Path:
    """``root/<class>/<k>.png|jpg``: ``per_class`` images of each of :data:`CLASSES`, PNG and JPEG
    alternately."""
    rng = np.random.default_rng(seed)
    for label, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True, exist_ok=True)
        for k in range(per_class):
            fmt, ext = ("PNG", "png") if k % 2 == 0 else ("JPEG", "jpg")
            (root / name / f"{k:03d}.{ext}").write_bytes(encoded(draw(label, size, rng), fmt))
    return root


def make_data(root: Path, per_class: int = 100, size: int = 20) -> None:
    """An ImageFolder with ``train/`` (80% of ``per_class`` images a class) and ``val/``."""
    train = per_class * 4 // 5
    write_tree(root / "train", train, size, seed=0)
    write_tree(root / "val", per_class - train, size, seed=1)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--make-data", metavar="DIR", help="write a small ImageFolder to try it on, and stop")
    ap.add_argument("--data", metavar="DIR", help="the ImageFolder to convert and train on")
    ap.add_argument("--converted", metavar="DIR", help="where the converted set goes (default: DIR.converted)")
    ap.add_argument("--size", type=int, default=32, help="the image size the model trains at")
    ap.add_argument("--steps", type=int, default=300, help="updates to train")
    ap.add_argument("--local", action="store_true", help="train in this process (scaling.num_workers=0)")
    ap.add_argument("--storage-path", default=None, help="where the run directory goes")
    args = ap.parse_args(argv)
    if args.make_data:
        make_data(Path(args.make_data))
        return None
    from raytrain_loops import fit
    from raytrain_loops.recipes import resolve
    from raytrain_loops.tools.convert import convert

    converted = args.converted or f"{args.data.rstrip('/')}.converted"
    print(convert("imagefolder", args.data, converted).line())
    overrides = ["task.params.data=imagefolder", f"task.params.source={converted}", f"task.params.size={args.size}",
                 f"loop.max_steps={args.steps}"]  # fmt: skip
    overrides += ["scaling.num_workers=0"] if args.local else []
    overrides += [f"run.storage_path={args.storage_path}"] if args.storage_path else []
    result = fit(resolve("cvnets_cls"), overrides=overrides)
    print(f"eval accuracy {result.metrics.get('eval_accuracy', float('nan')):.3f}; run directory {result.run_dir}")
    return result


if __name__ == "__main__":
    main()
