"""``torch.distributed.checkpoint`` (DCP) read without running code.

DCP's own reader unpickles ``.metadata`` with ``pickle.load`` and hands each non-tensor item
(the optimizer's settings) to ``torch.load(weights_only=False)``: a crafted checkpoint runs its
payload. Here the metadata goes through an unpickler that knows DCP's metadata types and nothing
else, and non-tensor items through ``torch.load(weights_only=True)``, like every other file of a
checkpoint. Tensor items were already read weights-only. This module imports DCP (a second or
more), so :mod:`raytrain_loops.checkpoint.files` imports it only when a sharded checkpoint is read.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

__all__ = ["CheckpointException", "load_into", "load_whole", "read_bytes_items", "read_metadata"]

METADATA = ".metadata"

# Every global a DCP ``.metadata`` pickle names (torch 2.x writers): its dataclasses, the enum
# that encodes a memory format, tensor sizes, layouts by name, the checkpoint's path; dtypes below.
_DCP = "torch.distributed.checkpoint.metadata"
_GLOBALS = {
    *(
        (_DCP, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")),
}
_DTYPES = {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _GLOBALS or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not one of the types DCP metadata holds")


def read_metadata(directory: str | Path) -> Metadata:
    """A DCP directory's ``.metadata``, unpickled with only DCP's metadata types allowed (a
    refused global raises ``pickle.UnpicklingError``), and checked: every item it places lies in
    one of the directory's shard files (``ValueError`` when not)."""
    with open(Path(directory) / METADATA, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise ValueError(f"holds a {type(metadata).__name__}, not DCP metadata")
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise ValueError("its item tables are not mappings")
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(item, (TensorStorageMetadata, BytesStorageMetadata)):
            raise ValueError(f"item {key!r} is a {type(item).__name__}, not a tensor or bytes item")
    for index, where in metadata.storage_data.items():
        if not isinstance(where, _StorageInfo):
            raise ValueError(f"the storage of {index} is a {type(where).__name__}")
        if not isinstance(where.relative_path, str) or not _SHARD_FILE.fullmatch(where.relative_path):
            raise ValueError(f"{index.fqn!r} is stored in {where.relative_path!r}, not a shard file of the directory")
        if not all(isinstance(n, int) and n >= 0 for n in (where.offset, where.length)):
            raise ValueError(f"{index.fqn!r} has offset {where.offset!r} and length {where.length!r}")
        if where.transform_descriptors:  # stream transforms (compression): never written here
            raise ValueError(f"{index.fqn!r} is stored through transforms {where.transform_descriptors!r}")
    return metadata


def read_bytes_items(directory: str | Path, metadata: Metadata) -> dict[str, Any]:
    """Every non-tensor item of a DCP directory, loaded with ``weights_only=True`` (what
    :func:`read_metadata` returned for it): the check a worker makes on its own before the
    workers load the checkpoint together."""
    d = Path(directory)
    items = {}
    for index, where in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            with open(d / where.relative_path, "rb") as f:
                f.seek(where.offset)
                data = f.read(where.length)
            if len(data) != where.length:
                raise EOFError(f"{where.relative_path} ends before {index.fqn!r}")
            items[index.fqn] = _weights_only(io.BytesIO(data))
    return items


def _weights_only(stream: IO[bytes]) -> Any:
    return torch.load(stream, map_location="cpu", weights_only=True)


class Reader(FileSystemReader):
    """DCP's file reader with the metadata read beforehand (by :func:`read_metadata`): the load
    reads no metadata of its own, and a failure to read it comes before any collective."""

    def __init__(self, directory: str | Path, metadata: Metadata):
        super().__init__(directory)
        self._metadata = metadata

    def read_metadata(self) -> Metadata:  # no rank-local fallback: it would unpickle another file
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _WeightsOnlyBytes:
    """A load planner whose non-tensor items are loaded with ``weights_only=True`` (DCP's
    ``DefaultLoadPlanner.load_bytes``, with that one argument changed)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = _weights_only(value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class LoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    """Loads into a given state dict (resharding to it)."""


class WholeLoadPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    """Loads every item of the checkpoint into an empty state dict, as whole tensors."""


def load_into(state: dict[str, Any], directory: str | Path, metadata: Metadata) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` (in place, resharded to it) from a DCP
    directory whose ``metadata`` :func:`read_metadata` returned; with a process group running,
    every worker calls it together. Raises DCP's ``CheckpointException`` with every worker's
    failure."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=Reader(directory, metadata), planner=LoadPlanner())


def load_whole(directory: str | Path, metadata: Metadata) -> dict[str, Any]:
    """Every item of a DCP directory as whole tensors (and plain values), in this process alone."""
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=Reader(directory, metadata), planner=WholeLoadPlanner(), no_dist=True)
    return state
