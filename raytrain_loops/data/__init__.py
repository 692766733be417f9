"""Data paths that need no Ray: batches of map-style splits (:mod:`.map_style`) and batch
samplers for them (:mod:`.samplers`), imported when first named, so that a process that reads
data only (``raytrain-loops convert``'s Ray Data tasks) does not import torch."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"MapBatches": "raytrain_loops.data.map_style", "GroupedBatchSampler": "raytrain_loops.data.samplers"}


def __getattr__(attr: str) -> Any:
    if attr in _LAZY:
        return getattr(importlib.import_module(_LAZY[attr]), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


__all__ = ["GroupedBatchSampler", "MapBatches"]
