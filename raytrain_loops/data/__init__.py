"""Data paths that need no Ray: batches of map-style splits (:mod:`.map_style`) and batch
samplers for them (:mod:`.samplers`)."""

from raytrain_loops.data.map_style import MapBatches
from raytrain_loops.data.samplers import GroupedBatchSampler

__all__ = ["GroupedBatchSampler", "MapBatches"]
