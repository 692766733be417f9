"""A data set's identity: which files it holds, how large each is, and how many rows each Parquet
file holds, on a local path or a URI pyarrow opens.

Two uses, kept apart on purpose:

- :func:`identity` / :func:`digest`: what a run's weights depend on. Paths, sizes and Parquet row
  counts only, so a bundled set regenerated identically (new modification times) keeps its
  identity. ``raytrain-loops convert`` records it in the ``meta.json`` it writes; it is meant as
  the default of :meth:`Task.data_digest <raytrain_loops.tasks.Task.data_digest>`.
- :func:`stamps` with ``mtimes=True``: the quick check that nothing changed since a listing was
  taken (a staging directory's uploads, a conversion's source), without reading any file. Never
  part of a run's identity.

Hidden files and directories (a name starting with ``.``) and files still being written (a
``.tmp`` in a name) belong to no data set.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from raytrain_loops import storage


def _kept(rel: str) -> bool:
    return not any(part.startswith(".") or ".tmp" in part for part in rel.split("/"))


def stamps(root: str, mtimes: bool = False) -> dict[str, list[int]]:
    """Every file under ``root`` (a local directory or a URI), sorted: path relative to it (``/``
    separated) -> ``[size]``, or ``[size, mtime_ns]`` with ``mtimes``; {} when ``root`` is not
    there. A file ``root`` is listed under its own name."""
    if storage.is_uri(root):
        return _store_stamps(root, mtimes)
    root = os.path.expanduser(storage.local_path(root))
    if os.path.isfile(root):
        st = os.stat(root)
        return {os.path.basename(root): [st.st_size, st.st_mtime_ns] if mtimes else [st.st_size]}
    out = {}
    for base, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if _kept(d)]
        for name in files:
            path = os.path.join(base, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if _kept(rel) and os.path.isfile(path):
                st = os.stat(path)
                out[rel] = [st.st_size, st.st_mtime_ns] if mtimes else [st.st_size]
    return dict(sorted(out.items()))


def _store_stamps(uri: str, mtimes: bool) -> dict[str, list[int]]:
    import pyarrow.fs as pafs

    fs, root = pafs.FileSystem.from_uri(uri)
    root = root.rstrip("/")
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.File:
        infos, prefix = [info], root.rsplit("/", 1)[0] + "/"
    else:
        infos, prefix = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True)), root + "/"
    out = {}
    for i in infos:
        rel = i.path[len(prefix) :]
        if i.type == pafs.FileType.File and _kept(rel):
            mtime = i.mtime_ns if i.mtime_ns is not None else 0
            out[rel] = [i.size, mtime] if mtimes else [i.size]
    return dict(sorted(out.items()))


def parquet_rows(root: str, names: list[str]) -> dict[str, int]:
    """The row count of each Parquet file ``names`` (relative to ``root``), from its footer."""
    import pyarrow.parquet as pq

    out = {}
    for rel in names:
        path = storage.join(root, *rel.split("/"))
        if storage.is_uri(path):
            import pyarrow.fs as pafs

            fs, p = pafs.FileSystem.from_uri(path)
            with fs.open_input_file(p) as f:
                out[rel] = pq.ParquetFile(f).metadata.num_rows
        else:
            out[rel] = pq.read_metadata(path).num_rows
    return out


def identity(root: str) -> dict[str, Any]:
    """What names the data under ``root`` (a local directory or a URI): every file's path and
    size, and every Parquet file's row count; no modification times. ``{"files": {rel: size},
    "rows": {rel: rows}}``."""
    local = root if storage.is_uri(root) else os.path.expanduser(storage.local_path(root))
    files = {rel: stamp[0] for rel, stamp in stamps(local).items()}
    return {"files": files, "rows": parquet_rows(local, [rel for rel in files if rel.endswith(".parquet")])}


def digest(value: dict[str, Any]) -> str:
    """A hex SHA-256 of ``value`` (an :func:`identity`, a :func:`stamps` listing) as sorted JSON."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
