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
import re
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


def write_files(directory: str | Path, rank: int, files: dict[str, Any], world_size: int) -> None:
    """Write ``files`` (name -> object for ``torch.save``) and then this rank's manifest, which
    also records how many workers wrote the checkpoint."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for name, obj in files.items():
        _atomic_write(d / name, lambda f, obj=obj: torch.save(obj, f))
        manifest[name] = {"bytes": (d / name).stat().st_size, "sha256": _sha256(d / name)}
    body = json.dumps({"rank": rank, "world_size": world_size, "files": manifest}, indent=1).encode()
    _atomic_write(d / f"manifest.rank{rank}.json", lambda f: f.write(body))


def _manifest(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path.parent}: no {path.name} (an interrupted write?)")
    try:
        data = json.loads(path.read_text())
        return {"world_size": int(data["world_size"]), "files": dict(data["files"])}
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: unreadable manifest ({type(err).__name__}: {err})") from None


def verify(directory: str | Path) -> int:
    """Raise :class:`CheckpointError` unless every writer's manifest and every file it lists
    are intact; return the number of workers that wrote the checkpoint."""
    d = Path(directory)
    world_size = _manifest(d / "manifest.rank0.json")["world_size"]
    for rank in range(world_size):
        for name, meta in _manifest(d / f"manifest.rank{rank}.json")["files"].items():
            f = d / name
            if not f.is_file():
                raise CheckpointError(f"{f}: listed in the manifest but missing")
            if f.stat().st_size != meta["bytes"] or _sha256(f) != meta["sha256"]:
                raise CheckpointError(f"{f}: size or checksum differs from the manifest (damaged)")
    return world_size


def step_of(name: str) -> int:
    """The step in a checkpoint directory's name (``checkpoint_00000040`` or
    ``checkpoint_00000040-2``); -1 if it is not one."""
    return order_key(name)[0]


def order_key(name: str) -> tuple[int, int]:
    """Sorts checkpoint directory names oldest first: by step, then by the suffix a later
    checkpoint of the same step gets (``-2``, ``-3``...). (-1, 0) if not a checkpoint's name."""
    match = re.fullmatch(r"checkpoint_(\d+)(?:-(\d+))?", name)
    return (int(match.group(1)), int(match.group(2) or 1)) if match else (-1, 0)


def read_file(directory: str | Path, name: str) -> Any:
    """Load one checkpoint file with ``weights_only=True``: tensors and plain containers only."""
    path = Path(directory) / name
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as err:  # weights_only refuses anything that would run code
        raise CheckpointError(f"{path}: refused or unreadable ({type(err).__name__}: {err})") from None
