"""Map-style splits without Ray: each epoch's batches depend on (loop.seed, epoch, rank) alone,
so a run stopped mid-epoch and resumed from its checkpoint ends with the uninterrupted run's
weights, bit for bit, on 1 and 2 workers, with and without DataLoader worker processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from raytrain_loops.config import load_config
from raytrain_loops.data import MapBatches
from raytrain_loops.engine import Engine
from raytrain_loops.engine.length import batches_per_epoch, total_steps
from raytrain_loops.engine.loop import Loop, LoopSettings, Position
from raytrain_loops.tasks import MapSplit
from tests.support import fakes
from tests.support.gloo import run_gloo

ROWS = 48


class NoisyRows(torch.utils.data.Dataset):
    """Regression rows with random augmentation on every read (torch and NumPy noise), and the
    row's id, so a test can tell which rows a step used."""

    def __init__(self, n: int):
        self.x, self.y = fakes.regression_data(n=n, seed=3)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        noise = torch.randn(self.x.shape[1]) + torch.from_numpy(np.random.standard_normal(self.x.shape[1])).float()
        return self.x[i] + 0.05 * noise, self.y[i], i


def _evaluate(model, batch):
    x, y, _ = batch
    return {"mse": (torch.nn.functional.mse_loss(model(x), y), len(x))}


def _run(rank: int, world: int, loader_workers: int, state=None, position=Position()):
    cfg = load_config(
        None,
        [
            "optim.name=sgd",
            "schedules.lr.value=0.05",
            "loop.epochs=2",
            "loop.seed=5",
            "data.batch_size=4",
            f"data.loader_workers={loader_workers}",
            "accum.steps=2",
            "checkpoint.every_steps=2",
        ],
    )
    source = MapBatches(
        {"train": MapSplit(NoisyRows(ROWS)), "eval": MapSplit(NoisyRows(10))}, cfg.data, cfg.loop.seed, rank, world
    )
    seen: list[tuple[int, list[int]]] = []  # (epoch, row ids) of every micro-batch trained on

    def loss(model, batch, ctx):
        x, y, ids = batch
        seen.append((ctx.epoch, ids.tolist()))
        return fakes.mean_loss(model, (x, y), ctx)

    model = fakes.make_model(seed=0 if state is None else 9, dropout=0.3)  # dropout draws from the global RNG
    engine = Engine(
        DDP(model) if world > 1 else model,
        loss,
        cfg.engine,
        total_steps=total_steps(cfg.loop, cfg.accum, source.batches_per_epoch),
    )
    if state is not None:
        engine.load_state_dict(state)
    reporter = fakes.RecordingReporter(engine)
    Loop(engine, source, reporter, LoopSettings.of(cfg), _evaluate).run(position)
    return fakes.params(engine.module), seen, reporter.saved


def _straight_and_resumed(rank: int, world: int):
    # Loader processes forked as on a Linux worker (this test process was spawned, and would
    # spawn them: a second of imports each).
    torch.multiprocessing.set_start_method("fork", force=True)
    out = {}
    for loader_workers in (0, 2):
        torch.manual_seed(100 + rank)  # what the worker's seeding leaves behind
        weights, seen, saved = _run(rank, world, loader_workers)
        state, position = saved[4]  # 4 updates of 2 micro-batches: mid-epoch on 1 and on 2 workers
        torch.manual_seed(12345)  # whatever happened in between must not matter
        resumed, seen_after, _ = _run(rank, world, loader_workers, state, position)
        out[loader_workers] = {"weights": weights, "resumed": resumed, "seen": seen, "seen_after": seen_after}
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_run_resumed_mid_epoch_ends_with_the_same_weights_having_seen_each_row_once(world):
    outcomes = run_gloo(world, _straight_and_resumed, daemon=False)
    assert [o.error for o in outcomes] == [None] * world, [o.message for o in outcomes]
    per_worker_batches = batches_per_epoch(ROWS, world, 4, padded=True)
    for rank, outcome in enumerate(outcomes):
        for loader_workers, r in outcome.value.items():
            where = f"rank {rank}, data.loader_workers={loader_workers}"
            for name, value in r["weights"].items():
                assert torch.equal(value, r["resumed"][name]), f"{where}: {name}"
            cut = 8  # micro-batches before the checkpoint at update 4
            assert r["seen_after"] == r["seen"][cut:], where
            assert len(r["seen"]) == 2 * per_worker_batches, where
        # Each batch's augmentation is seeded by its own number: loader processes change nothing.
        for name, value in outcome.value[0]["weights"].items():
            assert torch.equal(value, outcome.value[2]["weights"][name]), f"rank {rank}: {name}"
    for epoch in (0, 1):
        rows = sorted(i for o in outcomes for e, ids in o.value[0]["seen"] if e == epoch for i in ids)
        assert rows == list(range(ROWS)), f"epoch {epoch}: not every row exactly once"


def _order(seed: int, epoch: int, rank: int = 0, world: int = 2, split: str = "train", start: int = 0):
    data = load_config(None, ["data.batch_size=4", "data.eval_batch_size=4"]).data
    source = MapBatches({"train": MapSplit(NoisyRows(24)), "eval": MapSplit(NoisyRows(7))}, data, seed, rank, world)
    return [ids.tolist() for _, _, ids in source.batches(split, epoch, start)]


def _rows(batches: list[list[int]]) -> list[int]:
    return [i for ids in batches for i in ids]


def test_the_order_follows_loop_seed_and_the_epoch_and_evaluation_reads_each_row_once():
    assert _order(0, 0) == _order(0, 0)
    assert _order(0, 0) != _order(1, 0)  # loop.seed
    assert _order(0, 0) != _order(0, 1)  # the epoch
    assert _order(3, 2, 1, start=1) == _order(3, 2, 1)[1:]  # a resumed epoch starts where it stopped
    assert sorted(_rows(_order(3, 2, 0) + _order(3, 2, 1))) == list(range(24))  # the workers split each epoch
    assert sorted(_rows(_order(0, 0, 0, 2, "eval") + _order(0, 0, 1, 2, "eval"))) == list(range(7))  # no padding
