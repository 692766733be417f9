"""A causal language model (fairseq-style) on bytes of the Python standard library's own source,
or on generated tokens at a GPT-2-sized vocabulary.

``data=bytes`` (the default): the text is on every machine without a download: the ``.py`` files under
``sysconfig.get_paths()["stdlib"]`` (tests and site-packages left out), or any directory named in
``source``. :meth:`LMTask.prepare` cuts each file at line ends into sequences of at most
``max_len`` bytes, splits train and validation by file (a hash of the path), and packs sequences
of similar length into batches of at most ``max_tokens`` padded tokens (fairseq's
``batch_by_size``). Each Parquet row is one such batch (``tokens``: the sequences' bytes
concatenated; ``lengths``: one length per sequence), so ``data.batch_size=1`` row is one
micro-batch of variable shape. The criterion is a sum over target tokens with
``sample_size`` = the number of target tokens, for ``loss.reduction=sum``.

``data=generated``: ``tokens`` training tokens (and ``val_percent`` percent as many for
validation) of the seeded language of :mod:`raytrain_loops.tasks.datasets.tokens` over ``vocab - 1`` ids,
id ``vocab - 1`` being BOS, in sequences of 1 to ``max_len`` tokens packed and stored as above,
each token as a little-endian uint16 (int32 when ``vocab`` exceeds 65536). The embedding and
the head are one tied ``vocab`` x ``dim`` matrix, as in GPT-2.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sysconfig
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from raytrain_loops.config import ConfigError
from raytrain_loops.data.packing import PACKINGS, ROW_END, collate_rows, pack, pack_rows
from raytrain_loops.engine import LossOutput, StepContext
from raytrain_loops.engine.update.micro import split_batch
from raytrain_loops.tasks.base import EvalOutput, ParquetSplit, Task
from raytrain_loops.tasks.datasets.tokens import Language, rng_for
from raytrain_loops.tasks.gpt import ATTENTIONS, GPT, IGNORE

COLUMNS = ["tokens", "lengths"]
BOS = 256  # the input before a sequence's first byte; targets are bytes 0-255 only
LN2 = math.log(2.0)
SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
FORMAT = 1  # bump when the Parquet layout or the cutting rules change (a new cache directory)
GENERATED_FORMAT = 1  # the same for generated tokens (and the language's constants)
DATA = ("bytes", "generated")
GENERATED_DEFAULTS = {"vocab": 50304, "tokens": 10_000_000, "seed": 0}  # 50304: GPT-2's 50257 padded to 64


def source_files(root: Path) -> list[Path]:
    """The ``.py`` files under ``root``, tests and installed packages left out, in a fixed order."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return files


def is_validation(relpath: str, val_percent: float) -> bool:
    """Whether a file belongs to the validation split: a stable hash of its relative path."""
    return zlib.crc32(relpath.encode()) % 10_000 < val_percent * 100


def cut(data: bytes, max_len: int) -> list[bytes]:
    """Cut ``data`` into pieces of at most ``max_len`` bytes, each ending at a line end when the
    window holds one (a longer line is cut where the window ends)."""
    pieces, start = [], 0
    while start < len(data):
        end = min(start + max_len, len(data))
        if end < len(data):
            newline = data.rfind(b"\n", start, end)
            if newline >= start:
                end = newline + 1
        pieces.append(data[start:end])
        start = end
    return pieces


