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

from raytrain_loops.errors import CheckpointError

STATE = "state.pt"


def manifest_name(rank: int) -> str:
    """The file a checkpoint's worker ``rank`` writes last, listing its files (a checkpoint is
    complete when every worker's is there)."""
    return f"manifest.rank{rank}.json"

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
    _atomic_write(d / manifest_name(rank), lambda f: f.write(body))


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
    world_size = _manifest(d / manifest_name(0))["world_size"]
    for rank in range(world_size):
        for name, meta in _manifest(d / manifest_name(rank))["files"].items():
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
    checkpoint of the same step gets (``-2``, ``-3``...). (-1, 0) if not a checkpoint's name (a
    step of at least 8 digits: Tune's copies in a sweep's trial directory, ``checkpoint_000002``,
    are not the run's)."""
    match = re.fullmatch(r"checkpoint_(\d{8,})(?:-(\d+))?", name)
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


def _transient(err: BaseException) -> bool:
    """An error that says nothing about a checkpoint's content: out of memory, or an I/O error
    other than the ones :func:`_is_damage` reads as a file cut short or missing."""
    return isinstance(err, (MemoryError, torch.OutOfMemoryError)) or (isinstance(err, OSError) and not _is_damage(err))


def _dcp_failure(err: BaseException, directory: str | Path, what: str) -> Exception:
    """DCP's ``CheckpointException`` (a ``BaseException``, with every worker's failure) as the
    error to raise: the first transient cause itself (as the worker that met it raised it), else a
    :class:`CheckpointError` naming every worker's cause (``partial`` when the workers had begun
    writing the tensors into their targets)."""
    causes = sorted(err.failures.items())
    for _, (cause, _) in causes:
        if _transient(cause):
            return cause
    detail = "; ".join(f"worker {rank}: {type(cause).__name__}: {cause}" for rank, (cause, _) in causes)
    error = CheckpointError(f"{directory}: {what} failed ({detail})")
    error.refused = any(isinstance(c, pickle.UnpicklingError) or getattr(c, "refused", False) for _, (c, _) in causes)
    error.partial = err.args[0] == "read"  # DCP's step: "plan" reads nothing into the targets
    return error


def _dcp_metadata(directory: str | Path):
    """The DCP metadata of a checkpoint, read without running code; damage as :class:`CheckpointError`."""
    from raytrain_loops.checkpoint import dcp_io

    path = Path(directory) / DCP_DIR / dcp_io.METADATA
    try:
        return dcp_io.read_metadata(path.parent)
    except Exception as err:
        raise _damage(err, path) from None


def _damage(err: Exception, path: Path) -> Exception:
    """``err``, met reading ``path`` of a sharded checkpoint, as the error to raise: itself when
    transient, else a :class:`CheckpointError` (``refused`` when an unpickler refused a type)."""
    if _transient(err):
        return err
    error = CheckpointError(f"{path}: refused or unreadable ({type(err).__name__}: {err})")
    error.refused = isinstance(err, pickle.UnpicklingError)
    return error


def check_sharded(directory: str | Path) -> None:
    """Read a sharded checkpoint's DCP metadata and its non-tensor items (the optimizer's settings)
    as :func:`read_sharded` will, without running code and without collectives: what a worker
    checks on its own before the workers load the checkpoint together. Raises
    :class:`CheckpointError` when either is refused or unreadable."""
    from raytrain_loops.checkpoint import dcp_io

    metadata = _dcp_metadata(directory)
    try:
        dcp_io.read_bytes_items(Path(directory) / DCP_DIR, metadata)
    except Exception as err:
        raise _damage(err, Path(directory) / DCP_DIR) from None


def write_sharded(
    directory: str | Path, rank: int, files: dict[str, Any], state: dict[str, Any], world_size: int
) -> None:
    """A checkpoint of a sharded engine: ``state``'s ``model``, ``optimizer`` and ``ema`` go
    through ``torch.distributed.checkpoint`` into ``dcp/`` (every worker writes its own shards,
    rank 0 the metadata; all workers call this together), the rest of ``state`` into ``files``'
    ``state.pt`` on rank 0; then :func:`write_files`, whose manifest lists this worker's DCP files
    with their checksums like any other file. ``state`` loses the keys it wrote to DCP. A failed
    write raises its first worker's cause (every worker raises)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    d = Path(directory)
    sharded = {k: state.pop(k) for k in SHARDED_KEYS if state.get(k) is not None}
    try:
        dcp.save(sharded, checkpoint_id=d / DCP_DIR)
    except CheckpointException as err:
        raise min(err.failures.items())[1][0] from None
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
    whatever the number of workers that wrote them (each worker reads the parts of its shards).
    All workers call it together. Nothing is unpickled beyond what ``weights_only=True`` allows.

    A worker's failure is every worker's (DCP gathers them): an out-of-memory or I/O error raises
    that error; anything else (a state that does not fit this model, unreadable content) a
    :class:`CheckpointError`."""
    from raytrain_loops.checkpoint import dcp_io

    metadata = _dcp_metadata(directory)
    wanted = {k: v for k, v in targets.items() if v is not None}
    try:
        dcp_io.load_into(wanted, Path(directory) / DCP_DIR, metadata)
    except dcp_io.CheckpointException as err:
        raise _dcp_failure(err, directory, "loading the sharded state") from None


