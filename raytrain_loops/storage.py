"""Run directories and data on a local path or on any URI pyarrow understands."""

from __future__ import annotations

import os
import shutil
import tempfile
import urllib.parse
import uuid
from pathlib import Path


def is_uri(path: str) -> bool:
    """Whether ``path`` names an object store (``s3://``, ``gs://``, ...): a ``file://`` URI is a
    local path (:func:`local_path`)."""
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> str:
    """A ``file://`` URI (``file:///runs``, ``file://localhost/runs``) as the local path it names,
    percent-escapes decoded; any other path unchanged. A URI naming another host is refused:
    this machine cannot write there."""
    if not path.startswith("file://"):
        return path
    parts = urllib.parse.urlsplit(path)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(
            f"{path}: a file:// URI names a path on this machine (file:///path or file://localhost/path), "
            f"not on host {parts.netloc!r}"
        )
    return urllib.parse.unquote(parts.path)


def _split(uri: str) -> tuple[str, str]:
    """``s3://bucket/a?endpoint_override=host:port`` -> (``s3://bucket/a``, ``?endpoint_override=...``):
    the options pyarrow reads from the query stay at the end of every path made from it."""
    base, sep, query = uri.partition("?")
    return base, sep + query


def join(base: str, *parts: str) -> str:
    if is_uri(base):
        path, query = _split(base)
        return "/".join([path.rstrip("/"), *parts]) + query
    return str(Path(local_path(base)).expanduser().resolve().joinpath(*parts))


class StorePath(str):
    """A directory or file on an object store, as its URI, that joins like a :class:`~pathlib.Path`:
    ``StorePath("s3://b/data?endpoint_override=h:9000") / "digits" / "train.parquet"`` is
    ``s3://b/data/digits/train.parquet?endpoint_override=h:9000``. What :meth:`Task.splits
    <raytrain_loops.tasks.Task.splits>` receives for a URI ``data.dir``, so that a task written for
    a local directory (``str(data_dir / "x.parquet")``) names the object instead."""

    def __truediv__(self, part: str) -> StorePath:
        return StorePath(join(self, str(part)))

    def joinpath(self, *parts: str) -> StorePath:
        return StorePath(join(self, *map(str, parts)))

    @property
    def name(self) -> str:
        return name(self)


def name(path: str) -> str:
    """The last component of a local path or a URI (its query left out)."""
    return os.path.basename((_split(path)[0] if is_uri(path) else path).rstrip("/"))


def upload_dir(local: str, dest: str) -> None:
    """Copy the files of ``local`` into ``dest`` (a URI); a no-op when ``dest`` is ``local``."""
    if not is_uri(dest) or not os.path.isdir(local):
        return
    import pyarrow.fs as pafs

    fs, root = pafs.FileSystem.from_uri(dest)
    fs.create_dir(root, recursive=True)
    pafs.copy_files(local, root, destination_filesystem=fs)


def make_dirs(path: str) -> None:
    """Create the directory ``path`` (local or URI) with its parents; nothing when it exists.
    Raises OSError (or ValueError, for a URI pyarrow does not understand) when it cannot be."""
    if is_uri(path):
        fs, root = _fs(path)
        fs.create_dir(root, recursive=True)
        return
    Path(path).expanduser().mkdir(parents=True, exist_ok=True)


def write_text(dest: str, text: str) -> None:
    """Write a small text file to a local path or a URI."""
    write_bytes(dest, text.encode())


def exists(path: str) -> bool:
    if is_uri(path):
        import pyarrow.fs as pafs

        fs, p = pafs.FileSystem.from_uri(path)
        return fs.get_file_info(p).type != pafs.FileType.NotFound
    return os.path.exists(path)


def _entries(base: str) -> list[tuple[str, int | None]]:
    """What is directly under ``base`` (local or URI): (name, size in bytes), the size None for
    a directory; [] if ``base`` is not there."""
    if is_uri(base):
        import pyarrow.fs as pafs

        fs, root = pafs.FileSystem.from_uri(base)
        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
        return [(i.base_name, None if i.type == pafs.FileType.Directory else i.size) for i in infos]
    if not os.path.isdir(base):
        return []
    return [(e.name, None if e.is_dir() else e.stat().st_size) for e in os.scandir(base)]


def list_dirs(base: str) -> list[str]:
    """The directories directly under ``base`` (local or URI), as full paths; [] if none."""
    return [join(base, n) if is_uri(base) else os.path.join(base, n) for n, size in _entries(base) if size is None]


