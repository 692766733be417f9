"""A Parquet split's size in memory, read from its files' footers: what ``data.materialize=auto``
decides on. The files' size is no measure of it: a compressed column is larger decoded, and a
dictionary- or run-length-encoded one (a column of a few labels) many times larger."""

from __future__ import annotations

from typing import Any

# Bits per value in memory of Parquet's fixed-width physical types.
_BITS = {"BOOLEAN": 1, "INT32": 32, "INT64": 64, "INT96": 64, "FLOAT": 32, "DOUBLE": 64}


def _chunk_bytes(chunk: Any, bits: int) -> int:
    """A column chunk's size in memory, from its footer entry: its uncompressed size, or, where
    the encoding hides it (a dictionary, runs), its values at their width; a variable-width
    value (``BYTE_ARRAY``) at the mean length of its min and max statistics, plus its offset."""
    values = chunk.num_values
    if chunk.physical_type == "BYTE_ARRAY":
        stats = chunk.statistics if chunk.is_stats_set else None
        if stats is None or not stats.has_min_max:
            return chunk.total_uncompressed_size
        lengths = [len(v.encode() if isinstance(v, str) else v) for v in (stats.min, stats.max)]
        bits = 8 * (4 + sum(lengths) // 2)
    return max(chunk.total_uncompressed_size, values * bits // 8)


def memory_bytes(meta: Any, columns: list[str]) -> int:
    """The size in memory (as a ``pyarrow.Table``) of ``columns`` of the Parquet file whose footer
    is ``meta``, without reading its pages: the sum of :func:`_chunk_bytes` over the chunks of
    those columns (a nested column's leaves included). The files' size is no measure of it: a
    dictionary-encoded or compressed column is many times larger decoded."""
    wanted, total = set(columns), 0
    for j in range(meta.num_columns):
        column = meta.schema.column(j)
        if column.path.split(".")[0] not in wanted:
            continue
        bits = _BITS.get(column.physical_type, 8 * (column.length or 0))  # FIXED_LEN_BYTE_ARRAY: its length
        total += sum(_chunk_bytes(meta.row_group(i).column(j), bits) for i in range(meta.num_row_groups))
    return total
