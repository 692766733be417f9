"""A URI ``data.dir`` met by a local staging directory: :meth:`Task.prepare
<raytrain_loops.tasks.Task.prepare>` writes into a directory on the driver's disk (kept between
runs, one per URI), and what it wrote is then uploaded to the store, only the files the store
lacks or holds in another version. Every wait on the store is bounded: a listing by
``LIST_TIMEOUT_S``, an upload by ``STALL_S`` without progress.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from raytrain_loops.data.formats import identity
from raytrain_loops.errors import UploadError

STAGING_ROOT = "~/.cache/raytrain_loops/staging"
RECORD = ".uploaded.json"
"""In a staging directory: relative path -> [size, mtime_ns] of each file as it was uploaded."""
LIST_TIMEOUT_S = 60.0
STALL_S = 120.0
CHUNK = 8 << 20
PROGRESS_BYTES = 64 << 20
"""Uploads of at least this many bytes in all print their progress (every ``PROGRESS_EVERY_S``)."""
PROGRESS_EVERY_S = 10.0

T = TypeVar("T")


def staging_dir(uri: str, root: str | None = None) -> Path:
    """The local directory where tasks prepare the data of ``uri`` (made, with a ``uri.txt``
    naming it): one per URI, kept between runs, so a second run uploads nothing and prepares
    nothing a task caches."""
    path = Path(root or STAGING_ROOT).expanduser() / hashlib.sha256(uri.encode()).hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    (path / "uri.txt").write_text(uri + "\n")
    return path


def bounded(fn: Callable[[], T], seconds: float, what: str) -> T:
    """``fn()`` on a thread of its own, waited on for at most ``seconds``; a call still running
    then raises :class:`UploadError` naming ``what`` (the thread is left to end by itself)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # handed to the caller
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True, name="raytrain-store")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise UploadError(f"{what}: no answer from the store in {seconds:.0f} s")
    if "error" in box:
        raise UploadError(f"{what}: {type(box['error']).__name__}: {box['error']}") from box["error"]
    return box["value"]


def remote_sizes(dest: str) -> dict[str, int]:
    """Every file under ``dest`` (a URI): path relative to it -> size; {} when there is none."""
    import pyarrow.fs as pafs

    def listing() -> dict[str, int]:
        fs, root = pafs.FileSystem.from_uri(dest)
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        return {i.path[len(root) :].lstrip("/"): i.size for i in infos if i.type == pafs.FileType.File}

    return bounded(listing, LIST_TIMEOUT_S, f"listing {dest}")


def local_files(local: Path) -> dict[str, list[int]]:
    """The files a task prepared under ``local``: relative path -> [size, mtime_ns] (the quick
    check of :func:`~raytrain_loops.data.formats.identity.stamps`). Hidden files and those still being
    written (``*.tmp*``) are left out, and ``uri.txt``."""
    return {rel: stamp for rel, stamp in identity.stamps(str(local), mtimes=True).items() if rel != "uri.txt"}


def to_upload(local: dict[str, list[int]], remote: dict[str, int], record: dict[str, list[int]]) -> list[str]:
    """The files to upload: those the store lacks or holds at another size, and those changed
    here (size or modification time) since they were last uploaded from here. A file never
    uploaded from here that the store holds at its size is taken as there (another driver
    prepared and uploaded the same set: the built-in sets' directories are keyed by their
    parameters)."""
    return [rel for rel, stamp in local.items() if remote.get(rel) != stamp[0] or record.get(rel, stamp) != stamp]


class _Progress:
    """Bytes uploaded so far, printed every ``PROGRESS_EVERY_S`` when the upload is large."""

    def __init__(self, total: int, dest: str, say: Callable[[str], None]):
        self.total, self.dest, self.say = total, dest, say
        self.done, self.shown = 0, time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        if self.total >= PROGRESS_BYTES and time.monotonic() - self.shown >= PROGRESS_EVERY_S:
            self.shown = time.monotonic()
            self.say(f"uploading to {self.dest}: {self.done / 2**20:.0f} of {self.total / 2**20:.0f} MiB")


def _copy(fs: Any, src: Path, dest: str, progress: _Progress) -> None:
    with open(src, "rb") as f, fs.open_output_stream(dest) as out:
        while chunk := f.read(CHUNK):
            out.write(chunk)
            progress.add(len(chunk))


def upload_one(fs: Any, src: Path, dest: str, progress: _Progress, stall_s: float = STALL_S) -> None:
    """Upload one file on a thread, waited on while bytes keep going (``stall_s`` at most
    without a chunk written); raises :class:`UploadError` naming the file otherwise."""
    box: dict[str, BaseException] = {}

    def run() -> None:
        try:
            _copy(fs, src, dest, progress)
        except BaseException as err:  # handed to the caller
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True, name="raytrain-upload")
    thread.start()
    seen, since = progress.done, time.monotonic()
    while thread.is_alive():
        thread.join(1.0)
        if progress.done != seen:
            seen, since = progress.done, time.monotonic()
        elif time.monotonic() - since > stall_s:
            raise UploadError(f"uploading {src} to {dest}: no progress in {stall_s:.0f} s")
    if "error" in box:
        raise UploadError(f"uploading {src} to {dest}: {type(box['error']).__name__}: {box['error']}")


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def upload_missing(local: Path, dest: str, say: Callable[[str], None] = _say, stall_s: float = STALL_S) -> list[str]:
    """Upload what ``local`` holds to ``dest`` (a URI), only the files :func:`to_upload` names;
    the relative paths uploaded. Each file is recorded in ``local/.uploaded.json`` once it is
    whole on the store, so an interrupted upload continues where it stopped."""
    import pyarrow.fs as pafs

    from raytrain_loops import storage

    files = local_files(local)
    record_path = local / RECORD
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    todo = to_upload(files, remote_sizes(dest), record)
    if any(rel not in record and rel not in todo for rel in files):  # found on the store: recorded as uploaded
        record.update({rel: stamp for rel, stamp in files.items() if rel not in todo})
        storage.write_text(str(record_path), json.dumps(record))
    if not todo:
        return []
    total = sum(files[rel][0] for rel in todo)
    say(f"uploading {len(todo)} files ({total / 2**20:.1f} MiB) from {local} to {dest}")
    fs, root = pafs.FileSystem.from_uri(dest)
    progress = _Progress(total, dest, say)
    for rel in todo:
        target = f"{root.rstrip('/')}/{rel}"
        bounded(lambda t=target: fs.create_dir(t.rsplit("/", 1)[0], recursive=True), LIST_TIMEOUT_S, target)
        upload_one(fs, local / rel, target, progress, stall_s)
        record[rel] = files[rel]
        storage.write_text(str(record_path), json.dumps(record))
    return todo
