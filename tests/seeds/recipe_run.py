"""The engine side of a reference-loop test: a recipe's own engine config run by the loop (no
Ray, one process) over given batches, recording what each update applied; and the comparison of
its state with a transcription's."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from raytrain_loops.config.run import Config
from raytrain_loops.engine import Engine
from raytrain_loops.engine.loop import Callback, Loop, LoopSettings
from raytrain_loops.runtime import wiring
from raytrain_loops.tasks.base import Task
from tests.support import fakes


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread: the tiny models' operations cost less than waking a second one, and
    far less on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class GivenBatches:
    """The loop's batch source over fixed training batches, one list per epoch, in order; no
    evaluation split (the tests compare states, not metrics)."""

    has_eval = False

    def __init__(self, epochs: Sequence[Sequence[Any]]):
        self.epochs = epochs
        self.batches_per_epoch = len(epochs[0])

    def batches(self, split: str, epoch: int, start: int = 0):
        return iter(self.epochs[epoch][start:])


class GroupValues(Callback):
    """Each applied update's learning rate and weight decay, per parameter group, as the
    optimizer held them when it stepped."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.lr: list[list[float]] = []
        self.wd: list[list[float]] = []

    def on_step(self, result, step, epoch):
        groups = self.engine.optimizer.param_groups
        self.lr.append([g["lr"] for g in groups])
        self.wd.append([g["weight_decay"] for g in groups])


def task_engine(task: Task, model: torch.nn.Module, cfg: Config, per_epoch: int) -> Engine:
    """The engine a training process builds for ``task`` (``runtime/wiring.py``'s
    :func:`~raytrain_loops.runtime.wiring.task_engine`) for ``per_epoch`` batches an epoch."""
    return wiring.task_engine(task, model, cfg, per_epoch)


def run_loop(engine: Engine, cfg: Config, epochs: Sequence[Sequence[Any]], callbacks: Sequence[Callback] = ()) -> None:
    """Run ``engine`` to its ``total_steps`` with the recipe's loop settings over ``epochs``."""
    reporter = fakes.RecordingReporter(engine)
    Loop(engine, GivenBatches(epochs), reporter, LoopSettings.of(cfg), lambda model, batch: {}, callbacks).run()


def largest_difference(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], atol: float = 1e-6) -> float:
    """Assert both states hold the same entries, each within ``atol``; the largest difference."""
    assert sorted(ours) == sorted(theirs)
    worst = 0.0
    for name, v in theirs.items():
        torch.testing.assert_close(ours[name], v, atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
        if v.numel():
            worst = max(worst, (ours[name].double() - v.double()).abs().max().item())
    return worst
