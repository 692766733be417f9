"""One part of a conversion: the images of one output file read from the source, their headers
read (no decode), and the file written in row groups of ``chunk_rows`` rows (the plan's chunks,
``data.shuffle_chunk_rows``). A Ray Data task runs :func:`write_part` for each part; it runs as
well in any process."""

from __future__ import annotations

import json
from typing import Any

from raytrain_loops.data.formats import coco, imagefolder
from raytrain_loops.data.formats.layout import NotAnImage, header, open_root

FORMATS = {imagefolder.KIND: imagefolder, coco.KIND: coco}


def job(kind: str, src: str, out: str, rel: str, items: list[dict[str, Any]], chunk_rows: int) -> dict[str, Any]:
    """A part as Ray Data carries it (one row; the items as JSON, whatever their shape): written to
    ``out``, the file that becomes ``rel`` in the converted set."""
    return {"kind": kind, "src": src, "out": out, "rel": rel, "chunk_rows": chunk_rows, "items": json.dumps(items)}


def write_part(part: dict[str, Any]) -> dict[str, Any]:
    """Write the part :func:`job` describes; ``out`` is the file's path (local or URI). Returns
    ``{"rel", "rows", "bytes", "skipped"}``: the rows written, the images' encoded bytes, and
    (as JSON) ``[path, why]`` for each file left out (not an image, found from its header; or a
    size unlike its annotation's). Nothing is written for a part whose every file is left out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fmt = FORMATS[part["kind"]]
    schema, chunk = fmt.schema(), int(part["chunk_rows"])
    src_fs, src_root = open_root(part["src"])
    out_fs, out_path = open_root(part["out"])
    rows: list[dict[str, Any]] = []
    skipped, written, nbytes, writer = [], 0, 0, None
    try:
        for item in json.loads(part["items"]):
            with src_fs.open_input_file(f"{src_root}/{item['path']}") as f:
                raw = f.read()
            try:
                row = fmt.row(item, header(raw))
            except (NotAnImage, ValueError) as err:
                skipped.append([item["path"], str(err)])
                continue
            rows.append({"image": raw, "path": item["path"], **row})
            nbytes += len(raw)
            if len(rows) == chunk:
                writer = writer or _writer(pq, out_fs, out_path, schema)
                writer.write_table(pa.Table.from_pylist(rows, schema), row_group_size=chunk)
                written, rows = written + len(rows), []
        if rows:
            writer = writer or _writer(pq, out_fs, out_path, schema)
            writer.write_table(pa.Table.from_pylist(rows, schema), row_group_size=chunk)
            written += len(rows)
    finally:
        if writer is not None:
            writer.close()
    return {"rel": part["rel"], "rows": written, "bytes": nbytes, "skipped": json.dumps(skipped)}


def _writer(pq: Any, fs: Any, path: str, schema: Any) -> Any:
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    return pq.ParquetWriter(path, schema, filesystem=fs)
