"""A generated token language whose best possible score is known: for the ``lm`` task at a
GPT-2-sized vocabulary without a download or a tokenizer.

The language over ``symbols`` token ids is a first-order Markov chain. Each id has a seeded Zipf
probability (exponent :data:`ZIPF`, the ranks shuffled over the ids) and :data:`SUCCESSORS`
fixed successors drawn from that unigram. A sequence starts with a unigram draw; each next token
is, with probability :data:`FOLLOW`, one of the previous token's successors (each equally
likely), else a fresh unigram draw. A model can learn the successor tables, so it can go well
below the unigram's entropy, and no model can go below the chain's own conditional entropy:
:meth:`Language.bits` gives each token's exact ``-log2 P(token | previous)``, whose mean over a
split is that split's floor.

Generation is vectorised numpy, in chunks of whole sequences drawn from one seeded generator, so
the same ``(symbols, seed)`` and draw sizes give the same tokens on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

ZIPF = 1.0  # unigram probability of the token of rank r: proportional to 1 / r**ZIPF
SUCCESSORS = 4  # fixed successors per token
FOLLOW = 0.8  # probability that a token is one of its predecessor's successors
CHUNK = 1 << 22  # tokens drawn per chunk (a constant: the draws, and so the tokens, depend on it)


def rng_for(seed: int, stream: int) -> np.random.Generator:
    """An independent generator for each use of one seed (the language, train, validation)."""
    return np.random.default_rng([seed, stream])


@dataclass(frozen=True, eq=False)  # arrays: no elementwise ==
class Language:
    """The chain's tables: ``unigram`` (``symbols`` probabilities) and ``successors``
    (``symbols`` x :data:`SUCCESSORS` ids)."""

    unigram: np.ndarray
    successors: np.ndarray

    @classmethod
    def make(cls, symbols: int, seed: int) -> Language:
        """The language of ``symbols`` token ids (0 to ``symbols - 1``) drawn from ``seed``."""
        if symbols < 1:
            raise ValueError(f"a generated language needs at least one symbol; got {symbols}")
        rng = rng_for(seed, 0)
        weights = 1.0 / np.arange(1, symbols + 1, dtype=np.float64) ** ZIPF
        unigram = (weights / weights.sum())[rng.permutation(symbols)]
        return cls(unigram, _draw(unigram, rng, symbols * SUCCESSORS).reshape(symbols, SUCCESSORS))

    @property
    def symbols(self) -> int:
        return len(self.unigram)

    def sample(self, rng: np.random.Generator, tokens: int, max_len: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """``tokens`` tokens in sequences of 1 to ``max_len`` tokens (uniform lengths; the last one
        cut to make the count exact): the concatenated tokens (``dtype``) and the lengths."""
        lengths = _lengths(rng, tokens, max_len)
        out = np.empty(tokens, dtype=dtype)
        ends = np.cumsum(lengths)
        first = 0
        while first < len(lengths):
            # Whole sequences per chunk: a chunk never starts inside a sequence.
            last = max(first + 1, int(np.searchsorted(ends, ends[first] - lengths[first] + CHUNK, side="right")))
            start = int(ends[first] - lengths[first])
            out[start : ends[last - 1]] = self._chain(rng, lengths[first:last])
            first = last
        return out, lengths

    def _chain(self, rng: np.random.Generator, lengths: np.ndarray) -> np.ndarray:
        """The tokens of consecutive sequences of ``lengths``. Every draw is made up front; a
        token that follows its predecessor is filled once that one is known, so the loop runs
        as many times as the longest run of followers, over fewer positions each time."""
        n = int(lengths.sum())
        follows = rng.random(n) < FOLLOW
        follows[np.cumsum(lengths) - lengths] = False  # a sequence's first token follows BOS: a unigram draw
        x = np.empty(n, dtype=np.int64)
        known = ~follows
        x[known] = _draw(self.unigram, rng, int(known.sum()))
        pending = np.flatnonzero(follows)
        slot = rng.integers(0, SUCCESSORS, size=pending.size)
        while pending.size:
            ready = known[pending - 1]
            now = pending[ready]
            x[now] = self.successors[x[now - 1], slot[ready]]
            known[now] = True
            pending, slot = pending[~ready], slot[~ready]
        return x

    def bits(self, previous: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """``-log2 P(token | previous)`` under the language, elementwise; a ``previous`` outside
        the symbols (BOS) marks a sequence's first token, whose probability is its unigram's."""
        unigram = torch.as_tensor(self.unigram, device=token.device)
        successors = torch.as_tensor(self.successors, device=token.device)
        start = (previous < 0) | (previous >= self.symbols)
        hits = (successors[previous.clamp(0, self.symbols - 1)] == token.unsqueeze(-1)).sum(-1)
        p = (1 - FOLLOW) * unigram[token] + FOLLOW * hits / SUCCESSORS
        return -torch.log2(torch.where(start, unigram[token], p))


def _draw(unigram: np.ndarray, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` independent draws from ``unigram`` (inverse CDF: one uniform number each)."""
    return np.minimum(np.searchsorted(np.cumsum(unigram), rng.random(n), side="right"), len(unigram) - 1)


def _lengths(rng: np.random.Generator, tokens: int, max_len: int) -> np.ndarray:
    """Uniform lengths in [1, max_len] until ``tokens`` are covered, the last one cut."""
    if tokens < 1:
        raise ValueError(f"a generated split needs at least one token; got {tokens}")
    drawn = rng.integers(1, max_len + 1, size=2 * tokens // (max_len + 1) + 16)
    while drawn.sum() < tokens:
        drawn = np.concatenate([drawn, rng.integers(1, max_len + 1, size=len(drawn))])
    ends = np.cumsum(drawn)
    count = int(np.searchsorted(ends, tokens)) + 1
    lengths = drawn[:count].copy()
    lengths[-1] -= int(ends[count - 1]) - tokens
    return lengths
