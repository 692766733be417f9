"""Run directories on a local path or on any URI pyarrow understands."""

from __future__ import annotations

import os
from pathlib import Path


def is_uri(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def join(base: str, *parts: str) -> str:
    if is_uri(base):
        return "/".join([base.rstrip("/"), *parts])
    return str(Path(base).expanduser().resolve().joinpath(*parts))


def upload_dir(local: str, dest: str) -> None:
    """Copy the files of ``local`` into ``dest`` (a URI); a no-op when ``dest`` is ``local``."""
    if not is_uri(dest) or not os.path.isdir(local):
        return
    import pyarrow.fs as pafs

    fs, root = pafs.FileSystem.from_uri(dest)
    fs.create_dir(root, recursive=True)
    pafs.copy_files(local, root, destination_filesystem=fs)


def write_text(dest: str, text: str) -> None:
    """Write a small text file to a local path or a URI."""
    if is_uri(dest):
        import pyarrow.fs as pafs

        fs, path = pafs.FileSystem.from_uri(dest)
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(path) as f:
            f.write(text.encode())
        return
    p = Path(dest)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, p)
