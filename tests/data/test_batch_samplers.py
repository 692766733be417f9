"""Batch samplers on the map-style path: ``GroupedBatchSampler`` (one group id per batch,
shuffled by (seed, epoch), sharded so every worker gets as many batches and no row is used
twice in an epoch), the run's length taken from the sampler's ``len`` on the driver and on the
workers, bad groupings refused before Ray starts, and an exact mid-epoch resume on 2 gloo
workers with the grouping sampler and a per-epoch poly learning rate."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from examples.custom_task import CONFIG, SpiralTask, spirals
from raytrain_loops.config import load_config
from raytrain_loops.data import GroupedBatchSampler, MapBatches
from raytrain_loops.driver.preflight import DataError, planned_steps, prepare
from raytrain_loops.engine import Engine
from raytrain_loops.engine.length import epochs_in_run, total_steps
from raytrain_loops.engine.loop import Loop, LoopSettings, Position
from raytrain_loops.tasks import MapSplit
from tests.support import fakes
from tests.support.gloo import run_gloo
from tests.support.grouped import GROUPS, SIZES, GroupedTask, Rows
from tests.support.runfiles import records


def _epoch(epoch: int, world: int, batch_size: int = 3, seed: int = 7) -> list[list[list[int]]]:
    """Every rank's batches of ``epoch``, each rank's sampler set to it as the loop does."""
    out = []
    for rank in range(world):
        s = GroupedBatchSampler(GROUPS, batch_size, rank, world, seed)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def test_grouped_batches_share_a_group_and_each_row_is_used_once_per_epoch_over_the_workers():
    batch_size, world = 3, 3
    full_batches = sum(n // batch_size for n in SIZES)  # 1 + 1 + 3 + 1 + 3 + 2 + 1 = 12
    for epoch in range(4):
        ranks = _epoch(epoch, world)
        lens = {len(GroupedBatchSampler(GROUPS, batch_size, r, world, 7)) for r in range(world)}
        assert lens == {full_batches // world} == {len(b) for b in ranks}, "equal counts on every rank, as len says"
        rows = [i for batches in ranks for b in batches for i in b]
        assert len(rows) == len(set(rows)) == full_batches * batch_size, f"epoch {epoch}: a row used twice"
        for batches in ranks:
            for b in batches:
                assert len(b) == batch_size and len({GROUPS[i] for i in b}) == 1, b
    # set_epoch reshuffles: another epoch, another order and other leftover rows; the same
    # (seed, epoch) gives the same batches.
    assert _epoch(0, world) == _epoch(0, world)
    assert _epoch(0, world) != _epoch(1, world)
    assert _epoch(0, world) != _epoch(0, world, seed=8)
    used = {i for epoch in range(6) for batches in _epoch(epoch, world) for b in batches for i in b}
    assert used == set(range(len(GROUPS))), "a group's leftover rows change from epoch to epoch"
    # 2 workers: 12 batches split 6 + 6.
    assert [len(b) for b in _epoch(0, 2)] == [6, 6]
    # 5 workers: 12 batches, 2 dropped so that each worker gets 2.
    five = _epoch(0, 5)
    assert [len(b) for b in five] == [2] * 5
    assert len({i for batches in five for b in batches for i in b}) == 30


@pytest.mark.parametrize(
    "groups,batch_size,world,fragment",
    [
        ([], 2, 1, "groups is empty"),
        (GROUPS, 4, 1, "batch_size 4 is more than the rows of 2 group(s): group 0 has 3, group 6 has 3"),
        ([0] * 6, 3, 3, "2 batches of 3, fewer than the 3 workers"),
    ],
)
def test_a_grouping_that_cannot_batch_is_refused(groups, batch_size, world, fragment):
    with pytest.raises(ValueError) as info:
        GroupedBatchSampler(groups, batch_size, 0, world, 0)
    assert fragment in str(info.value)


def test_the_run_length_comes_from_the_batch_sampler_on_the_driver_and_the_workers(tmp_path):
    overrides = ["task.name=grouped", "data.batch_size=3", "scaling.num_workers=2", "loop.epochs=3", "loop.seed=7"]
    cfg = load_config(None, [*overrides, f"data.dir={tmp_path}"])
    task, splits, rows = prepare(cfg, GroupedTask(GROUPS))
    # 12 batches of 3 over 2 workers: 6 per worker and epoch (a DistributedSampler would give 41 / 2 / 3 -> 7).
    assert planned_steps(cfg, splits, rows) == 3 * 6
    for rank in range(2):
        source = MapBatches(splits, cfg.data, cfg.loop.seed, rank, 2)
        assert source.batches_per_epoch == 6
        read = [ids.tolist() for _, _, ids in source.batches("train", 1, start=2)]
        assert read == _epoch(1, 2)[rank][2:]  # the sampler's batches for the epoch, from the resumed position


@pytest.mark.parametrize(
    "task,fragment",
    [
        (
            GroupedTask([0, 0, 0, 1, 1]),
            "task 'grouped', split 'train': batch_sampler: batch_size 3 is more than the rows",
        ),
        (GroupedTask([], rows=10), "task 'grouped', split 'train': batch_sampler: groups is empty"),
        (GroupedTask(GROUPS, rows=30), "task 'grouped', split 'train': the batch sampler names row"),
    ],
)
def test_a_bad_batch_sampler_is_refused_before_ray_starts_naming_the_task_and_split(tmp_path, task, fragment):
    cfg = load_config(None, ["task.name=grouped", "data.batch_size=3", "scaling.num_workers=2", f"data.dir={tmp_path}"])
    with pytest.raises(DataError) as info:
        prepare(cfg, task)
    assert fragment in str(info.value)


# ---------------------------------------------------------------- exact resume, 2 gloo workers

RESUME_GROUPS = [i % 3 for i in range(60)]  # 3 groups of 20 rows: 6 batches of 3 each, 9 per worker


def _grouped_run(rank: int, world: int, state=None, position=Position()):
    cfg = load_config(
        None,
        [
            "optim.name=sgd",
            "schedules.lr.kind=poly",
            "schedules.lr.per=epoch",
            "schedules.lr.value=0.05",
            "schedules.lr.power=2.0",
            "loop.epochs=3",
            "loop.seed=5",
            "data.batch_size=3",
            "checkpoint.every_steps=4",
        ],
    )
    sampler = functools.partial(GroupedBatchSampler, RESUME_GROUPS)
    splits = {"train": MapSplit(Rows(len(RESUME_GROUPS)), batch_sampler=sampler), "eval": MapSplit(Rows(6))}
    source = MapBatches(splits, cfg.data, cfg.loop.seed, rank, world)
    seen: list[tuple[int, list[int], float]] = []  # (epoch, row ids, lr) of every step

    def loss(model, batch, ctx):
        x, y, ids = batch
        seen.append((ctx.epoch, ids.tolist(), ctx.values["lr"]))
        return fakes.mean_loss(model, (x, y), ctx)

    model = fakes.make_model(seed=0 if state is None else 9, dropout=0.3)
    batches = source.batches_per_epoch
    engine = Engine(
        DDP(model),
        loss,
        cfg.engine,
        total_steps=total_steps(cfg.loop, cfg.accum, batches),
        total_epochs=epochs_in_run(cfg.loop, cfg.accum, batches),
    )
    if state is not None:
        engine.load_state_dict(state)
    reporter = fakes.RecordingReporter(engine)
    Loop(engine, source, reporter, LoopSettings.of(cfg), lambda m, b: {}).run(position)
    return fakes.params(engine.module), seen, reporter.saved


def _grouped_straight_and_resumed(rank: int, world: int):
    torch.manual_seed(100 + rank)
    weights, seen, saved = _grouped_run(rank, world)
    state, position = saved[12]  # epoch 1, after 3 of its 9 steps
    torch.manual_seed(12345)  # whatever happened in between must not matter
    resumed, seen_after, _ = _grouped_run(rank, world, state, position)
    return {
        "weights": weights,
        "resumed": resumed,
        "seen": seen,
        "seen_after": seen_after,
        "position": (position.epoch, position.batches),
    }


def test_a_grouped_run_resumed_mid_epoch_ends_with_the_same_weights_having_seen_each_row_at_most_once():
    outcomes = run_gloo(2, _grouped_straight_and_resumed)
    assert [o.error for o in outcomes] == [None, None], [o.message for o in outcomes]
    for rank, o in enumerate(outcomes):
        r = o.value
        assert r["position"] == (1, 3), "the checkpoint is mid-epoch"
        assert len(r["seen"]) == 3 * 9, f"rank {rank}: 9 steps per epoch, from the sampler's len"
        assert r["seen_after"] == r["seen"][12:], f"rank {rank}: the resumed run reads the same batches"
        for name, value in r["weights"].items():
            assert torch.equal(value, r["resumed"][name]), f"rank {rank}: {name}"
        # poly per epoch: 0.05 * (1 - epoch / 2) ** 2, one value for the whole epoch
        assert sorted({(e, lr) for e, _, lr in r["seen"]}) == [(0, 0.05), (1, 0.0125), (2, 0.0)]
    orders = [[ids for e, ids, _ in outcomes[0].value["seen"] if e == epoch] for epoch in range(3)]
    assert orders[0] != orders[1] != orders[2], "set_epoch reshuffles every epoch"
    for epoch in range(3):
        rows = [i for o in outcomes for e, ids, _ in o.value["seen"] if e == epoch for i in ids]
        assert len(rows) == len(set(rows)) == 54, f"epoch {epoch}: a row used twice"
        batches = [ids for o in outcomes for e, ids, _ in o.value["seen"] if e == epoch]
        assert all(len({RESUME_GROUPS[i] for i in b}) == 1 for b in batches)


# ---------------------------------------------------------------- the run's length, 2 gloo workers


def quadrants(points: torch.Tensor) -> list[int]:
    return ((points[:, 0] > 0).long() * 2 + (points[:, 1] > 0).long()).tolist()


class QuadrantSpirals(SpiralTask):
    """The spirals task with its training rows grouped by the quadrant they lie in."""

    def splits(self, data_dir):
        train = spirals(300, seed=0)
        sampler = functools.partial(GroupedBatchSampler, quadrants(train.tensors[0]))
        return {"train": MapSplit(train, batch_sampler=sampler), "eval": MapSplit(spirals(64, seed=1))}


QUADRANT_CONFIG = {
    **CONFIG,
    "loop": {"epochs": 3, "seed": 4},
    "data": {"batch_size": 16},
    "schedules": {"lr": {"kind": "poly", "per": "epoch", "value": 0.02, "power": 1.0, "end": 0.005}},
    "run": {"progress": False},
}


def _quadrant_run(rank: int, world: int, run_dir: str):
    """What a Ray worker runs for QUADRANT_CONFIG with map-style splits (worker/train.py: the
    source's batches_per_epoch, the engine's total steps, the loop), the run log on rank 0."""
    from raytrain_loops.callbacks.run_log import RunLog

    cfg = load_config(QUADRANT_CONFIG)
    task = QuadrantSpirals()
    source = MapBatches(task.splits(None), cfg.data, cfg.loop.seed, rank, world)
    batches = source.batches_per_epoch
    total = total_steps(cfg.loop, cfg.accum, batches)
    torch.manual_seed(cfg.loop.seed)
    engine = Engine(
        DDP(task.build_model()),
        task.criterion,
        cfg.engine,
        total_steps=total,
        total_epochs=epochs_in_run(cfg.loop, cfg.accum, batches),
    )
    log = RunLog(run_dir, rank=rank, total_steps=total, progress=False, workers=world)
    Loop(engine, source, fakes.RecordingReporter(engine), LoopSettings.of(cfg), task.evaluate, [log]).run(Position())
    return {"batches": batches, "step": engine.step}


def test_a_run_takes_its_length_from_the_batch_sampler_and_steps_a_per_epoch_schedule(tmp_path):
    """The workers' part of a run with a grouping batch sampler, as on Ray (a task with one,
    seamseg's, end to end in local mode and its length on two workers: tests/recipes/test_seamseg_recipe.py)."""

    outcomes = run_gloo(2, _quadrant_run, str(tmp_path))
    assert [o.error for o in outcomes] == [None, None], [o.message for o in outcomes]
    # Quadrants of 66, 69, 79 and 86 rows: 4 + 4 + 4 + 5 = 17 batches of 16, 8 per worker (a
    # DistributedSampler's share would be 150 rows, 9 batches).
    assert len(GroupedBatchSampler(quadrants(spirals(300, seed=0).tensors[0]), 16, 0, 2, 4)) == 8
    assert [o.value for o in outcomes] == [{"batches": 8, "step": 3 * 8}] * 2
    logged = records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in logged] == list(range(1, 3 * 8 + 1))
    lrs = {(r["epoch"], r["lr"]) for r in logged}
    # poly per epoch, power 1: 0.005 + 0.015 * (1 - epoch / 2), one value per epoch
    assert sorted(lrs) == [(0, pytest.approx(0.02)), (1, pytest.approx(0.0125)), (2, pytest.approx(0.005))], lrs
