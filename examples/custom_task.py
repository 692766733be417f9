"""Your own model, criterion and data as a task, trained with raytrain_loops.fit.

    .venv/bin/python examples/custom_task.py

Two interleaved spirals, an MLP, a map-style torch dataset (read through a DataLoader with a
seeded DistributedSampler on each worker), and accuracy on a held-out set.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import raytrain_loops
from raytrain_loops import LossOutput, MapSplit, Task


def spirals(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g) * 2 * math.pi  # one turn each
    label = torch.randint(0, 2, (n,), generator=g)
    sign = label * 2 - 1
    x = torch.stack([t * torch.cos(t) * sign, t * torch.sin(t) * sign], 1) / (2 * math.pi)
    return torch.utils.data.TensorDataset(x + 0.02 * torch.randn(n, 2, generator=g), label)


class SpiralTask(Task):
    def __init__(self, hidden: int = 64):
        self.hidden = hidden

    def splits(self, data_dir):
        return {"train": MapSplit(spirals(2048, seed=0)), "eval": MapSplit(spirals(512, seed=1))}

    def build_model(self) -> nn.Module:
        h = self.hidden
        return nn.Sequential(nn.Linear(2, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 2))

    def criterion(self, model, batch, ctx) -> LossOutput:
        x, y = batch
        logits = model(x)
        return LossOutput(
            F.cross_entropy(logits, y), sample_size=len(y), logs={"acc": (logits.argmax(1) == y).float().mean()}
        )

    def evaluate(self, model, batch):
        x, y = batch
        return {"accuracy": ((model(x).argmax(1) == y).float().mean(), len(y))}


CONFIG = {
    "task": {"name": "spirals"},
    "loop": {"epochs": 30},
    "data": {"batch_size": 64},
    "schedules": {"lr": {"kind": "cosine", "value": 1e-2, "warmup_steps": 20}},
    "scaling": {"num_workers": 2},
    "checkpoint": {"every_steps": 0},
    "run": {"storage_path": "./runs"},
}

if __name__ == "__main__":
    result = raytrain_loops.fit(CONFIG, task=SpiralTask())
    print(f"accuracy {result.metrics['eval_accuracy']:.3f}; run directory {result.run_dir}")
