"""An out-of-memory error where no memory runs out: an identity autograd function whose backward
raises torch's ``OutOfMemoryError`` before any parameter's gradient, for the tests of an OOM in
the synchronising backward (DDP's all-reduce broken on one worker)."""

from __future__ import annotations

import torch


class OOMInBackward(torch.autograd.Function):
    """Identity forward; its backward runs out of memory (before any parameter's gradient)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory (injected in backward)")
