"""Any Hugging Face ``transformers`` causal language model, trained or fine-tuned through this
loop (fairseq's normalisation by target tokens over all workers, exact resume, the engine's
non-finite and OOM decisions) on a user's own text, with a real tokenizer.

``model``: a local model directory (``config.json``; its weights, when present, are loaded:
fine-tuning; safetensors, or ``pytorch_model.bin`` read as weights only, other formats refused)
or an inline config (``model_type`` and its fields: training from scratch).
``tokenizer``: a local tokenizer directory, or ``{train: {vocab_size: N}}``, a byte-level BPE
trained on the training text once on the driver (cached by its inputs). ``text``: ``{train:
[files or directories], eval: [...]}`` of JSONL or Parquet (the text under ``text_key``), or, empty, the Python
standard library's source (the ``lm`` recipe's text). :meth:`prepare` packs the documents, an
``EOS`` after each, into rows of text that tokenize to ``max_len + 1`` tokens (a Parquet file per
split, cached); :meth:`preprocess` tokenizes each row in preprocessing tasks; the criterion sums the
cross-entropy over target tokens (``loss.reduction=sum``), padding masked. A batch counts its
target tokens and bytes per row, so ``accum.micro_batch=auto`` cuts it along its rows. Metrics: ``loss`` per
token and ``bpb``, bits per byte of the original text (comparable across tokenizers and with the
``lm`` recipe's). No network access: every load passes ``local_files_only``, and no hub setting of
the process is changed.

Across nodes: :meth:`prepare` reads the tokenizer's files and the model directory's config and
weights (as safetensors) on the driver, and the task carries their contents, never a driver path. The
copy shipped to every preprocessing task (:meth:`preprocessing_copy`) holds the tokenizer
only; the weights reach the training workers with the train function, which Ray Train puts in
the object store once. :meth:`artefacts` (the tokenizer, the model's config) and
:meth:`data_digest` (the packed rows) are pinned in the run directory at its first start.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from raytrain_loops.config import ConfigError
from raytrain_loops.engine import LossOutput, StepContext
from raytrain_loops.tasks.base import EvalOutput, ParquetSplit, Task
from raytrain_loops.tasks.hf_text import (
    CONFIG_FILES,
    FORMAT,
    TOKENIZER_FILES,
    config_json,
    digest,
    materialized,
    model_from,
    read_documents,
    read_files,
    require_hf,
    rows_digest,
    stamps,
    stdlib_documents,
    tokenizer_from,
    train_bpe,
    weight_files,
    weight_names,
    write_rows,
)

IGNORE = -100
LN2 = math.log(2.0)
# GPT-2's shape at a size a CPU trains: the recipe's default model.
SMALL_GPT2 = {"model_type": "gpt2", "n_embd": 128, "n_layer": 4, "n_head": 4, "n_positions": 512}


class HFLMTask(Task):
    """A ``transformers`` causal LM on packed text (see the module's docstring for the params)."""

    def __init__(
        self,
        model: str | dict = SMALL_GPT2,
        tokenizer: str | dict | None = None,
        text: dict | None = None,
        text_key: str = "text",
        max_len: int = 256,
        val_percent: float = 2.0,
    ):
        require_hf()
        self.model = model if isinstance(model, dict) else str(Path(model).expanduser().resolve())
        if tokenizer is None:  # a model directory's own tokenizer, else a BPE trained on the text
            own = not isinstance(model, dict) and (Path(self.model) / "tokenizer.json").exists()
            tokenizer = self.model if own else {"train": {"vocab_size": 4096}}
        self.tokenizer = tokenizer
        self.text, self.text_key = dict(text or {}), text_key
        self.max_len, self.val_percent = max_len, val_percent
        _check(self.model, self.tokenizer, self.text, max_len)
        # Set by prepare() on the driver and shipped with the task, by content:
        self.tokenizer_files: dict[str, bytes] = {}  # the tokenizer directory's files
        self.model_files: dict[str, bytes] = {}  # config.json (and generation_config.json)
        self._weights: dict[str, bytes] = {}  # the model directory's weights, as safetensors: training workers only
        self._rows_digest: str | None = None
        self.vocab_size = 0
        self.eos_id = 0
        self._tok = None

    # ------------------------------------------------------------------ data, on the driver

    def _documents(self) -> tuple[list[str], list[str]]:
        if not self.text:
            return stdlib_documents(self.val_percent)
        train = read_documents(list(self.text["train"]), self.text_key, "task.params.text.train")
        if self.text.get("eval"):
            return train, read_documents(list(self.text["eval"]), self.text_key, "task.params.text.eval")
        cut = max(1, int(len(train) * self.val_percent / 100))
        return train[cut:], train[:cut]

    def _inputs(self) -> list:
        """What the tokenizer and the packed rows are made from: the text files (and a tokenizer
        directory) with their sizes and modification times, so that an edited file is read again."""
        files = [*self.text.get("train", []), *self.text.get("eval", [])]
        named = [self.tokenizer] if isinstance(self.tokenizer, str) else []
        return [FORMAT, self.text, self.text_key, self.val_percent, self.tokenizer, stamps(files + named)]

    def data_subdir(self, data_dir: Path) -> Path:
        return data_dir / "hf_lm" / f"{digest(*self._inputs(), self.max_len)}"

    def tokenizer_at(self, data_dir: Path, train_docs: list[str] | None = None) -> str:
        """The tokenizer's directory: the one named, or the BPE trained on the training text
        (trained now when ``train_docs`` are given and it is not cached)."""
        if isinstance(self.tokenizer, str):
            return str(Path(self.tokenizer).expanduser().resolve())
        out = data_dir / "hf_lm" / f"bpe-{digest(*self._inputs())}"
        if train_docs is not None:
            train_bpe(train_docs, int(self.tokenizer["train"]["vocab_size"]), out)
        if not (out / "tokenizer.json").exists():
            raise ConfigError("task.params.tokenizer", f"no trained tokenizer in {out}: run the task's prepare first")
        return str(out)

    def load_tokenizer(self, path: str) -> None:
        """Use the fast tokenizer of the directory ``path``, carried from now on by content."""
        files = read_files(path, TOKENIZER_FILES)
        if "tokenizer.json" not in files:
            raise ConfigError("task.params.tokenizer", f"{path} has no fast (tokenizers) tokenizer.json")
        tok = tokenizer_from(files)
        if not tok.is_fast:
            raise ConfigError("task.params.tokenizer", f"{path} has no fast (tokenizers) tokenizer.json")
        if tok.eos_token is None or tok.eos_token_id is None:
            raise ConfigError("task.params.tokenizer", f"{path} has no end-of-text token (eos_token) to put between documents")
        self.tokenizer_files, self.vocab_size, self.eos_id = files, len(tok), tok.eos_token_id
        self._tok = tok

    def prepare(self, data_dir: Path) -> None:
        out = self.data_subdir(data_dir)
        done = (out / "train.parquet").exists() and (out / "valid.parquet").exists()
        docs = None if done and not isinstance(self.tokenizer, dict) else self._documents()
        self.load_tokenizer(self.tokenizer_at(data_dir, docs[0] if docs else None))
        self._read_model()
        if not done:
            out.mkdir(parents=True, exist_ok=True)
            for split, split_docs in zip(("train", "valid"), docs, strict=True):
                write_rows(self._tok, split_docs, self.max_len, out / f"{split}.parquet")
        self._rows_digest = rows_digest([out / "train.parquet", out / "valid.parquet"])

    def _read_model(self) -> None:
        """The model's config files and weights, read once on the driver (a model directory) or
        built from the inline config and the tokenizer's size."""
        self.model_files = self._config_files()
        if isinstance(self.model, dict):
            return
        from transformers import AutoConfig

        with materialized(self.model_files) as tmp:
            size = AutoConfig.from_pretrained(tmp, local_files_only=True).vocab_size
        if self.vocab_size > size:
            raise ConfigError(
                "task.params.tokenizer", f"has {self.vocab_size} tokens, more than the {size} of the model in {self.model}"
            )
        self._weights = weight_files(self.model)

    def _config_files(self) -> dict[str, bytes]:
        if not isinstance(self.model, dict):
            return read_files(self.model, CONFIG_FILES)
        from transformers import AutoConfig

        fields = {k: v for k, v in self.model.items() if k != "model_type"}
        config = AutoConfig.for_model(self.model["model_type"], **fields)
        if self.vocab_size:  # the tokenizer's size, rounded up to 64 (a multiple that suits matmuls)
            config.vocab_size = -(-self.vocab_size // 64) * 64
        config.eos_token_id = config.bos_token_id = config.pad_token_id = self.eos_id
        return {"config.json": config_json(config)}

    # ------------------------------------------------------------------ pinned to the run

    def artefacts(self) -> dict[str, bytes]:
        """The tokenizer's files (``tokenizer/...``) and the model's configuration (``model/...``):
        what the weights were trained with, and what ``export --format hf`` writes beside them."""
        if not self.tokenizer_files:
            raise ConfigError("task.params.tokenizer", "no tokenizer yet: the task's prepare has not run")
        return {
            **{f"tokenizer/{n}": b for n, b in self.tokenizer_files.items()},
            **{f"model/{n}": b for n, b in self.model_files.items()},
        }

    def data_digest(self) -> str | None:
        """SHA-256 of the packed rows of both splits (set by :meth:`prepare`)."""
        return self._rows_digest

    def preprocessing_copy(self) -> HFLMTask:
        """The tokenizer by content, max_len and the end token: none of the weights, nor the
        driver's paths (the model directory, the text files, a tokenizer directory)."""
        out = copy.copy(self)
        out._weights, out.model_files, out.text, out._tok = {}, {}, {}, None
        out.model = self.model if isinstance(self.model, dict) else ""
        out.tokenizer = self.tokenizer if isinstance(self.tokenizer, dict) else ""
        return out

    def splits(self, data_dir: Path) -> dict[str, ParquetSplit]:
        base = self.data_subdir(data_dir)
        return {
            "train": ParquetSplit(str(base / "train.parquet"), ["text"]),
            "eval": ParquetSplit(str(base / "valid.parquet"), ["text"]),
        }

    # ------------------------------------------------------------------ on the workers

    def _tokenizer(self):
        if self._tok is None:
            if not self.tokenizer_files:
                raise ConfigError("task.params.tokenizer", "no tokenizer: the task's prepare has not run")
            self._tok = tokenizer_from(self.tokenizer_files)
        return self._tok

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tok": None}  # loaded again where it is used

    def preprocess(self, batch: dict[str, np.ndarray], train: bool) -> dict[str, np.ndarray]:
        """Each row's text tokenized into ``max_len + 1`` ids (right-padded with the end token;
        ``n``: how many are real), and the bytes of text its targets cover (``bytes``: from the
        first target's start to the last's end, the end-of-text literals counting none)."""
        size, tok = self.max_len + 1, self._tokenizer()
        texts = [str(t) for t in batch["text"]]
        enc = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.full((len(texts), size), self.eos_id, dtype=np.int32)
        n = np.zeros(len(texts), dtype=np.int32)
        covered = np.zeros(len(texts), dtype=np.int64)
        eos, eos_bytes = tok.eos_token, len(tok.eos_token.encode())
        for i, (row, offsets) in enumerate(zip(enc["input_ids"], enc["offset_mapping"], strict=True)):
            row = row[:size]
            ids[i, : len(row)], n[i] = row, len(row)
            if len(row) > 1:
                span = texts[i][offsets[1][0] : offsets[len(row) - 1][1]]
                covered[i] = len(span.encode()) - span.count(eos) * eos_bytes
        return {"ids": ids, "n": n, "bytes": covered}

    def collate(self, batch: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        """``(inputs, targets, target tokens, target bytes)``, the counts per row (lists of ints,
        which stay on the host): every part carries the rows, so ``accum.micro_batch=auto`` cuts
        a batch into micro-batches that count their own tokens and bytes. Targets past a row's
        end are IGNORE."""
        ids = torch.as_tensor(np.stack(batch["ids"]).astype(np.int64))
        n = torch.as_tensor(np.asarray(batch["n"], dtype=np.int64))
        inputs, targets = ids[:, :-1], ids[:, 1:].clone()
        targets[torch.arange(targets.shape[1]) >= (n - 1).unsqueeze(1)] = IGNORE
        return inputs, targets, (targets != IGNORE).sum(1).tolist(), np.asarray(batch["bytes"], dtype=np.int64).tolist()

    def build_model(self) -> nn.Module:
        """The model from the files :meth:`prepare` read (its weights when the directory had any);
        before it, on the driver (the blocks' check), the architecture from the param alone."""
        return model_from(self.model_files or self._config_files(), self._weights)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The transformer layers, found from the model: the modules of the classes its
        ``_no_split_modules`` names (what ``transformers`` itself keeps whole), else the
        children of its largest list of modules of one class."""
        names = set(getattr(model, "_no_split_modules", None) or [])
        found = [m for m in model.modules() if type(m).__name__ in names]
        if found:
            return found
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len({type(c) for c in m}) == 1]
        if not lists:
            return []
        return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))

    def criterion(self, model: nn.Module, batch, ctx: StepContext) -> LossOutput:
        inputs, targets, ntokens, nbytes = _counted(batch)
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")
        # Weighted by the bytes, not the tokens: over an interval, the sum of nll over the sum of bytes.
        logs = {"bpb": (loss.detach() / (max(nbytes, 1) * LN2), nbytes)}
        return LossOutput(loss, sample_size=ntokens, logs=logs)

    def evaluate(self, model: nn.Module, batch) -> EvalOutput:
        inputs, targets, ntokens, nbytes = _counted(batch)
        logits = model(input_ids=inputs).logits.float()
        nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
        return {"loss": (nll / max(ntokens, 1), ntokens), "bpb": (nll / (max(nbytes, 1) * LN2), nbytes)}


def _counted(batch) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """A batch's inputs and targets, and its target tokens and bytes summed over its rows."""
    inputs, targets, tokens, covered = batch
    return inputs, targets, sum(tokens), sum(covered)


def _check(model: Any, tokenizer: Any, text: dict, max_len: int) -> None:
    if isinstance(model, dict):
        if "model_type" not in model:
            raise ConfigError("task.params.model", "an inline config needs model_type (gpt2, llama, ...)")
    elif not Path(model).is_dir():
        raise ConfigError("task.params.model", f"{model!r}: no such directory (a local model directory, or an inline config)")
    elif not (Path(model) / "config.json").exists():
        raise ConfigError("task.params.model", f"{model!r} has no config.json (a local model directory)")
    elif weight_names(model) and isinstance(tokenizer, dict):
        raise ConfigError(
            "task.params.tokenizer",
            f"a new tokenizer's ids mean nothing to the trained weights in {model}: name the model's own tokenizer "
            "directory (or leave task.params.tokenizer out when the model directory holds one)",
        )
    if isinstance(tokenizer, dict):
        size = tokenizer.get("train", {}).get("vocab_size") if isinstance(tokenizer.get("train"), dict) else None
        if not isinstance(size, int) or size < 300:
            raise ConfigError("task.params.tokenizer", f"train needs vocab_size, an integer >= 300; got {tokenizer}")
    elif not Path(tokenizer).expanduser().is_dir():
        raise ConfigError("task.params.tokenizer", f"{tokenizer!r}: no such directory (a local tokenizer directory)")
    elif not (Path(tokenizer).expanduser() / "tokenizer.json").exists():
        raise ConfigError("task.params.tokenizer", f"{tokenizer!r} has no tokenizer.json (a local tokenizer directory)")
    unknown = set(text) - {"train", "eval"}
    if unknown or (text and "train" not in text):
        raise ConfigError("task.params.text", f"takes train and eval (lists of files or directories); got {sorted(text)}")
    if max_len < 2:
        raise ConfigError("task.params.max_len", f"must be >= 2; got {max_len}")
    if not isinstance(model, dict):
        _check_vocab(model, tokenizer)


def _check_vocab(model: str, tokenizer: str | dict) -> None:
    """A tokenizer larger than the model directory's vocabulary refused from the files alone, as
    the task is built: before a BPE is trained, Ray starts or a tracking run exists (the size a
    BPE is asked for; a tokenizer directory's tokens, its added ones among them)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError("task.params.model", f"{model}/config.json is not valid JSON ({err})") from None
    size = config.get("vocab_size") if isinstance(config, dict) else None
    if not isinstance(size, int):
        return  # not at the top of the config: checked once the tokenizer is loaded
    if isinstance(tokenizer, dict):
        tokens = int(tokenizer["train"]["vocab_size"])
    else:
        from tokenizers import Tokenizer

        path = Path(tokenizer).expanduser() / "tokenizer.json"
        try:
            tokens = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
        except Exception as err:  # the tokenizers library's own parse error
            raise ConfigError("task.params.tokenizer", f"{path} cannot be read as a tokenizer ({err})") from None
    if tokens > size:
        raise ConfigError("task.params.tokenizer", f"has {tokens} tokens, more than the {size} of the model in {model}")
