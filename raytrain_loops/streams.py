"""Streams that hold what the garbage collector should not be left to free: a reading thread, a
read-ahead window, open files. Below the engine and data alike (Ray-free, standard library only),
so that the loop, the Parquet reader and the Ray batch source end their streams the same way."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["close"]


def close(stream: Iterable[Any]) -> None:
    """Close ``stream`` now when it can be closed (a generator: its ``finally`` runs, its threads
    and open files end), rather than when the garbage collector or a held traceback lets it go:
    what an epoch or an evaluation does when it ends, for any reason."""
    closer = getattr(stream, "close", None)
    if callable(closer):
        closer()
