"""Checkpoints: what one holds, how it is written, verified, found, restored, kept and chosen as best.
write and restore: a reporter (local_reporter.LocalReporter; on Ray, ray_reporter.RayReporter);
read: read_file, whole_model, export, load_backbone; verify: verify, check_sharded; list:
checkpoint_dirs, candidates, last_checkpoint, exported_checkpoint; retain: retain, BestCheckpoints
(on Ray, ray_keep_best.KeepBest). Ray-free but the ray_* modules, which callers import by name."""

from raytrain_loops.checkpoint.best import BestCheckpoints
from raytrain_loops.checkpoint.files import (
    CheckpointError,
    check_sharded,
    export,
    is_sharded,
    manifest_name,
    read_file,
    step_of,
    verify,
    whole_model,
)
from raytrain_loops.checkpoint.listing import checkpoint_dirs, exported_checkpoint, last_checkpoint, retain
from raytrain_loops.checkpoint.reporter import CheckpointReporter
from raytrain_loops.checkpoint.restore import candidates
from raytrain_loops.checkpoint.weights import WeightsError, load_backbone

__all__ = [
    "BestCheckpoints",
    "CheckpointError",
    "CheckpointReporter",
    "WeightsError",
    "candidates",
    "check_sharded",
    "checkpoint_dirs",
    "export",
    "exported_checkpoint",
    "is_sharded",
    "last_checkpoint",
    "load_backbone",
    "manifest_name",
    "read_file",
    "retain",
    "step_of",
    "verify",
    "whole_model",
]
