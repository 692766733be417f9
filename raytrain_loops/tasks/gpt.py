"""The ``lm`` task's model: a GPT of pre-norm blocks with rotary positions and
``F.scaled_dot_product_attention(is_causal=True)``, over bytes (a BOS id past them) or over a
``vocab`` of tokens with the embedding and the head tied (GPT-2's).

Rows holding several sequences (``fixed`` packing) keep attention inside each: by a boolean mask
given to ``scaled_dot_product_attention`` (``attention="sdpa"``: a kernel that takes a mask, not
the flash one), or by FlexAttention's block mask (``attention="flex"``: of its blocks of 128 x 128
scores, those with no score kept are skipped and those with every score kept run unmasked; a
fused kernel once compiled, CUDA only for training, as FlexAttention has no backward on CPU).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

ATTENTIONS = ("sdpa", "flex")
IGNORE = -100
"""The target of a padding position: no loss."""


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` (batch, heads, time, head_dim): a position-dependent
    rotation of each pair of channels, so attention scores depend on relative offsets."""
    t, d = x.shape[-2], x.shape[-1]
    freqs = 10_000.0 ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * freqs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)



def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """The attention mask of rows holding several sequences (``documents``: each position's
    sequence number, batch x time): causal, and each position sees its own sequence only."""
    t = documents.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=documents.device).tril()
    return ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]


def document_block_mask(documents: torch.Tensor) -> BlockMask:
    """:func:`document_mask` as FlexAttention's block mask (its blocks computed once per batch)."""
    b, t = documents.shape

    def causal_in_document(batch, head, q, k):
        return (q >= k) & (documents[batch, q] == documents[batch, k])

    return create_block_mask(causal_in_document, b, None, t, t, device=documents.device)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k = rotary(q), rotary(k)
        # Padding sits after each sequence's bytes, so the causal mask alone keeps it out of view;
        # ``mask``: rows holding several sequences (fixed packing), each kept to itself.
        if isinstance(mask, BlockMask):  # no dropout here: the task refuses it with attention=flex
            y = flex_attention(q, k, v, block_mask=mask)
        else:
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))



class Block(nn.Module):
    """Pre-norm Transformer block: attention, then a 4x GELU MLP, each a residual branch."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), mask))
        return x + self.drop(self.mlp(self.norm2(x)))



class GPT(nn.Module):
    """A small GPT: token embeddings, ``layers`` blocks with rotary positions, a head over the
    vocabulary.

    ``vocab=None``: bytes, a 257-row embedding (256 bytes and BOS) and a 256-way head with a
    bias. ``vocab=V``: a ``V``-row embedding (BOS among the rows) whose matrix is also the head's
    (tied, no bias, as GPT-2): ``head.weight`` is ``embed.weight``, one parameter.
    """

    def __init__(
        self, dim: int, layers: int, heads: int, dropout: float = 0.0, vocab: int | None = None, attention: str = "sdpa"
    ):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}; got {attention!r}")
        self.attention = attention
        self.embed = nn.Embedding(257 if vocab is None else vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256) if vocab is None else nn.Linear(dim, vocab, bias=False)
        if vocab is not None:
            self.head.weight = self.embed.weight
        for name, p in self.named_parameters():  # a tied matrix once, under its first name (embed)
            if p.dim() > 1:
                # GPT-2: residual output projections scaled down with depth.
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(
        self, tokens: torch.Tensor, documents: torch.Tensor | None = None, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits for ``tokens``; ``documents`` (each position's sequence number, rows packed with
        several sequences): attention stays causal and inside each sequence. With ``targets``, the
        cross-entropy summed over the targets that are not ``IGNORE`` instead of the logits: the
        loss inside the forward, so that a model compiled whole (``compile.scope=model``) compiles
        it with the head, and the logits need not be written out in fp32 and read back."""
        x = self.embed(tokens)
        if documents is None:
            mask = None
        elif self.attention == "flex":
            mask = document_block_mask(documents)
        else:
            mask = document_mask(documents)
        for block in self.blocks:
            x = block(x, mask)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        # In fp32 whatever the logits' dtype (autocast would cast them so; an evaluation may run without it).
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")
