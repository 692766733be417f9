"""BatchNorm's running statistics across workers, without Ray (a real gloo group of 2): before every
evaluation and checkpoint the loop makes every worker's buffers, the model's and the EMA's, rank
0's (``eval.bn_buffers=broadcast``) or their mean (``average``), so every worker evaluates with
the buffers a checkpoint at that step holds, and a group that loads the checkpoint evaluates to
the same figures."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raytrain_loops.config import ConfigError
from raytrain_loops.engine import Engine
from raytrain_loops.engine.length import total_steps
from raytrain_loops.engine.loop import Callback, Loop, LoopSettings, evaluate, sync_buffers
from tests.support import fakes
from tests.support.gloo import run_gloo

BATCH, PER_EPOCH = 6, 4


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.encoder(x))))


class RankSource:
    """Training batches that differ by rank (shifted by 3 x rank: each worker's BatchNorm
    statistics drift apart), and 2 evaluation batches per rank."""

    has_eval = True
    batches_per_epoch = PER_EPOCH

    def __init__(self, rank: int):
        x, y = fakes.regression_data(n=BATCH * 16, seed=5 + rank)
        self.x, self.y = x + 3.0 * rank, y

    def _batch(self, i: int):
        return self.x[i * BATCH : (i + 1) * BATCH], self.y[i * BATCH : (i + 1) * BATCH]

    def batches(self, split: str, epoch: int, start: int = 0):
        if split == "eval":
            return [self._batch(10 + i) for i in range(2)]
        return [self._batch(epoch * PER_EPOCH + i) for i in range(start, PER_EPOCH)]


def _stats(model: nn.Module) -> torch.Tensor:
    bn = model.module.bn if isinstance(model, DDP) else model.bn
    return torch.cat([bn.running_mean, bn.running_var]).clone()


class Evaluator:
    """The task's evaluation: the mse, and the statistics each model evaluated with."""

    def __init__(self):
        self.seen: list[torch.Tensor] = []

    def __call__(self, model, batch):
        self.seen.append(_stats(model))
        x, y = batch
        return {"mse": (torch.nn.functional.mse_loss(model(x), y), len(x))}


class Watch(Callback):
    """Each worker's statistics (model, EMA) right after each step and right before it, and the
    evaluations' metrics."""

    def __init__(self, engine: Engine):
        self.engine, self.after, self.before, self.metrics = engine, {}, {}, {}

    def _both(self):
        return _stats(self.engine.module), _stats(self.engine.ema.module)

    def on_step(self, result, step, epoch):
        self.after[step] = self._both()

    def before_step(self, step, micro_batches):
        self.before[step + 1] = self._both()

    def on_eval(self, metrics, step, epoch):
        self.metrics[step] = dict(metrics)


def _engine(cfg) -> Engine:
    torch.manual_seed(0)
    return Engine(DDP(BNNet()), fakes.mean_loss, cfg.engine, total_steps=total_steps(cfg.loop, cfg.accum, PER_EPOCH))


def _train_then_evaluate_the_checkpoint(rank: int, world: int, mode: str):
    """The loop: a checkpoint at step 1 (no evaluation), an evaluation and a checkpoint at 2; then
    a new engine loads rank 0's checkpoint of step 2 and evaluates as ``evaluate`` does."""
    cfg = fakes.config(
        "schedules.lr.value=0.05",
        "ema.enabled=true",
        "schedules.ema_momentum.value=0.5",
        "eval.every_steps=2",
        "checkpoint.every_steps=1",
        f"eval.bn_buffers={mode}",
    )
    engine = _engine(cfg)
    source, evaluator = RankSource(rank), Evaluator()
    watch, reporter = Watch(engine), fakes.RecordingReporter(engine)
    Loop(engine, source, reporter, LoopSettings.of(cfg), evaluator, [watch]).run()
    at_eval = evaluator.seen[:4]  # step 2: model, EMA, model, EMA (2 batches)
    state = [reporter.saved[2][0] if rank == 0 else None]
    dist.broadcast_object_list(state, src=0)
    resumed, again = _engine(cfg), Evaluator()
    resumed.load_state_dict(state[0])
    sync_buffers(resumed, mode)
    metrics = evaluate(resumed, source.batches("eval", resumed.epoch), again, True)
    checkpointed = torch.cat([state[0]["model"]["bn.running_mean"], state[0]["model"]["bn.running_var"]])
    return {
        "after": watch.after,
        "before": watch.before,
        "at_eval": at_eval,
        "checkpointed": checkpointed,
        "loop_eval": watch.metrics[2],
        "resumed_eval": metrics,
        "resumed_seen": again.seen,
    }


MODES = ("broadcast", "average")


def _both_modes(rank: int, world: int):
    return {mode: _train_then_evaluate_the_checkpoint(rank, world, mode) for mode in MODES}


@pytest.fixture(scope="module")
def runs():
    """Both modes in one group of 2 (one start of the processes)."""
    outcomes = run_gloo(2, _both_modes)
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message + outcomes[1].message
    return [o.value for o in outcomes]


@pytest.mark.parametrize("mode", MODES)
def test_every_worker_evaluates_with_the_checkpoints_buffers_and_a_loaded_checkpoint_evaluates_alike(runs, mode):
    r0, r1 = runs[0][mode], runs[1][mode]
    for i in (0, 1):  # model, EMA: the workers' own statistics after step 2 differ (the test can fail)
        assert not torch.allclose(r0["after"][2][i], r1["after"][2][i])
    # A checkpoint without an evaluation (step 1): every worker holds rank 0's after it.
    for i in (0, 1):
        torch.testing.assert_close(r1["before"][2][i], r0["after"][1][i], rtol=0, atol=0)
        torch.testing.assert_close(r0["before"][2][i], r0["after"][1][i], rtol=0, atol=0)
    # The evaluation at step 2: every worker, model and EMA, with the same statistics.
    if mode == "broadcast":
        expected = r0["after"][2]
    else:
        expected = tuple((r0["after"][2][i] + r1["after"][2][i]) / 2 for i in (0, 1))
    for r in (r0, r1):
        for call, seen in enumerate(r["at_eval"]):
            torch.testing.assert_close(seen, expected[call % 2], rtol=1e-6, atol=1e-7)
    # The checkpoint at step 2 holds them; a group that loads it evaluates to the same figures.
    torch.testing.assert_close(r0["checkpointed"], expected[0], rtol=1e-6, atol=1e-7)
    for r in (r0, r1):
        assert r["resumed_eval"] == r["loop_eval"]
        assert set(r["loop_eval"]) == {"eval_mse", "eval_ema_mse"}


def test_eval_bn_buffers_takes_broadcast_or_average_only():
    assert fakes.config().eval.bn_buffers == "broadcast"
    assert fakes.config("eval.bn_buffers=average").eval.bn_buffers == "average"
    with pytest.raises(ConfigError, match=r"eval\.bn_buffers.*'broadcast', 'average'; got 'mean'"):
        fakes.config("eval.bn_buffers=mean")
