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


def exists(path: str) -> bool:
    if is_uri(path):
        import pyarrow.fs as pafs

        fs, p = pafs.FileSystem.from_uri(path)
        return fs.get_file_info(p).type != pafs.FileType.NotFound
    return os.path.exists(path)


def list_dirs(base: str) -> list[str]:
    """The directories directly under ``base`` (local or URI), as full paths; [] if none."""
    if is_uri(base):
        import pyarrow.fs as pafs

        fs, root = pafs.FileSystem.from_uri(base)
        scheme = base.split("://", 1)[0]
        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
        return [f"{scheme}://{i.path}" for i in infos if i.type == pafs.FileType.Directory]
    if not os.path.isdir(base):
        return []
    return [os.path.join(base, n) for n in os.listdir(base) if os.path.isdir(os.path.join(base, n))]