def write_packed(out_dir: Path, split: str, lengths: list[int], piece, max_tokens: int, rng, row_len: int = 0) -> int:
    """Pack the sequences of ``lengths`` (``piece(i)``: sequence ``i``'s token bytes) and write
    ``<split>.parquet`` under a temporary name, then rename it; return the batch count.
    ``row_len``: in rows of that many tokens, every batch of one shape (``fixed`` packing)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if row_len:
        end, tokens_of = len(lengths), piece
        batches = pack_rows(lengths, row_len, max_tokens, end)
        lengths = [*lengths, ROW_END]
        piece = lambda i: b"" if i == end else tokens_of(i)  # noqa: E731
    else:
        batches = pack(lengths, max_tokens)
    order = rng.permutation(len(batches))  # rows in no particular length order
    table = pa.table(
        {
            "tokens": pa.array([b"".join(piece(i) for i in batches[j]) for j in order], pa.binary()),
            "lengths": pa.array([[lengths[i] for i in batches[j]] for j in order], pa.list_(pa.int32())),
        }
    )
    tmp = out_dir / f"{split}.parquet.tmp{os.getpid()}"
    pq.write_table(table, tmp)
    os.replace(tmp, out_dir / f"{split}.parquet")
    return len(batches)


def write_stats(out_dir: Path, stats: dict) -> None:
    """``stats.json``, written last (under a temporary name, then renamed): the mark of a complete set."""
    tmp = out_dir / f"stats.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(stats, indent=1) + "\n")
    os.replace(tmp, out_dir / "stats.json")


def write_lm_parquet(
    source: Path, out_dir: Path, max_len: int, max_tokens: int, val_percent: float, seed: int = 0, row_len: int = 0
) -> dict:
    """Cut, split, pack and write ``train.parquet``, ``valid.parquet`` and ``stats.json`` (last,
    as the marker of a complete write); return the stats. Idempotent."""
    stats_path = out_dir / "stats.json"
    if stats_path.exists():
        return json.loads(stats_path.read_text())
    files = source_files(source)
    if not files:
        raise ConfigError("task.params.source", f"{str(source)!r} holds no .py files")
    pieces: dict[str, list[bytes]] = {"train": [], "valid": []}
    counts = {"train": 0, "valid": 0}
    for path in files:
        split = "valid" if is_validation(path.relative_to(source).as_posix(), val_percent) else "train"
        pieces[split].extend(cut(path.read_bytes(), max_len))
        counts[split] += 1
    for split, n in counts.items():
        if n == 0:
            raise ConfigError(
                "task.params.val_percent",
                f"{val_percent} leaves the {split} split of {source} without a file "
                f"({len(files)} files in all); choose a value that leaves files in both",
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    stats: dict = {"source": str(source), "max_len": max_len, "max_tokens": max_tokens}
    byte_counts = {}
    for split, seqs in pieces.items():
        batches = write_packed(out_dir, split, [len(s) for s in seqs], seqs.__getitem__, max_tokens, rng, row_len)
        data = np.frombuffer(b"".join(seqs), dtype=np.uint8)
        byte_counts[split] = np.bincount(data, minlength=256)
        stats[split] = {"files": counts[split], "sequences": len(seqs), "batches": batches, "tokens": data.size}
    # Unigram baseline: the train byte distribution (add-one smoothed), scored on validation.
    train = byte_counts["train"]
    bits = -np.log2((train + 1) / (train.sum() + 256))
    stats["unigram_bits"] = bits.tolist()
    stats["unigram_valid_bpb"] = float((byte_counts["valid"] * bits).sum() / byte_counts["valid"].sum())
    write_stats(out_dir, stats)
    return stats


def token_dtype(vocab: int) -> str:
    """How a generated token is stored: little-endian uint16 while the ids fit, else int32."""
    return "<u2" if vocab <= 1 << 16 else "<i4"


def write_generated_parquet(
    out_dir: Path,
    vocab: int,
    tokens: int,
    seed: int,
    max_len: int,
    max_tokens: int,
    val_percent: float,
    row_len: int = 0,
) -> dict:
    """Generate, pack and write ``train.parquet`` (``tokens`` tokens), ``valid.parquet``
    (``val_percent`` percent as many) and ``stats.json`` (last); return the stats. Idempotent.

    ``stats.json`` holds per split the sequences, batches and tokens; ``unigram_bits`` (the
    train token distribution, add-one smoothed, in bits per id); ``unigram_valid_bpt`` (those
    bits' mean over the validation tokens); ``floor_valid_bpt`` (the language's own
    ``-log2 P(token | previous)`` over them: no model scores lower, in expectation)."""
    stats_path = out_dir / "stats.json"
    if stats_path.exists():
        return json.loads(stats_path.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    language = Language.make(vocab - 1, seed)
    stats: dict = {"vocab": vocab, "bos": vocab - 1, "seed": seed, "dtype": token_dtype(vocab)}
    stats.update(max_len=max_len, max_tokens=max_tokens)
    sizes = {"train": tokens, "valid": max(1, round(tokens * val_percent / 100))}
    rows_rng = np.random.default_rng(seed)
    counts, drawn = {}, {}
    for stream, (split, n) in enumerate(sizes.items(), start=1):
        data, lengths = drawn[split] = language.sample(rng_for(seed, stream), n, max_len, token_dtype(vocab))
        pieces = _pieces(data, lengths)
        batches = write_packed(out_dir, split, lengths.tolist(), pieces, max_tokens, rows_rng, row_len)
        stats[split] = {"sequences": len(lengths), "batches": batches, "tokens": n}
        counts[split] = np.bincount(data, minlength=vocab - 1)
    bits = -np.log2((counts["train"] + 1) / (counts["train"].sum() + vocab - 1))
    stats["unigram_bits"] = bits.tolist()
    stats["unigram_valid_bpt"] = float((counts["valid"] * bits).sum() / counts["valid"].sum())
    stats["floor_valid_bpt"] = float(language.bits(*_previous_and_token(*drawn["valid"])).mean())
    write_stats(out_dir, stats)
    return stats


def _pieces(data: np.ndarray, lengths: np.ndarray):
    """``piece(i)``: the bytes of sequence ``i`` of the concatenated ``data``."""
    raw, width = data.tobytes(), data.itemsize
    ends = np.cumsum(lengths).tolist()
    starts = [e - n for e, n in zip(ends, lengths.tolist(), strict=True)]
    return lambda i: raw[starts[i] * width : ends[i] * width]


def _previous_and_token(data: np.ndarray, lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token and the one before it (-1 before a sequence's first), as int64 tensors."""
    token = torch.from_numpy(data.astype(np.int64))
    previous = torch.cat([torch.tensor([-1]), token[:-1]])
    previous[torch.from_numpy(np.cumsum(lengths) - lengths)] = -1
    return previous, token


