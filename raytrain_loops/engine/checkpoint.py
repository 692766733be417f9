"""Checkpoint files written atomically and verifiably, read without unpickling code.

Each worker writes its own files into a checkpoint directory (rank 0 the shared training state,
every rank its RNG and data position), each through a temporary name and a rename, then a
manifest ``manifest.rank{r}.json`` with every file's size and SHA-256, last. A directory is
complete when every rank's manifest is there and every listed file matches it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

STATE = "state.pt"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or damaged."""


def digest(state: dict[str, torch.Tensor]) -> str:
    """A SHA-256 of a state dict's names and tensor bytes: equal digests, equal weights."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_files(directory: str | Path, rank: int, files: dict[str, Any]) -> None:
    """Write ``files`` (name -> object for ``torch.save``) and then this rank's manifest."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for name, obj in files.items():
        _atomic_write(d / name, lambda f, obj=obj: torch.save(obj, f))
        manifest[name] = {"bytes": (d / name).stat().st_size, "sha256": _sha256(d / name)}
    body = json.dumps({"rank": rank, "files": manifest}, indent=1).encode()
    _atomic_write(d / f"manifest.rank{rank}.json", lambda f: f.write(body))


def verify(directory: str | Path, world_size: int) -> None:
    """Raise :class:`CheckpointError` unless every rank's manifest and files are intact."""
    d = Path(directory)
    for rank in range(world_size):
        mpath = d / f"manifest.rank{rank}.json"
        if not mpath.is_file():
            raise CheckpointError(f"{d}: no manifest from worker {rank} (an interrupted write?)")
        try:
            entries = json.loads(mpath.read_text())["files"]
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"{mpath}: unreadable manifest ({err})") from None
        for name, meta in entries.items():
            f = d / name
            if not f.is_file():
                raise CheckpointError(f"{f}: listed in the manifest but missing")
            if f.stat().st_size != meta["bytes"] or _sha256(f) != meta["sha256"]:
                raise CheckpointError(f"{f}: size or checksum differs from the manifest (damaged)")


def read_file(directory: str | Path, name: str) -> Any:
    """Load one checkpoint file with ``weights_only=True``: tensors and plain containers only."""
    path = Path(directory) / name
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as err:  # weights_only refuses anything that would run code
        raise CheckpointError(f"{path}: refused or unreadable ({type(err).__name__}: {err})") from None
