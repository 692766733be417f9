"""What a converted set holds and what every format's scan shares: its directory layout
(``<split>/part-NNNNN.parquet`` and ``meta.json``, written last), the image columns every row
carries, an image's size and channels read from its header (no decode), the files of a source
(a local directory or a URI), and :class:`SourceError`, the bad input named before anything is
written."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

from raytrain_loops import storage
from raytrain_loops.errors import SourceError

META = "meta.json"
FORMAT = 1
"""The layout's version, in ``meta.json``; a conversion of another version is redone."""
IMAGE_COLUMNS = ("image", "width", "height", "channels", "path")
"""Every row's: the encoded bytes as the source holds them, the size and channels from the
header, and the file's path relative to the source."""
SPLIT_NAMES = {"train": "train", "val": "eval", "valid": "eval", "validation": "eval", "eval": "eval", "test": "test"}
"""A source's split directory -> the converted split (``train``, ``eval`` or ``test``)."""

# Bands as the tasks decode them: a palette image becomes RGB (RGBA with transparency).
_PALETTE = {"P": 3, "PA": 4}


class NotAnImage(ValueError):
    """A file whose header is no image format's."""


def header(raw: bytes) -> tuple[int, int, int]:
    """(width, height, channels) of an encoded image, from its header alone (PIL's ``open``
    parses the header and decodes nothing). Raises :class:`NotAnImage` for anything else."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw)) as image:
            width, height = image.size
            channels = _PALETTE.get(image.mode) or len(image.getbands())
    except UnidentifiedImageError:
        raise NotAnImage("not an image: its header is no image format's") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise NotAnImage(f"not an image: its header cannot be read ({err})") from None
    return width, height, channels


@dataclass
class Plan:
    """A source as the conversion writes it: each split's items (one per image, a dict with its
    ``path`` relative to the source and the format's fields), in the order the rows take, and
    what ``meta.json`` records of the set (``classes``, ``categories``)."""

    kind: str
    splits: dict[str, list[dict[str, Any]]]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def images(self) -> int:
        return sum(len(items) for items in self.splits.values())


def open_root(root: str) -> tuple[Any, str]:
    """(pyarrow file system, path on it) of a local directory or a URI."""
    import pyarrow.fs as pafs

    if storage.is_uri(root):
        fs, path = pafs.FileSystem.from_uri(root)
        return fs, path.rstrip("/")
    import os

    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(storage.local_path(root)))


def dirs(root: str) -> list[str]:
    """The names of the directories directly under ``root`` (local or URI), sorted as Python
    sorts strings (torchvision's order of class names); hidden ones left out."""
    return sorted(storage.name(d) for d in storage.list_dirs(_plain(root)) if not storage.name(d).startswith("."))


def _plain(root: str) -> str:
    return root if storage.is_uri(root) else storage.local_path(root)


def sub(root: str, *parts: str) -> str:
    """``root`` joined with ``parts`` (a URI keeps its query at the end)."""
    return storage.join(_plain(root), *parts)


def read_json(path: str, what: str) -> Any:
    data = storage.read_bytes(_plain(path))
    if data is None:
        raise SourceError(f"{what} {path} is not there")
    try:
        return json.loads(data)
    except json.JSONDecodeError as err:
        raise SourceError(f"{what} {path} is not JSON: {err}") from None


def read_meta(dest: str) -> dict[str, Any] | None:
    """A converted set's ``meta.json``; None when there is none (never converted, or unfinished)."""
    text = storage.read_text(sub(dest, META))
    return None if text is None else json.loads(text)


def part_name(index: int) -> str:
    return f"part-{index:05d}.parquet"
