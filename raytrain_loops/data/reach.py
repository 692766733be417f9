"""Whether a node can open the data it will read, checked where the work lands: on every alive
node by the driver before a run starts, and by every worker at the start of each attempt (a
cluster that scales from zero adds the nodes then). One small read per split: the footer of a
streamed Parquet split's first file, the first row of a map-style split; a split held in Ray's
object store is read by no node and not checked. Ray-free: the driver's part runs it in Ray tasks.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from raytrain_loops import storage

Target = tuple[str, str, Any]
"""(split name, what is read, shown, the thing opened): ``("parquet", filesystem, file)`` or
``("map", dataset)``."""


class Unreachable(ValueError):
    """A node cannot open the data a split reads; the message names ``data.dir`` (or the split's
    own path) and the node."""


def targets(splits: dict[str, Any], held: Iterable[str] = ()) -> list[Target]:
    """What each split makes a node read, the splits named in ``held`` (read once into the
    object store) and those already held (their index's table set) left out."""
    out: list[Target] = []
    for name, split in splits.items():
        index = getattr(split, "index", None)
        if index is not None:
            if name not in held and index.table is None and index.files:
                out.append((name, split.path, ("parquet", index.filesystem, index.files[0])))
        elif hasattr(getattr(split, "dataset", None), "__getitem__"):  # a map-style one (a Ray Dataset reads itself)
            dataset = split.dataset
            out.append((name, str(getattr(dataset, "path", type(dataset).__name__)), ("map", dataset)))
    return out


def open_one(opened: Any) -> None:
    """The small read of one target: a Parquet footer, or a map-style dataset's first row."""
    if opened[0] == "parquet":
        import pyarrow.parquet as pq

        _, fs, path = opened
        pq.read_metadata(path, filesystem=fs)
        return
    dataset = opened[1]
    if len(dataset):
        dataset[0]


def first_failure(found: list[Target]) -> tuple[str, str, str] | None:
    """The first target this process cannot open: (split, what, the error's type and message)."""
    for name, what, opened in found:
        try:
            open_one(opened)
        except Exception as err:  # any failure to read is what is reported
            text = str(err).strip()
            return name, what, f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
    return None


def _under(path: str, data_dir: str) -> bool:
    if storage.is_uri(data_dir):
        return path.partition("?")[0].startswith(data_dir.partition("?")[0].rstrip("/"))
    return os.path.abspath(path).startswith(str(Path(data_dir).expanduser().resolve()))


def unreachable(data_dir: str, node: str, failed: tuple[str, str, str]) -> Unreachable:
    """The error for a node that cannot open a split: naming ``data.dir`` when the split is
    under it (else the split's own path, which the task chose) and the node."""
    name, what, message = failed
    if _under(what, data_dir):
        key = f"data.dir={data_dir}"
        fix = (
            "the nodes of a cluster share no disk: put data.dir on storage every node reaches "
            "(a URI such as s3://bucket/data or gs://bucket/data; see clusters/README.md)"
        )
    else:
        key = f"split '{name}' ({what}, named by the task)"
        fix = "the task must name data every node reaches (a URI on shared storage), or data small enough to travel"
    return Unreachable(f"{key}: node {node} cannot open split '{name}' ({what}): {message}; {fix}")


def check_here(data_dir: str, splits: dict[str, Any], node: str) -> None:
    """Raise :class:`Unreachable` when this process cannot open what its splits read."""
    failed = first_failure(targets(splits))
    if failed is not None:
        raise unreachable(data_dir, node, failed)