class LMTask(Task):
    """Causal language modelling with fairseq's sample-size normalisation (``loss.reduction=sum``).

    ``data``: ``bytes`` (the stdlib's source, or ``source``) or ``generated`` (``tokens``
    training tokens of a seeded language over ``vocab`` ids, ``vocab - 1`` of them tokens and
    one BOS; ``seed``). ``vocab``, ``tokens`` and ``seed`` are for ``generated`` only,
    ``source`` for ``bytes`` only. ``packing``: ``variable`` (batches shaped by their longest
    sequence) or ``fixed`` (every batch ``max_tokens // max_len`` rows of ``max_len`` tokens,
    sequences end to end, attention masked to each; ``max_tokens`` a multiple of ``max_len``):
    :mod:`raytrain_loops.data.packing`. ``attention`` (``fixed`` packing): how each sequence is kept
    to itself, ``sdpa`` (a boolean mask) or ``flex`` (FlexAttention's block mask: for CUDA with
    ``compile.enabled``, no dropout; :mod:`raytrain_loops.tasks.gpt`). Compiling is
    ``compile.enabled`` (``compile.scope=model`` for the whole model), not a task parameter.

    Metrics, in bits per target unit. Bytes: ``bpb`` (bits per byte) in training; ``eval_bpb``
    and ``eval_unigram_bpb`` (the train byte distribution scored on the same validation bytes)
    at each evaluation. Generated tokens: ``bpt`` (bits per token) in training; ``eval_bpt``,
    ``eval_unigram_bpt`` (the train token distribution on the same validation tokens) and
    ``eval_floor_bpt`` (the language's own ``-log2 P(token | previous)`` on them: the score of
    a perfect model) at each evaluation.
    """

    def __init__(
        self,
        dim: int = 128,
        layers: int = 4,
        heads: int = 4,
        dropout: float = 0.0,
        max_len: int = 256,
        max_tokens: int = 4096,
        val_percent: float = 2.0,
        source: str = "",
        compile: bool | None = None,
        data: str = "bytes",
        vocab: int | None = None,
        tokens: int | None = None,
        seed: int | None = None,
        packing: str = "variable",
        attention: str = "sdpa",
    ):
        if compile is not None:
            raise ConfigError(
                "task.params.compile",
                "is now compile.enabled=true with compile.scope=model (the whole model) or blocks (each block)",
            )
        _check_shape(dim, layers, heads, max_len, max_tokens, val_percent, dropout)
        _check_packing(packing, max_len, max_tokens)
        _check_attention(attention, packing, dropout)
        generated = _check_data(data, source, {"vocab": vocab, "tokens": tokens, "seed": seed})
        self.dim, self.layers, self.heads, self.dropout = dim, layers, heads, dropout
        self.max_len, self.max_tokens, self.val_percent = max_len, max_tokens, val_percent
        self.source = Path(source).expanduser().resolve() if source else Path(sysconfig.get_paths()["stdlib"])
        self.data, self.packing, self.attention = data, packing, attention
        self.row_len = max_len if packing == "fixed" else 0  # fixed: rows of max_len tokens
        self.vocab, self.tokens, self.seed = (generated[k] for k in ("vocab", "tokens", "seed"))
        self.bos = BOS if data == "bytes" else self.vocab - 1
        self.unit = "bpb" if data == "bytes" else "bpt"  # bits per byte, or per token
        self.unigram_bits: list[float] | None = None  # set by prepare(), shipped to the workers with the task
        self._language: Language | None = None

    @property
    def language(self) -> Language | None:
        """The generated data's language (``None`` for bytes), made from ``vocab`` and ``seed``."""
        if self.data == "generated" and self._language is None:
            self._language = Language.make(self.vocab - 1, self.seed)
        return self._language

    def data_subdir(self, data_dir: Path) -> Path:
        """The cache directory of this source and packing (one per distinct setting)."""
        packed = [self.max_len, self.max_tokens, self.val_percent] + (["fixed"] if self.row_len else [])
        if self.data == "generated":
            key = json.dumps([GENERATED_FORMAT, self.vocab, self.tokens, self.seed, *packed])
            return data_dir / "lm" / f"generated-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
        key = json.dumps([FORMAT, str(self.source), *packed])
        return data_dir / "lm" / f"{self.source.name}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"

    def prepare(self, data_dir: Path) -> None:
        if self.data == "generated":
            stats = write_generated_parquet(
                self.data_subdir(data_dir),
                self.vocab,
                self.tokens,
                self.seed,
                self.max_len,
                self.max_tokens,
                self.val_percent,
                self.row_len,
            )
        else:
            if not self.source.is_dir():
                raise ConfigError("task.params.source", f"{str(self.source)!r} is not a directory")
            stats = write_lm_parquet(
                self.source,
                self.data_subdir(data_dir),
                self.max_len,
                self.max_tokens,
                self.val_percent,
                row_len=self.row_len,
            )
        self.unigram_bits = stats["unigram_bits"]

    def splits(self, data_dir: Path) -> dict[str, ParquetSplit]:
        base = self.data_subdir(data_dir)
        return {
            "train": ParquetSplit(str(base / "train.parquet"), COLUMNS),
            "eval": ParquetSplit(str(base / "valid.parquet"), COLUMNS),
        }

    def build_model(self) -> nn.Module:
        return GPT(self.dim, self.layers, self.heads, self.dropout, vocab=self.vocab, attention=self.attention)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)

    def collate(self, batch: dict[str, np.ndarray]) -> tuple:
        """Rows of packed sequences -> right-padded ``(inputs, targets, target token count)``:
        inputs are BOS then the tokens shifted by one, targets the tokens (``IGNORE`` on padding);
        ``fixed`` packing adds each position's sequence number (:func:`collate_rows`)."""
        lengths = np.concatenate([np.asarray(row, dtype=np.int64) for row in batch["lengths"]])
        dtype = np.uint8 if self.data == "bytes" else token_dtype(self.vocab)
        flat = torch.from_numpy(np.frombuffer(b"".join(batch["tokens"]), dtype=dtype).astype(np.int64))
        if self.row_len:
            return collate_rows(lengths, flat, (self.max_tokens // self.max_len, self.max_len), self.bos, IGNORE)
        rows = np.repeat(np.arange(len(lengths)), lengths)
        cols = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        inputs = torch.zeros(len(lengths), int(lengths.max()), dtype=torch.long)
        targets = torch.full_like(inputs, IGNORE)
        targets[rows, cols] = flat
        inputs[:, 0] = self.bos
        shifted = cols < lengths[rows] - 1
        inputs[rows[shifted], cols[shifted] + 1] = flat[shifted]
        return inputs, targets, int(lengths.sum())

    def split_batch(self, batch: Any, parts: int) -> list[Any]:
        """Sequences cut into ``parts`` micro-batches, each with its own token count."""
        inputs, targets, _, *documents = batch
        pieces = split_batch((inputs, targets, *documents), parts)
        return [(i, t, int((t != IGNORE).sum()), *d) for i, t, *d in pieces]

    def criterion(self, model: nn.Module, batch, ctx: StepContext) -> LossOutput:
        inputs, targets, ntokens, *documents = batch
        loss = model(inputs, *documents, targets=targets)  # the model's own loss: compiled with it
        return LossOutput(loss, sample_size=ntokens, logs={self.unit: loss.detach() / (ntokens * LN2)})

    def evaluate(self, model: nn.Module, batch) -> EvalOutput:
        inputs, targets, ntokens, *documents = batch
        nll = model(inputs, *documents, targets=targets)  # the criterion's loss, in fp32
        out = {self.unit: (nll / (ntokens * LN2), ntokens), "loss": (nll / ntokens, ntokens)}
        real = targets != IGNORE
        if self.unigram_bits is not None:
            bits = torch.tensor(self.unigram_bits, device=targets.device)[targets[real]]
            out[f"unigram_{self.unit}"] = (bits.sum() / ntokens, ntokens)
        if self.language is not None:
            out["floor_bpt"] = (self.language.bits(inputs[real], targets[real]).sum() / ntokens, ntokens)
        return out


def _check_shape(
    dim: int, layers: int, heads: int, max_len: int, max_tokens: int, val_percent: float, dropout: float
) -> None:
    for key, value, low in (("dim", dim, 1), ("layers", layers, 1), ("heads", heads, 1), ("max_len", max_len, 2)):
        if value < low:
            raise ConfigError(f"task.params.{key}", f"must be >= {low}; got {value}")
    if dim % heads:
        raise ConfigError("task.params.dim", f"{dim} is not a multiple of task.params.heads={heads}")
    if max_tokens < max_len:
        raise ConfigError("task.params.max_tokens", f"{max_tokens} is less than task.params.max_len={max_len}")
    if not 0 < val_percent < 100:
        raise ConfigError("task.params.val_percent", f"must be in (0, 100); got {val_percent}")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError("task.params.dropout", f"must be in [0, 1); got {dropout}")


def _check_attention(attention: str, packing: str, dropout: float) -> None:
    if attention not in ATTENTIONS:
        raise ConfigError("task.params.attention", f"must be one of {', '.join(ATTENTIONS)}; got {attention!r}")
    if attention == "flex" and packing != "fixed":
        raise ConfigError("task.params.attention", "flex masks rows of several sequences: it needs task.params.packing=fixed")
    if attention == "flex" and dropout:
        raise ConfigError("task.params.attention", f"flex takes no attention dropout; task.params.dropout is {dropout}")


def _check_packing(packing: str, max_len: int, max_tokens: int) -> None:
    if packing not in PACKINGS:
        raise ConfigError("task.params.packing", f"must be one of {', '.join(PACKINGS)}; got {packing!r}")
    if packing == "fixed" and max_tokens % max_len:
        raise ConfigError(
            "task.params.max_tokens",
            f"{max_tokens} is not a multiple of task.params.max_len={max_len}: packing=fixed fills rows of max_len",
        )


def _check_data(data: str, source: str, generated: dict) -> dict:
    """The generated data's settings, defaults filled in (all ``None`` for bytes); an error naming
    the key for an unknown ``data``, a setting of the other kind of data, or a bad value."""
    if data not in DATA:
        raise ConfigError("task.params.data", f"must be one of {', '.join(DATA)}; got {data!r}")
    if data == "bytes":
        for key, value in generated.items():
            if value is not None:
                raise ConfigError(
                    f"task.params.{key}", "is for task.params.data=generated; data is bytes (256 byte values)"
                )
        return generated
    if source:
        raise ConfigError("task.params.source", "is for task.params.data=bytes; data is generated")
    filled = {k: GENERATED_DEFAULTS[k] if v is None else v for k, v in generated.items()}
    for key, low in (("vocab", 2), ("tokens", 1), ("seed", 0)):
        if not isinstance(filled[key], int) or isinstance(filled[key], bool) or filled[key] < low:
            raise ConfigError(f"task.params.{key}", f"must be an integer >= {low}; got {filled[key]!r}")
    if filled["vocab"] > 1 << 31:
        raise ConfigError("task.params.vocab", f"must be at most 2**31 (ids stored as int32); got {filled['vocab']}")
    return filled
