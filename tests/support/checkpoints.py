"""Checkpoints as the restore tests build and damage them: an engine of the fakes' tiny model
(wrapped in DDP when a process group is up) whose state a checkpoint holds, and a rewrite of one
checkpoint file together with its entry in a worker's manifest, damage no checksum can show."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from raytrain_loops.config import load_config
from raytrain_loops.engine import Engine
from tests.support import fakes


def tiny_engine(seed: int = 0) -> Engine:
    """The fakes' tiny model (DDP inside a process group) under the default engine config."""
    model = fakes.make_model(seed=seed)
    if torch.distributed.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(model)
    return Engine(model, fakes.mean_loss, load_config(None).engine, total_steps=100)


def rewritten(d: Path, name: str, data: bytes, rank: int = 0) -> None:
    """Replace a checkpoint file and its entry in ``rank``'s manifest: damage no checksum can show."""
    (d / name).write_bytes(data)
    path = d / f"manifest.rank{rank}.json"
    manifest = json.loads(path.read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    path.write_text(json.dumps(manifest))
