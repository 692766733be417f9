"""The per-worker loop without Ray, as the engine tests build it: a fake batch source (seeded
shuffles, row ids per epoch, a worker that runs out early), a callback that counts its calls, an
evaluation of the mean squared error, and a real engine with a recording reporter driven through a
loop of a config's overrides (``CADENCE``: evaluations, reports and checkpoints at different
steps)."""

from __future__ import annotations

import torch

from raytrain_loops.engine import Engine
from raytrain_loops.engine.length import total_steps
from raytrain_loops.engine.loop import Callback, Loop, LoopSettings, Position
from tests.support import fakes

BATCH = 4


class FakeSource:
    """``batches_per_epoch`` training batches per epoch (row ids ``epoch * 1000 + i``), shuffled
    per epoch by a seeded generator, and 2 evaluation batches. Records every batch it yields."""

    def __init__(self, batches_per_epoch: int, available: int | None = None, seed: int = 0):
        self.batches_per_epoch = batches_per_epoch
        self.available = batches_per_epoch if available is None else available  # fewer: this worker runs out
        self.has_eval = True
        self.seed = seed
        self.yielded: list[tuple[int, int]] = []  # (epoch, batch index) of training batches
        self.x, self.y = fakes.regression_data(n=BATCH * 64, seed=3)

    def _batch(self, row: int):
        return self.x[row * BATCH % len(self.x) :][:BATCH], self.y[row * BATCH % len(self.y) :][:BATCH]

    def batches(self, split: str, epoch: int, start: int = 0):
        if split == "eval":
            return [self._batch(50 + i) for i in range(2)]
        order = torch.randperm(self.available, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        return self._train(epoch, order, start)

    def _train(self, epoch, order, start):
        for i in range(start, self.available):
            self.yielded.append((epoch, i))
            yield self._batch(order[i] + 7 * epoch)


class Counting(Callback):
    def __init__(self):
        self.calls: dict[str, int] = {"on_step": 0, "on_interval": 0, "on_eval": 0, "before_checkpoint": 0, "close": 0}

    def on_step(self, result, step, epoch):
        self.calls["on_step"] += 1

    def on_interval(self, metrics, step):
        self.calls["on_interval"] += 1

    def on_eval(self, metrics, step, epoch):
        self.calls["on_eval"] += 1

    def before_checkpoint(self):
        self.calls["before_checkpoint"] += 1

    def close(self):
        self.calls["close"] += 1


def evaluate_mse(model, batch):
    x, y = batch
    return {"mse": (torch.nn.functional.mse_loss(model(x), y), len(x))}


def loop_of(*overrides, batches=7, available=None, model=None, state=None, callbacks=(), loss_fn=fakes.mean_loss):
    cfg = fakes.config("schedules.lr.value=0.05", *overrides)
    source = FakeSource(batches, available)
    total = total_steps(cfg.loop, cfg.accum, batches)
    engine = Engine(model or fakes.make_model(), loss_fn, cfg.engine, total_steps=total)
    if state is not None:
        engine.load_state_dict(state)
    reporter = fakes.RecordingReporter(engine)
    return Loop(engine, source, reporter, LoopSettings.of(cfg), evaluate_mse, callbacks), source, reporter


def run_loop(*overrides, position=Position(), **kw):
    loop, source, reporter = loop_of(*overrides, **kw)
    loop.run(position)
    return loop.engine, source, reporter


CADENCE = ["loop.epochs=3", "accum.steps=2", "eval.every_steps=0", "checkpoint.every_steps=4"]
CADENCE += ["run.report_every_steps=2", "logging.every_steps=1"]
