"""Data paths that need no Ray: batches of map-style splits (:mod:`.map_style`)."""

from raytrain_loops.data.map_style import MapBatches

__all__ = ["MapBatches"]
