"""Packed language-model batches, one Parquet row each.

``variable``: sequences of similar length in a batch of at most ``max_tokens`` padded tokens, its
shape set by its longest (:func:`pack`, fairseq's ``batch_by_size``). ``fixed``: whole sequences end
to end in rows of ``max_len`` tokens, ``max_tokens // max_len`` rows a batch, so that every batch
has the one shape ``(max_tokens // max_len, max_len)`` and a compiled step builds its graphs once
(:func:`pack_rows`, :func:`collate_rows`); attention is kept inside each sequence by a mask."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["PACKINGS", "ROW_END", "collate_rows", "pack", "pack_rows"]

PACKINGS = ("variable", "fixed")
ROW_END = 0
"""In a ``fixed`` batch's lengths, where a row ends (a sequence has at least one token)."""


def pack(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices into batches of similar length whose padded size (rows x longest)
    is at most ``max_tokens``, shortest first (fairseq's ``batch_by_size``)."""
    batches: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        if current and (len(current) + 1) * lengths[i] > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def pack_rows(lengths: list[int], max_len: int, max_tokens: int, end: int) -> list[list[int]]:
    """Sequence indices in rows of at most ``max_len`` tokens, ``max_tokens // max_len`` rows a
    batch, each row followed by ``end`` (the index that stands for :data:`ROW_END`). The longest
    sequence left opens a row; the shortest left fill it while they fit."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows, lo, hi = [], 0, len(order) - 1
    while lo <= hi:
        row, space = [order[lo]], max_len - lengths[order[lo]]
        lo += 1
        while lo <= hi and lengths[order[hi]] <= space:
            row.append(order[hi])
            space -= lengths[order[hi]]
            hi -= 1
        rows.append(row)
    per = max_tokens // max_len
    return [[i for row in rows[b : b + per] for i in (*row, end)] for b in range(0, len(rows), per)]


def collate_rows(
    lengths: np.ndarray, flat: torch.Tensor, shape: tuple[int, int], bos: int, ignore: int
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """A ``fixed`` batch (``lengths`` with :data:`ROW_END` after each row, ``flat`` its tokens)
    -> ``(inputs, targets, target count, documents)`` of ``shape``: inputs are BOS then each
    sequence's tokens shifted by one, targets the tokens (``ignore`` elsewhere), documents each
    position's sequence number (0: padding), which the model's attention mask keeps apart."""
    ends = lengths == ROW_END
    row_of = (np.cumsum(ends) - ends)[~ends]  # each sequence's row
    seq = lengths[~ends]
    starts = np.cumsum(seq) - seq  # in the batch's tokens
    opens = np.r_[True, row_of[1:] != row_of[:-1]] if len(seq) else np.zeros(0, bool)
    offset = starts - np.maximum.accumulate(np.where(opens, starts, 0))  # in its row
    rows = np.repeat(row_of, seq)
    cols = np.repeat(offset, seq) + np.arange(len(flat)) - np.repeat(starts, seq)
    inputs = torch.zeros(shape, dtype=torch.long)
    targets = torch.full(shape, ignore, dtype=torch.long)
    documents = torch.zeros(shape, dtype=torch.long)
    targets[rows, cols] = flat
    documents[rows, cols] = torch.from_numpy(np.repeat(np.arange(1, len(seq) + 1), seq))
    inputs[row_of, offset] = bos
    shifted = cols - np.repeat(offset, seq) < np.repeat(seq, seq) - 1
    inputs[rows[shifted], cols[shifted] + 1] = flat[shifted]
    return inputs, targets, int(seq.sum()), documents
