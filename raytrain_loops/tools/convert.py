"""``raytrain-loops convert``: a user's image data set (an ImageFolder tree, a COCO directory) turned
once into the Parquet the plan reads, on Ray Data over the cluster's CPUs.

The source is scanned and checked on the driver first (:mod:`raytrain_loops.data.formats`): bad
input is named before anything is written. The images are then cut into parts of
``rows_per_file`` rows in the source's order, and a Ray Data task per part reads its files,
reads each header (width, height, channels; nothing is decoded or re-encoded) and writes its
Parquet file in row groups of ``chunk_rows`` rows (``data.shuffle_chunk_rows``). Parts rather
than ``read_binary_files``' blocks: the files and the order of their rows are the same on every
conversion of a source, whatever the cluster, so the plan deals the same rows to the same places.
The parts are written under a hidden directory of the destination and moved into place once every
part is written; ``meta.json`` comes last. A rerun over a source whose paths, sizes and
modification times are unchanged, into a destination that still holds what was written, is a
no-op.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raytrain_loops import storage
from raytrain_loops.config.run import DataConfig
from raytrain_loops.data.formats import identity, layout, parts
from raytrain_loops.data.formats.layout import META, Plan, SourceError, part_name, sub

ROWS_PER_FILE = 1024
PART = re.compile(r"^[^/]+/part-\d{5}\.parquet$")
CHUNK_ROWS = DataConfig().shuffle_chunk_rows


@dataclass
class Summary:
    """What a conversion wrote (or found already written: ``converted`` False)."""

    dest: str
    images: int
    labels: str  # "3 classes", "80 categories"
    bytes: int
    files: int
    seconds: float
    skipped: list[list[str]] = field(default_factory=list)
    converted: bool = True

    def line(self) -> str:
        if not self.converted:
            return (
                f"{self.dest} is up to date: {self.images} images, {self.labels}, {_count(self.files, 'file')}; "
                "nothing converted"
            )
        rate = self.images / max(self.seconds, 1e-9)
        skipped = f"; {_count(len(self.skipped), 'file')} skipped (not images)" if self.skipped else ""
        return (
            f"converted {self.images} images, {self.labels}, {self.bytes / 2**20:.1f} MiB, into {_count(self.files, 'file')} "
            f"in {self.dest} in {self.seconds:.1f} s ({rate:.0f} images/s){skipped}"
        )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _options(kind: str, chunk_rows: int, rows_per_file: int) -> dict[str, Any]:
    return {"format": kind, "layout": layout.FORMAT, "chunk_rows": chunk_rows, "rows_per_file": rows_per_file}


def _output_identity(dest: str) -> dict[str, Any]:
    found = identity.identity(dest)
    found["files"].pop(META, None)
    return found


def unchanged(meta: dict[str, Any] | None, source: str, options: dict[str, Any], dest: str) -> bool:
    """Whether ``dest`` holds the conversion of this source (``source``: the digest of its
    listing with modification times) with these options, every file as it was written."""
    if not meta or meta.get("source_stamps") != source or meta.get("options") != options:
        return False
    return identity.digest(_output_identity(dest)) == meta.get("digest")


def _labels(meta: dict[str, Any]) -> str:
    """``3 classes`` or ``80 categories``, from a plan's or a ``meta.json``'s record."""
    if "classes" in meta:
        n = len(meta["classes"])
        return f"{n} class" if n == 1 else f"{n} classes"
    n = len(meta["categories"])
    return f"{n} category" if n == 1 else f"{n} categories"


def _jobs(plan: Plan, src: str, tmp: str, chunk_rows: int, rows_per_file: int) -> list[dict[str, Any]]:
    out = []
    for split, items in plan.splits.items():
        for k in range(math.ceil(len(items) / rows_per_file)):
            chunk = items[k * rows_per_file : (k + 1) * rows_per_file]
            rel = f"{split}/{part_name(k)}"
            out.append(parts.job(plan.kind, src, sub(tmp, split, part_name(k)), rel, chunk, chunk_rows))
    return out


def _run(jobs: list[dict[str, Any]], total: int) -> list[dict[str, Any]]:
    """Every part written by a Ray Data task (one per part, as many at once as the cluster has
    CPUs), a progress bar in images on stderr."""
    import logging

    import ray.data
    from tqdm import tqdm

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.ERROR)  # its line saying the bars are off
    ds = ray.data.from_items(jobs, override_num_blocks=len(jobs)).map(parts.write_part)
    done = []
    with tqdm(total=total, unit="img", desc="converting", file=sys.stderr) as bar:
        for result in ds.iter_rows():
            done.append(result)
            bar.update(result["rows"] + len(json.loads(result["skipped"])))
    return done


def _commit(dest: str, tmp: str, written: list[str]) -> None:
    """Move the parts from ``tmp`` into place, after removing the parts and ``meta.json`` of an
    earlier conversion (nothing else of ``dest``)."""
    fs, root = layout.open_root(dest)
    for rel in identity.stamps(dest):
        if rel == META or PART.match(rel):
            fs.delete_file(f"{root}/{rel}")
    _, tmp_root = layout.open_root(tmp)
    for rel in written:
        fs.create_dir(f"{root}/{rel}".rsplit("/", 1)[0], recursive=True)
        fs.move(f"{tmp_root}/{rel}", f"{root}/{rel}")
    storage.delete_tree(tmp if storage.is_uri(tmp) else storage.local_path(tmp))


def _checked(plan: Plan, results: list[dict[str, Any]], strict: bool) -> list[list[str]]:
    """The files left out; raises SourceError under ``strict`` when there are any, or when a
    class or a split is left without images."""
    skipped = [s for r in results for s in json.loads(r["skipped"])]
    if skipped and strict:
        shown = "; ".join(f"{p} ({why})" for p, why in skipped[:10])
        raise SourceError(f"--strict: {_count(len(skipped), 'file')} could not be converted: {shown}")
    left = {p for p, _ in skipped}
    for split, items in plan.splits.items():
        kept = [item for item in items if item["path"] not in left]
        if not kept:
            raise SourceError(f"split {split!r} has no images left once the files that are not images are skipped")
        if "classes" in plan.meta:
            empty = set(range(len(plan.meta["classes"]))) - {item["label"] for item in kept}
            if split == "train" and empty:
                names = [plan.meta["classes"][i] for i in sorted(empty)]
                raise SourceError(f"class directories {names} hold no images (their files are not images)")
    return skipped


def convert(
    kind: str,
    src: str,
    dest: str,
    strict: bool = False,
    chunk_rows: int = CHUNK_ROWS,
    rows_per_file: int = ROWS_PER_FILE,
    say: Callable[[str], None] = _say,
    num_cpus: int | None = None,
) -> Summary:
    """Convert the ``kind`` (``imagefolder`` or ``coco``) source ``src`` into ``dest`` (each a
    local path or a URI). Ray is started once the source is checked and there is work (:func:`start`,
    ``num_cpus``), unless it is up. Raises :class:`SourceError` naming
    bad input (before anything is written), or, under ``strict``, the files that are not images."""
    if kind not in parts.FORMATS:
        raise SourceError(f"unknown format {kind!r}; one of {sorted(parts.FORMATS)}")
    if chunk_rows < 1 or rows_per_file < chunk_rows:
        raise SourceError(f"need 1 <= chunk_rows <= rows_per_file; got {chunk_rows} and {rows_per_file}")
    began = time.monotonic()
    options = _options(kind, chunk_rows, rows_per_file)
    stamps = identity.stamps(src, mtimes=True)
    if not stamps:
        raise SourceError(f"{src} holds no files (or is not there)")
    source = identity.digest(stamps)
    meta = layout.read_meta(dest)
    if unchanged(meta, source, options, dest):
        found = _output_identity(dest)
        images = sum(found["rows"].values())
        return Summary(dest, images, _labels(meta), meta["bytes"], len(found["files"]), time.monotonic() - began, converted=False)
    plan = parts.FORMATS[kind].plan(src)
    tmp = sub(dest, f".convert-{uuid.uuid4().hex[:8]}")
    fresh = not storage.is_uri(dest) and not os.path.exists(storage.local_path(dest))
    say(f"converting {plan.images} images ({_labels(plan.meta)}) of {src} into {dest}")
    starting = time.monotonic()
    start(num_cpus)
    began += time.monotonic() - starting  # the conversion's own time, not Ray's start-up
    try:
        results = _run(_jobs(plan, src, tmp, chunk_rows, rows_per_file), plan.images)
        skipped = _checked(plan, results, strict)
    except BaseException:
        storage.delete_tree(tmp if storage.is_uri(tmp) else storage.local_path(tmp))
        if fresh:  # the directory this call made, left empty
            with contextlib.suppress(OSError):
                os.rmdir(storage.local_path(dest))
        raise
    for path, why in skipped:
        say(f"skipped {path}: {why}")
    written = sorted(r["rel"] for r in results if r["rows"])
    _commit(dest, tmp, written)
    rows = {split: 0 for split in plan.splits}
    for r in results:
        rows[r["rel"].split("/")[0]] += r["rows"]
    nbytes = sum(r["bytes"] for r in results)
    found = _output_identity(dest)
    channels = sorted({c for c in _channels(dest, found)})
    record = {**plan.meta, "options": options, "splits": rows, "bytes": nbytes, "channels": channels,
              "source": src, "source_stamps": source, "skipped": skipped, "digest": identity.digest(found)}  # fmt: skip
    storage.write_text(sub(dest, META), json.dumps(record, indent=1) + "\n")
    return Summary(dest, sum(rows.values()), _labels(plan.meta), nbytes, len(written), time.monotonic() - began, skipped)


def _channels(dest: str, found: dict[str, Any]) -> set[int]:
    """The channel counts of the converted images (read from the ``channels`` columns)."""
    import pyarrow.compute as pc
    import pyarrow.dataset as pads

    fs, root = layout.open_root(dest)
    files = [f"{root}/{rel}" for rel in found["files"] if rel.endswith(".parquet")]
    column = pads.dataset(files, filesystem=fs, format="parquet").to_table(columns=["channels"]).column("channels")
    return {int(v) for v in pc.unique(column).to_pylist()}


def start(num_cpus: int | None = None) -> None:
    """Join the cluster in ``RAY_ADDRESS``, or start a local Ray of ``num_cpus`` CPUs (all of this
    machine's by default); nothing when Ray is up."""
    import ray

    from raytrain_loops.driver.ray_start import start_local_ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
        return
    start_local_ray(num_cpus or os.cpu_count() or 1)
