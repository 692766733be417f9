"""An ImageFolder tree (torchvision's, DINO's and ml-cvnets' format): one directory per class,
its images anywhere below it, the class names sorted as torchvision sorts them (their index is
the label). Either the source is one such tree (the ``train`` split), or it holds split
directories (``train``, ``val``, ...; :data:`~raytrain_loops.data.formats.layout.SPLIT_NAMES`),
each one, whose classes are the train split's.

Rows: the image columns and ``label`` (int64)."""

from __future__ import annotations

from typing import Any

from raytrain_loops.data.formats import identity
from raytrain_loops.data.formats.layout import SPLIT_NAMES, Plan, SourceError, dirs, sub

KIND = "imagefolder"


def schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("image", pa.binary()),
            ("label", pa.int64()),
            ("width", pa.int32()),
            ("height", pa.int32()),
            ("channels", pa.int8()),
            ("path", pa.string()),
        ]
    )


def _tree(src: str, prefix: str, classes: list[str] | None) -> tuple[list[str], list[dict[str, Any]]]:
    """The classes of the tree ``src/prefix`` and its items (sorted by class, then path)."""
    root = sub(src, prefix) if prefix else src
    found = dirs(root)
    if not found:
        raise SourceError(f"{root} holds no class directories: an ImageFolder has one directory per class")
    unknown = sorted(set(found) - set(classes or found))
    if unknown:
        raise SourceError(f"{root}: class directories {unknown} are not among the train split's classes {classes}")
    classes = classes or found
    items = []
    for name in found:
        files = identity.stamps(sub(root, name))
        if not files:
            raise SourceError(f"class directory {sub(root, name)} holds no images")
        lead = f"{prefix}/{name}" if prefix else name
        items += [{"path": f"{lead}/{rel}", "label": classes.index(name)} for rel in files]
    return classes, items


def plan(src: str) -> Plan:
    """The splits of the ImageFolder source ``src`` (local or URI); raises :class:`SourceError`
    naming a class directory without files, or split directories beside others."""
    top = dirs(src)
    if "train" not in top or not set(top) <= set(SPLIT_NAMES):
        classes, items = _tree(src, "", None)
        return Plan(KIND, {"train": items}, {"classes": classes, "layout": {"train": ""}})
    classes, splits, layout = None, {}, {}
    for name in ["train", *(d for d in top if d != "train")]:
        split = SPLIT_NAMES[name]
        if split in splits:
            raise SourceError(f"{src}: both {layout[split]!r} and {name!r} would be the {split} split")
        classes, splits[split] = _tree(src, name, classes)
        layout[split] = name
    return Plan(KIND, splits, {"classes": classes, "layout": layout})


def row(item: dict[str, Any], size: tuple[int, int, int]) -> dict[str, Any]:
    """The row of one image beside its columns ``image`` and ``path``."""
    width, height, channels = size
    return {"label": item["label"], "width": width, "height": height, "channels": channels}