def file_sizes(base: str) -> dict[str, int]:
    """The files directly under ``base`` (local or URI): name -> size in bytes; {} if none."""
    return {n: size for n, size in _entries(base) if size is not None}


def truncate(path: str, length: int) -> None:
    """Keep the first ``length`` bytes of a file (local or URI); nothing if it is not longer.

    Never half done: a local file is cut in place (one system call), an object is replaced whole
    by one upload, so a crash leaves the file as it was or as cut, its first bytes always there."""
    if is_uri(path):
        import pyarrow.fs as pafs

        fs, p = _fs(path)
        info = fs.get_file_info(p)
        if info.type == pafs.FileType.File and info.size > length:  # read only a file to cut
            write_bytes(path, read_bytes(path)[:length])
        return
    if os.path.exists(path) and os.path.getsize(path) > length:
        os.truncate(path, length)


def _fs(path: str):
    import pyarrow.fs as pafs

    return pafs.FileSystem.from_uri(path)


def read_text(path: str) -> str | None:
    """A small text file's contents from a local path or a URI; None if there is none."""
    data = read_bytes(path)
    return None if data is None else data.decode()


def delete(path: str) -> None:
    """Remove a file (local or URI); nothing if it is not there."""
    if is_uri(path):
        if exists(path):
            fs, p = _fs(path)
            fs.delete_file(p)
        return
    Path(path).unlink(missing_ok=True)


def create_exclusive(path: str, text: str) -> bool:
    """Create ``path`` holding ``text`` unless it exists; whether this call created it.

    Atomic on a local file system (``O_EXCL``). An object store has no create-if-absent here:
    the file is written when absent and read back, so of two writers racing within the same
    moment both may believe they won; one that comes later is refused."""
    if is_uri(path):
        if exists(path):
            return False
        write_text(path, text)
        return read_text(path) == text
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written whole under a private name, then linked into place: the link fails when the file
    # exists, and a reader never sees the file half-written.
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    try:
        os.link(tmp, target)
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    return True


def download_dir(src: str, local: str) -> str:
    """A local directory holding the files of ``src``: ``src`` itself when it is local, else a
    copy in ``local``."""
    if not is_uri(src):
        return src
    import pyarrow.fs as pafs

    fs, root = _fs(src)
    os.makedirs(local, exist_ok=True)
    pafs.copy_files(root, local, source_filesystem=fs)
    return local


def copy_tree(src: str, dest: str) -> None:
    """Copy the files under ``src`` to ``dest`` (both local, or both on one object store): hard
    links on a local file system (no bytes copied), server-side copies on an object store."""
    if not is_uri(src):
        for root, _, files in os.walk(src):
            target = os.path.join(dest, os.path.relpath(root, src))
            os.makedirs(target, exist_ok=True)
            for f in files:
                try:
                    os.link(os.path.join(root, f), os.path.join(target, f))
                except FileExistsError:
                    pass
                except OSError:  # another device, or no hard links there
                    shutil.copy2(os.path.join(root, f), os.path.join(target, f))
        return
    import pyarrow.fs as pafs

    fs, src_root = _fs(src)
    dest_root = _fs(dest)[1]
    for info in fs.get_file_info(pafs.FileSelector(src_root, recursive=True)):
        if info.type == pafs.FileType.File:
            fs.copy_file(info.path, dest_root + info.path[len(src_root) :])


def delete_tree(path: str) -> None:
    """Remove a directory and its files (local or URI); nothing if it is not there."""
    if not is_uri(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    if exists(path):
        fs, p = _fs(path)
        fs.delete_dir(p)


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def scratch_root() -> str:
    return os.path.join(tempfile.gettempdir(), "raytrain_loops-scratch")


def scratch_dir(prefix: str) -> str:
    """A new local temporary directory for this process (``<pid>-<prefix>-...``), for files on
    their way to a remote run directory. The directories of processes that are gone (a worker
    killed before it could clean up) are removed first."""
    root = scratch_root()
    os.makedirs(root, exist_ok=True)
    for entry in os.listdir(root):
        pid = entry.split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{os.getpid()}-{prefix}-", dir=root)


def write_bytes(dest: str, data: bytes) -> None:
    """Write a file's bytes to a local path or a URI."""
    if is_uri(dest):
        fs, path = _fs(dest)
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(path) as f:
            f.write(data)
        return
    p = Path(dest)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, p)


def read_bytes(path: str) -> bytes | None:
    """A file's bytes from a local path or a URI; None if there is none."""
    if is_uri(path):
        if not exists(path):
            return None
        fs, p = _fs(path)
        with fs.open_input_stream(p) as f:
            return f.read()
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        return None
