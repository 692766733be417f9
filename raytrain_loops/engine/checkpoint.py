"""Checkpoint files written atomically and verifiably, read without unpickling code.

Each worker writes its own files into a checkpoint directory (rank 0 the shared training state,
every rank its RNG and data position), each through a temporary name and a rename, then a
manifest ``manifest.rank{r}.json`` with every file's size and SHA-256, last. A directory is
complete when every rank's manifest is there and every listed file matches it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
from pathlib import Path, PurePosixPath
from typing import Any

import torch

STATE = "state.pt"


class CheckpointError(RuntimeError):
    refused = False  # set when weights_only refused what the file holds, rather than it being cut or missing

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


def write_files(
    directory: str | Path, rank: int, files: dict[str, Any], world_size: int, written: list[str] = ()
) -> None:
    """Write ``files`` (name -> object for ``torch.save``) and then this rank's manifest, which
    also records how many workers wrote the checkpoint. ``written``: files this rank already
    wrote there (relative names), listed in the manifest with the others."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    manifest = {name: {"bytes": (d / name).stat().st_size, "sha256": _sha256(d / name)} for name in written}
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
        world_size = int(data["world_size"])
        files = {name: {"bytes": int(m["bytes"]), "sha256": str(m["sha256"])} for name, m in data["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{path}: unreadable manifest ({type(err).__name__}: {err})") from None
    if world_size < 1:
        raise CheckpointError(f"{path}: world_size must be at least 1; got {world_size}")
    for name in files:
        _check_name(path, name)
    return {"world_size": world_size, "files": files}


def _check_name(manifest: Path, name: str) -> None:
    """A listed file must lie in the checkpoint directory: a manifest is data read from storage,
    and a name such as ``../x`` would have verification read (and trust) a file elsewhere."""
    parts = PurePosixPath(name).parts
    if not name or "\\" in name or PurePosixPath(name).is_absolute() or any(p in ("..", ".") for p in parts):
        raise CheckpointError(f"{manifest}: file name {name!r} points outside the checkpoint directory")


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


# What torch.load raises for a file that is not a whole checkpoint file: a pickle that
# weights_only refuses, a cut-off stream, a zip archive with pieces missing.
_DAMAGE = (pickle.UnpicklingError, EOFError, ValueError)
_DAMAGE_MESSAGES = ("PytorchStreamReader", "zip archive")


def _is_damage(err: BaseException) -> bool:
    if isinstance(err, (FileNotFoundError, *_DAMAGE)):
        return True
    if isinstance(err, RuntimeError):
        return any(m in str(err) for m in _DAMAGE_MESSAGES)
    # The zip reader seeks past the end of a file cut short (EINVAL); a failing device or
    # network reports EIO, ETIMEDOUT and the like, which are no proof of damage.
    return isinstance(err, OSError) and err.errno == errno.EINVAL


def read_file(directory: str | Path, name: str) -> Any:
    """Load one checkpoint file with ``weights_only=True``: tensors and plain containers only.

    Raises :class:`CheckpointError` when the file is damaged (missing, cut off, not a
    checkpoint file, or a pickle that would run code). Any other failure (out of memory, an I/O
    error) propagates as it is: it says nothing about the checkpoint, and a caller must not take
    an older checkpoint because of it."""
    path = Path(directory) / name
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        if not _is_damage(err):
            raise
        what = (
            "missing" if isinstance(err, FileNotFoundError) else f"refused or unreadable ({type(err).__name__}: {err})"
        )
        error = CheckpointError(f"{path}: {what}")
        # weights_only refusing a type: the bytes may be whole (the manifest's checksums are
        # checked first); an older checkpoint is worth trying, a start from scratch is not.
        error.refused = isinstance(err, pickle.UnpicklingError)
        raise error from None


# ---------------------------------------------------------------- sharded (FSDP) checkpoints

DCP_DIR = "dcp"
SHARDED_KEYS = ("model", "optimizer", "ema")


def is_sharded(directory: str | Path) -> bool:
    """Whether a checkpoint keeps its weights in ``torch.distributed.checkpoint`` shards."""
    return (Path(directory) / DCP_DIR / ".metadata").is_file()


def write_sharded(
    directory: str | Path, rank: int, files: dict[str, Any], state: dict[str, Any], world_size: int
) -> None:
    """A checkpoint of a sharded engine: ``state``'s ``model``, ``optimizer`` and ``ema`` go
    through ``torch.distributed.checkpoint`` into ``dcp/`` (every worker writes its own shards,
    rank 0 the metadata; all workers call this together), the rest of ``state`` into ``files``'
    ``state.pt`` on rank 0; then :func:`write_files`, whose manifest lists this worker's DCP files
    with their checksums like any other file. ``state`` loses the keys it wrote to DCP."""
    import torch.distributed.checkpoint as dcp

    d = Path(directory)
    sharded = {k: state.pop(k) for k in SHARDED_KEYS if state.get(k) is not None}
    dcp.save(sharded, checkpoint_id=d / DCP_DIR)
    if rank == 0:
        files = {**files, STATE: state}
    mine = [
        f"{DCP_DIR}/{p.name}"
        for p in sorted((d / DCP_DIR).iterdir())
        if re.fullmatch(rf"__{rank}_\d+\.distcp", p.name) or (rank == 0 and p.name == ".metadata")
    ]
    write_files(d, rank, files, world_size, written=mine)


def read_sharded(directory: str | Path, targets: dict[str, Any]) -> None:
    """Fill ``targets`` (an engine's ``sharded_targets()``) in place from a checkpoint's DCP shards,
    whatever the number of workers that wrote them (each worker reads the parts of its shards)."""
    import torch.distributed.checkpoint as dcp

    wanted = {k: v for k, v in targets.items() if v is not None}
    try:
        dcp.load(wanted, checkpoint_id=Path(directory) / DCP_DIR)
    except Exception as err:  # a key the checkpoint lacks (an EMA that was not saved) or a shape that differs
        raise CheckpointError(
            f"{directory}: the sharded state does not fit this model ({type(err).__name__}: {err})"
        ) from None


def sharded_digest(directory: str | Path) -> str:
    """A SHA-256 over the checksums of a sharded checkpoint's DCP files (from its manifests, which
    :func:`verify` checked): equal digests, the same shards."""
    d = Path(directory)
    h = hashlib.sha256()
    world = _manifest(d / "manifest.rank0.json")["world_size"]
    for rank in range(world):
        for name, meta in sorted(_manifest(d / f"manifest.rank{rank}.json")["files"].items()):
            if name.startswith(f"{DCP_DIR}/"):
                h.update(f"{name}:{meta['sha256']}".encode())
    return h.hexdigest()


def export(directory: str | Path, out: str | Path) -> dict[str, Any]:
    """Write a single-file ``state.pt`` for inference from a checkpoint (sharded or not): the whole
    model's weights (``model``), the EMA's when there are any (``ema``) and the counters, keyed
    as the plain model's ``state_dict``. Verifies the checkpoint first; returns what it wrote."""
    d = Path(directory)
    verify(d)
    shared = read_file(d, STATE)
    if is_sharded(d):
        import tempfile

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(d / DCP_DIR, Path(tmp) / "full.pt")
            full = torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=True)
        shared = {**shared, **full}
    result = {"model": shared["model"], "ema": shared.get("ema"), "counters": shared.get("counters", {})}
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda f: torch.save(result, f))
    return result