def fill_from_plain(targets: dict[str, Any], state: dict[str, Any]) -> None:
    """Fill ``targets`` (a sharded engine's ``sharded_targets()``) in place from a plain checkpoint's
    ``state`` (whole tensors, the optimizer's state keyed by parameter index): what a run that
    wrote plain checkpoints (DDP) loads when it goes on sharded. Every worker holds the whole
    state and keeps its own shard of each tensor (no collective); the optimizer's groups pair up
    in order. Everything is checked before anything is written; a state that does not fit this
    model raises ``ValueError`` naming the key (as loading a plain state into a plain model does:
    not damage, the checkpoint before would not fit either)."""
    writes: list[tuple[torch.Tensor, torch.Tensor]] = []

    def pair(target: Any, value: Any, name: str) -> None:
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(target.shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{name}: the checkpoint holds {got}, the model {tuple(target.shape)}")
        writes.append((target, value))

    for key in ("model", "ema"):
        if targets.get(key) is None:
            continue
        source = state.get(key)
        if not isinstance(source, dict):
            raise ValueError(f"the plain checkpoint holds no {key} state")
        if set(source) != set(targets[key]):
            raise ValueError(
                f"the plain checkpoint's {key} has keys {sorted(source)}, the model {sorted(targets[key])}"
            )
        for name, target in targets[key].items():
            pair(target, source[name], f"{key}.{name}")

    settings: list[tuple[dict, dict]] = []
    mine, theirs = targets["optimizer"], state["optimizer"]
    if len(mine["param_groups"]) != len(theirs["param_groups"]):
        raise ValueError(
            f"the plain checkpoint's optimizer has {len(theirs['param_groups'])} parameter groups, "
            f"the model's {len(mine['param_groups'])}"
        )
    for group, saved in zip(mine["param_groups"], theirs["param_groups"], strict=True):
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(
                f"a parameter group of the plain checkpoint's optimizer holds {len(saved['params'])} "
                f"parameters, the model's {len(group['params'])}"
            )
        settings.append((group, saved))
        for name, index in zip(group["params"], saved["params"], strict=True):
            for k, value in theirs["state"].get(index, {}).items():
                target = mine["state"].setdefault(name, {}).get(k)
                if isinstance(target, torch.Tensor):
                    pair(target, value, f"optimizer.state.{name}.{k}")
                else:
                    mine["state"][name][k] = value

    for group, saved in settings:
        group.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
    for target, value in writes:
        _fill(target, value)


def _fill(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy ``value`` (a whole tensor) into ``target``: into its shard, for a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        local = distribute_tensor(value.detach(), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(local.to_local())
    else:
        target.detach().copy_(value)


def sharded_digest(directory: str | Path) -> str:
    """A SHA-256 over the checksums of a sharded checkpoint's DCP files (from its manifests, which
    :func:`verify` checked): equal digests, the same shards."""
    d = Path(directory)
    h = hashlib.sha256()
    world = _manifest(d / manifest_name(0))["world_size"]
    for rank in range(world):
        for name, meta in sorted(_manifest(d / manifest_name(rank))["files"].items()):
            if name.startswith(f"{DCP_DIR}/"):
                h.update(f"{name}:{meta['sha256']}".encode())
    return h.hexdigest()


def export(directory: str | Path, out: str | Path, ema: bool = False) -> dict[str, Any]:
    """Write a single-file ``state.pt`` for inference from a checkpoint (sharded or not): the whole
    model's weights (``model``), the EMA's when there are any (``ema``) and the counters, keyed
    as the plain model's ``state_dict``; with ``ema``, the EMA's weights as ``model`` (a
    CheckpointError when the run kept no EMA). Verifies the checkpoint first and reads it without
    running code; returns what it wrote."""
    result = whole_model(directory)
    if ema:
        if not result["ema"]:
            raise CheckpointError(f"{directory} holds no EMA weights (the run had ema.enabled=false)")
        result = {**result, "model": result["ema"]}
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda f: torch.save(result, f))
    return result


def whole_model(directory: str | Path) -> dict[str, Any]:
    """What :func:`export` writes, read from the checkpoint ``directory`` (verified first)."""
    d = Path(directory)
    verify(d)
    shared = read_file(d, STATE)
    if is_sharded(d):
        from raytrain_loops.checkpoint import dcp_io

        metadata = _dcp_metadata(d)
        try:
            full = dcp_io.load_whole(d / DCP_DIR, metadata)
        except dcp_io.CheckpointException as err:
            raise _dcp_failure(err, d, "reading the sharded state") from None
        shared = {**shared, **full}
    return {"model": shared["model"], "ema": shared.get("ema"), "counters": shared.get("counters", {})}
