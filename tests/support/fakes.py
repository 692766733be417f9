"""Small hand-written models, criteria and data shared by the engine tests."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raytrain_loops.config import load_config
from raytrain_loops.engine import LossOutput


class TinyNet(nn.Module):
    """encoder -> norm -> head, with named parts so errors can name them."""

    def __init__(self, d_in: int = 6, d_hidden: int = 16, d_out: int = 3, dropout: float = 0.0):
        super().__init__()
        self.encoder = nn.Linear(d_in, d_hidden)
        self.norm = nn.LayerNorm(d_hidden)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.head(self.drop(torch.relu(self.norm(self.encoder(x)))))


def make_model(seed: int = 0, **kw) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet(**kw)


def regression_data(n: int = 24, d_in: int = 6, d_out: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


def sum_loss(model, batch, ctx) -> LossOutput:
    """fairseq-style: summed over samples, sample_size = number of samples."""
    x, y = batch
    loss = F.mse_loss(model(x), y, reduction="sum")
    return LossOutput(loss, sample_size=len(x), logs={"mse": loss.detach() / len(x)})


def mean_loss(model, batch, ctx) -> LossOutput:
    x, y = batch
    return LossOutput(F.mse_loss(model(x), y), sample_size=len(x))


def config(*overrides: str):
    """Engine config for exact-arithmetic checks: plain SGD with lr 1, so an update is minus the gradient."""
    base = ["optim.name=sgd", "optim.momentum=0.0", "schedules.lr.value=1.0", "optim.param_groups=single"]
    return load_config(None, base + list(overrides))


def split(x: torch.Tensor, y: torch.Tensor, sizes: list[int]):
    out, i = [], 0
    for s in sizes:
        out.append((x[i : i + s], y[i : i + s]))
        i += s
    return out


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class RootOfZero(nn.Module):
    """A finite output whose gradient is infinite: ``sqrt(p - 1)`` at ``p = 1`` (the slope of a
    square root at 0), beside an ordinary linear layer whose gradients stay finite."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.p = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.lin(x) * 0.0 + torch.sqrt(self.p - 1.0)


@dataclass
class RecordingReporter:
    """The loop's reporter in tests: every report's metrics, and a copy of the engine's state at
    each checkpoint (step -> (state, data position)), for resuming from it."""

    engine: Any
    reports: list[dict] = field(default_factory=list)
    saved: dict[int, tuple[dict, Any]] = field(default_factory=dict)

    def report(self, metrics, checkpoint):
        self.reports.append({"metrics": dict(metrics), "checkpoint": checkpoint})
        if checkpoint is not None:
            self.saved[self.engine.step] = (copy.deepcopy(self.engine.state_dict()), checkpoint)
