"""Text for the ``hf_lm`` task, without a network: documents from JSONL or Parquet files (or the Python
standard library's source), a byte-level BPE trained on them with Hugging Face ``tokenizers``
(cached by its inputs), and the one-off packing of the documents into rows of text that each
tokenize to one training sequence (written to Parquet, cached by its inputs).

The rows are tokenized again in ``Task.preprocess``, in preprocessing tasks. A tokenizer and a
model's configuration and weights travel as their files' contents (``{name: bytes}``), never as a
directory on the driver: :func:`tokenizer_from` and :func:`model_from` load them anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from raytrain_loops.config import ConfigError

EOS = "<|endoftext|>"
FORMAT = 3  # bump when the packing rules or the row layout change (a new cache directory)
# A tokenizer directory's files that AutoTokenizer reads for a fast tokenizer (tokenizer.json
# holds the whole of it; the rest its class, special tokens and chat template).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
CONFIG_FILES = ("config.json", "generation_config.json")  # what a model's weights are read with
WEIGHTS_INDEX = "model.safetensors.index.json"  # the file list of weights in several shards
BIN_WEIGHTS, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"  # older directories' weights
# Weights in formats not read here: a directory holding only these is refused, never trained from scratch.
OTHER_WEIGHTS = ("*.h5", "*.msgpack", "*.ckpt", "*.pt", "*.pth", "*.gguf", "pytorch_model-*.bin")


def require_hf() -> None:
    """The ``hf`` extra's libraries, or an error that says which extra to install. No hub setting
    of the process is changed (a caller's later downloads work): every load here passes
    ``local_files_only=True`` instead."""
    missing = []
    for module in ("transformers", "tokenizers", "safetensors"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ConfigError(
            "task.name",
            f"hf_lm needs {', '.join(missing)}: install the hf extra, pip install 'raytrain-loops[hf]'",
        )


def _files(paths: list[str], key: str) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if path.is_dir():
            out.extend(sorted(f for f in path.rglob("*") if f.suffix in (".jsonl", ".parquet")))
        elif path.is_file():
            out.append(path)
        else:
            raise ConfigError(key, f"{p!r} is neither a file nor a directory")
    if not out:
        raise ConfigError(key, f"no .jsonl or .parquet file in {paths}")
    return out


def read_documents(paths: list[str], text_key: str, key: str) -> list[str]:
    """Every document of ``paths`` (JSONL lines or Parquet rows; directories searched for both),
    in a fixed order. An empty document (``""`` or null) is left out in both formats; anything
    else that is not a string (a line that is not a JSON object, invalid JSON, a number, a column
    of another type) is an error naming ``key``, the file and the line or column."""
    docs: list[str] = []
    for f in _files(paths, key):
        read = _parquet_documents if f.suffix == ".parquet" else _jsonl_documents
        docs.extend(read(f, text_key, key))
    return docs


def _parquet_documents(f: Path, text_key: str, key: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(f)
    if text_key not in table.column_names:
        raise ConfigError("task.params.text_key", f"{str(f)!r} has no column {text_key!r}")
    column = table.column(text_key)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ConfigError(key, f"{str(f)!r} column {text_key!r} is {column.type}, not text")
    return [t for t in column.to_pylist() if t]


def _jsonl_documents(f: Path, text_key: str, key: str) -> list[str]:
    try:
        lines = f.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ConfigError(key, f"{str(f)!r} is not UTF-8 ({err.reason} at byte {err.start})") from None
    docs = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(key, f"{str(f)!r} line {n}: not valid JSON ({err.msg}, column {err.colno})") from None
        if not isinstance(row, dict):
            raise ConfigError(key, f"{str(f)!r} line {n}: not a JSON object (a {type(row).__name__})")
        if text_key not in row:
            raise ConfigError("task.params.text_key", f"{str(f)!r} line {n} has no key {text_key!r}")
        text = row[text_key]
        if text is not None and not isinstance(text, str):
            raise ConfigError(key, f"{str(f)!r} line {n}: {text_key!r} is {type(text).__name__}, not a string")
        if text:
            docs.append(text)
    return docs


def stdlib_documents(val_percent: float) -> tuple[list[str], list[str]]:
    """The standard library's ``.py`` files as documents, split by a hash of their path (the
    ``lm`` task's split)."""
    from raytrain_loops.tasks.lm import is_validation, source_files

    root = Path(sysconfig.get_paths()["stdlib"])
    train, valid = [], []
    for f in source_files(root):
        text = f.read_text(encoding="utf-8", errors="replace")
        (valid if is_validation(str(f.relative_to(root)), val_percent) else train).append(text)
    return train, valid


def stamps(paths: list[str]) -> list[tuple[str, int, int]]:
    """(path, size, modification time) of every file under ``paths``: a cache key that changes
    when a file does."""
    out = []
    for p in paths:
        root = Path(p).expanduser()
        for f in sorted(root.rglob("*")) if root.is_dir() else [root]:
            if f.is_file():
                st = f.stat()
                out.append((str(f.resolve()), st.st_size, st.st_mtime_ns))
    return out


def digest(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else json.dumps(p, sort_keys=True).encode())
    return h.hexdigest()[:10]


def train_bpe(docs: list[str], vocab_size: int, out: Path) -> Path:
    """A byte-level BPE of ``vocab_size`` tokens (``EOS`` among them) trained on ``docs``, saved
    as a Hugging Face tokenizer directory ``out`` (written under a temporary name, then renamed);
    returned as is when it exists."""
    if (out / "tokenizer.json").exists():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    fast.save_pretrained(str(tmp))
    os.replace(tmp, out)
    return out


def chunks(tokenizer: Any, docs: list[str], max_len: int) -> Iterator[str]:
    """The documents, the tokenizer's end-of-text token after each, cut into pieces of at most
    ``max_len + 1`` tokens (the inputs and the targets shifted by one): each piece's text, the
    end token as its literal, which the tokenizer reads back as the one token. A piece ends
    between characters: when a character's tokens (a byte-level BPE splits a multi-byte one)
    would straddle a piece's end, the piece ends before it, a few tokens short, so that no
    character is in two pieces."""
    eos, size = tokenizer.eos_token, max_len + 1
    text: list[str] = []
    held = 0
    for doc in docs:
        offsets = [*tokenizer(doc, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"], None]
        i = pos = 0  # the next token, and the character where the next piece's text starts
        while i < len(offsets):
            room = size - held
            n = _whole_characters(offsets, i, room) or (room if held == 0 else 0)
            if n:
                part = offsets[i : i + n]  # None: the end token after the document
                end = len(doc) if part[-1] is None else part[-1][1]
                text.append(doc[pos:end] + (eos if part[-1] is None else ""))
                held, i, pos = held + n, i + n, end
            if held == size or (n < room and i < len(offsets)):  # full, or the next character does not fit
                yield "".join(text)
                text, held = [], 0
    if held > 1:
        yield "".join(text)


def _whole_characters(offsets: list[Any], i: int, room: int) -> int:
    """How many of the tokens from ``i`` on (at most ``room``) end on a character boundary: a
    token that begins before the previous one ends shares a character with it."""
    n = min(room, len(offsets) - i)
    if i + n == len(offsets):
        return n
    while n > 0 and None not in (offsets[i + n - 1], offsets[i + n]) and offsets[i + n][0] < offsets[i + n - 1][1]:
        n -= 1
    return n


def write_rows(tokenizer: Any, docs: list[str], max_len: int, path: Path) -> int:
    """The packed rows of ``docs`` (:func:`chunks`) as ``path``, a Parquet file of one ``text``
    column in row groups of 128 (written under a temporary name, then renamed); returns the row
    count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = list(chunks(tokenizer, docs, max_len))
    if not rows:
        raise ConfigError("task.params.text", f"no text to train on for {path.name}")
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    pq.write_table(pa.table({"text": rows}), tmp, row_group_size=128)
    os.replace(tmp, path)
    return len(rows)


def read_files(directory: str, names: tuple[str, ...]) -> dict[str, bytes]:
    """The contents of the files of ``directory`` among ``names`` (those present)."""
    root = Path(directory)
    return {n: (root / n).read_bytes() for n in names if (root / n).is_file()}


def weight_names(directory: str) -> list[str]:
    """The weight files of a model directory that :func:`weight_files` reads: its safetensors,
    else its ``pytorch_model.bin`` (or the shards its index names); none for a directory with a
    config only. Weights only in a format not read here are an error naming
    ``task.params.model``: never a model trained from random weights in their place."""
    root = Path(directory)
    names = sorted(f.name for f in root.glob("*.safetensors"))
    if names:
        return names
    if (root / BIN_INDEX).is_file():
        try:
            return sorted(set(json.loads((root / BIN_INDEX).read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError("task.params.model", f"{root / BIN_INDEX} has no readable weight_map ({err!r})") from None
    if (root / BIN_WEIGHTS).is_file():
        return [BIN_WEIGHTS]
    other = sorted({f.name for pattern in OTHER_WEIGHTS for f in root.glob(pattern)})
    if other:
        raise ConfigError(
            "task.params.model",
            f"{directory} holds weights in {', '.join(other)}, which are not read here: give it the weights as "
            "safetensors or pytorch_model.bin (or remove them to train from scratch)",
        )
    return []


def weight_files(directory: str) -> dict[str, bytes]:
    """The weights of a model directory as safetensors, by name: its safetensors files (and their
    index, when sharded), or its ``pytorch_model.bin`` read with ``torch.load(weights_only=True)``
    (nothing in it runs) and carried as one ``model.safetensors``; empty when it has none."""
    names = weight_names(directory)
    if not names or names[0].endswith(".safetensors"):
        return read_files(directory, (*names, WEIGHTS_INDEX)) if names else {}
    return {"model.safetensors": _bin_as_safetensors(Path(directory), names)}


def _bin_as_safetensors(root: Path, names: list[str]) -> bytes:
    import torch
    from safetensors.torch import save

    state: dict[str, Any] = {}
    for name in names:
        try:
            part = torch.load(root / name, map_location="cpu", weights_only=True)
        except Exception as err:  # weights_only refuses anything but tensors and plain containers
            lines = str(err).splitlines() or [type(err).__name__]
            why = next((line for line in lines if "Unsupported" in line), lines[0]).split(" was not an allowed")[0]
            raise ConfigError(
                "task.params.model",
                f"{root / name} cannot be read as weights only (torch.load weights_only=True: {why.strip()[:200]}); "
                "save the model's weights as safetensors",
            ) from None
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise ConfigError("task.params.model", f"{root / name} is not a state dict of tensors")
        state.update(part)
    # Tied weights share one storage, which safetensors refuses: a storage seen before is copied.
    seen: set[int] = set()
    for key, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen or not tensor.is_contiguous():
            state[key] = tensor.contiguous().clone()
        seen.add(ptr)
    return save(state, metadata={"format": "pt"})


def files_digest(files: dict[str, bytes]) -> str:
    """SHA-256 of ``{name: bytes}``, names and contents."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\0{len(files[name])}\0".encode())
        h.update(files[name])
    return h.hexdigest()


@contextmanager
def materialized(files: dict[str, bytes]) -> Iterator[str]:
    """A local temporary directory holding ``files`` (for ``from_pretrained``), removed after."""
    with tempfile.TemporaryDirectory(prefix="raytrain-hf-") as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        yield tmp


_TOKENIZERS: dict[str, Any] = {}


def tokenizer_from(files: dict[str, bytes]) -> Any:
    """The tokenizer whose files are ``files``, loaded once per process (a preprocessing task's process
    preprocesses many windows, each with its own unpickled copy of the task)."""
    key = files_digest(files)
    if key not in _TOKENIZERS:
        from transformers import AutoTokenizer

        with materialized(files) as tmp:
            tokenizer = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        if len(_TOKENIZERS) >= 4:
            del _TOKENIZERS[next(iter(_TOKENIZERS))]  # the oldest
        _TOKENIZERS[key] = tokenizer
    return _TOKENIZERS[key]


def model_from(config_files: dict[str, bytes], weights: dict[str, bytes]) -> Any:
    """The causal LM of ``config_files`` (``config.json``, ...), its ``weights`` loaded when any
    (safetensors only: nothing read runs code), else freshly initialised."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with materialized({**config_files, **weights}) as tmp:
        if weights:
            return AutoModelForCausalLM.from_pretrained(tmp, local_files_only=True, use_safetensors=True)
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp, local_files_only=True))


def config_json(config: Any) -> bytes:
    """A ``transformers`` config as ``config.json``'s bytes, stable across library versions that
    build the same model (the version that wrote it left out)."""
    data = config.to_dict()
    data.pop("transformers_version", None)
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def rows_digest(paths: list[Path]) -> str:
    """SHA-256 of the packed rows' text in ``paths`` (each row's UTF-8 bytes and length, in order):
    the same rows give the same digest whatever the Parquet writer's version."""
    import pyarrow.parquet as pq

    h = hashlib.sha256()
    for path in paths:
        h.update(f"{path.name}\0".encode())
        for batch in pq.ParquetFile(path).iter_batches(columns=["text"], batch_size=4096):
            for text in batch.column(0).to_pylist():
                data = text.encode()
                h.update(len(data).to_bytes(8, "little"))
                h.update(data)
    return h.hexdigest()
