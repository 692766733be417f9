"""Automatic micro-batching (``accum.micro_batch=auto``): an out-of-memory error on one worker
halves every worker's micro-batch and retries the same update on the same rows, on real gloo
process groups (DDP and FSDP) without Ray; the splitting of batches; the configs it refuses."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from examples.custom_task import CONFIG, SpiralTask
from raytrain_loops.callbacks.faults import Faults
from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.config.run import FaultSpec
from raytrain_loops.console.feed import Sender
from raytrain_loops.engine import Engine
from raytrain_loops.engine.distributed.sharding import shard
from raytrain_loops.engine.update.micro import MicroBatches, SplitError, split_batch
from raytrain_loops.rundir.layout import MICRO_BATCH_FILE
from raytrain_loops.runtime.wiring import micro_batches
from raytrain_loops.tasks import MapSplit
from tests.support import fakes
from tests.support.gloo import run_gloo
from tests.support.grouped import GROUPS, GroupedTask
from tests.support.runfiles import records

BATCH = 8  # rows per batch (data.batch_size); two batches per update (accum.steps=2)
STEPS = 5


def _batches(rank: int, step: int, size: int = BATCH, k: int = 2):
    """Worker ``rank``'s rows of update ``step``: ``k * BATCH`` rows in batches of ``size``."""
    x, y = fakes.regression_data(n=k * BATCH, seed=1000 + 10 * step + rank)
    return fakes.split(x, y, [size] * (k * BATCH // size))


def _engine(overrides: list[str], strategy: str = "ddp", split=None, dropout: float = 0.0) -> Engine:
    config = fakes.config("schedules.lr.value=0.01", *overrides).engine
    model = fakes.make_model(d_hidden=32, dropout=dropout)
    if strategy == "fsdp":
        model = shard(model, [model.encoder, model.head], torch.device("cpu"))
    else:
        model = DDP(model)
    return Engine(model, fakes.sum_loss, config, total_steps=STEPS, split_batch=split)


def _run(rank: int, overrides: list[str], plan: list[dict], size: int = BATCH, dropout: float = 0.0) -> dict:
    """STEPS updates with ``plan``'s memory faults; the weights, the resizes heard, the splits.
    With ``dropout``, a retry that did not put the RNG states back would draw other masks."""
    engine = _engine(overrides, dropout=dropout)
    torch.manual_seed(100 + rank)
    faults = Faults([FaultSpec(**f) for f in plan], rank, "/nonexistent")
    engine.loss_fn = faults.wrap_loss(engine.loss_fn if "loss.reduction=sum" in overrides else fakes.mean_loss)
    heard = []
    engine.micro.on_resize = lambda resize: heard.append({**dataclasses.asdict(resize), "line": resize.line()})
    for step in range(STEPS):
        result = engine.train_step(_batches(rank, step, size))
        assert result.applied, (step, result.skipped)
    return {
        "params": fakes.params(engine.module),
        "heard": heard,
        "splits": engine.micro.splits,
        "oom": engine.counts["oom"],
    }


def _cases(rank: int, world: int) -> dict:
    """Every DDP comparison in one process group (one spawn)."""
    auto, mean, total = ["accum.micro_batch=auto"], ["loss.reduction=mean"], ["loss.reduction=sum"]
    first = [{"step": 1, "rank": 1, "kind": "oom", "micro_batch": 4}]
    later = [{"step": 3, "rank": 1, "kind": "oom", "micro_batch": 3}]  # 8 rows -> 4 -> 2: twice in one update
    return {
        "first": _run(rank, auto + mean, first, dropout=0.2),
        "smaller": _run(rank, mean, [], size=4, dropout=0.2),
        "cvnets_first": _run(rank, [*auto, *mean, "accum.reduce=sum", "accum.steps=2"], first),
        "cvnets_smaller": _run(rank, [*mean, "accum.reduce=sum", "accum.steps=2"], [], size=4),
        "later": _run(rank, auto + total, later),
        "plain": _run(rank, total, []),
    }


@pytest.fixture(scope="module")
def ddp_cases():
    outcomes = run_gloo(2, _cases)
    assert [o.error for o in outcomes] == [None, None], [o.message for o in outcomes]
    print("seconds in the workers:", [round(o.seconds, 1) for o in outcomes])
    return [o.value for o in outcomes]


def test_an_oom_at_step_one_gives_the_weights_of_a_run_with_the_smaller_micro_batch_from_the_start(ddp_cases):
    for worker in ddp_cases:
        first, smaller = worker["first"], worker["smaller"]
        assert first["splits"] == 2 and first["oom"] == 1
        for name, p in first["params"].items():
            assert torch.equal(p, smaller["params"][name]), name
        # Heard on both workers: worker 1 ran out of memory, and every worker halved.
        (resize,) = first["heard"]
        assert resize["line"] == "micro-batch 8 -> 4 after an out-of-memory error on worker 1 at step 1 (4 per update)"


def test_accumulation_on_the_sum_is_rescaled_so_halving_keeps_the_update(ddp_cases):
    # accum.reduce=sum adds accum.steps micro-batches' mean-loss gradients: after the halving the
    # step adds twice as many and divides by two, the update the 8-row batches made (the reference:
    # 4-row batches with accum.steps=2, four per update).
    for worker in ddp_cases:
        assert worker["cvnets_first"]["splits"] == 2
        for name, p in worker["cvnets_first"]["params"].items():
            assert torch.equal(p, worker["cvnets_smaller"]["params"][name]), name


def test_an_oom_mid_run_under_sum_reduction_stays_within_1e_6_of_the_uninterrupted_run(ddp_cases):
    for worker in ddp_cases:
        later, plain = worker["later"], worker["plain"]
        assert later["splits"] == 4 and later["oom"] == 2
        assert [(r["old"], r["new"], r["worker"], r["step"], r["per_update"]) for r in later["heard"]] == [
            (8, 4, 1, 3, 4),
            (4, 2, 1, 3, 8),
        ]
        diff = max((p - plain["params"][n]).abs().max().item() for n, p in later["params"].items())
        assert diff < 1e-6, diff
        print(f"largest difference from the uninterrupted run: {diff:.3g}")
    assert all(torch.equal(p, ddp_cases[1]["later"]["params"][n]) for n, p in ddp_cases[0]["later"]["params"].items())


def _fsdp_breaks(rank: int, world: int, run_dir: str) -> None:
    engine = _engine(["accum.micro_batch=auto", "loss.reduction=sum"], "fsdp")
    plan = [FaultSpec(step=2, rank=0, kind="oom", micro_batch=4)]
    engine.loss_fn = Faults(plan, rank, run_dir).wrap_loss(engine.loss_fn)
    micro_batches(engine, run_dir, rank, Sender(None))  # what the wiring does: records the restart's size
    for step in range(STEPS):
        engine.train_step(_batches(rank, step))


def _fsdp_steps(rank: int, run_dir: str, overrides: list[str], size: int) -> dict:
    engine = _engine(overrides, "fsdp")
    plan = [FaultSpec(step=2, rank=0, kind="oom", micro_batch=4)]
    engine.loss_fn = Faults(plan, rank, run_dir).wrap_loss(engine.loss_fn)
    micro_batches(engine, run_dir, rank, Sender(None))
    for step in range(STEPS):
        assert engine.train_step(_batches(rank, step, size)).applied
    state = engine.module.state_dict()
    return {"splits": engine.micro.splits, "params": {k: v.full_tensor() for k, v in state.items()}}


def _fsdp_restarted(rank: int, world: int, run_dir: str) -> tuple[dict, dict]:
    """The restarted group (auto, from the record), and a run of 4-row batches from the start."""
    auto = _fsdp_steps(rank, run_dir, ["accum.micro_batch=auto", "loss.reduction=sum"], BATCH)
    return auto, _fsdp_steps(rank, run_dir, ["loss.reduction=sum"], 4)


def test_under_fsdp_an_oom_restarts_the_group_which_starts_from_the_halved_micro_batch(tmp_path):
    run_dir = str(tmp_path)
    broken = run_gloo(2, _fsdp_breaks, run_dir)
    # Under FSDP the other worker is inside the parameter all-gathers: the group restarts, as
    # without auto; the failing worker recorded the halved size before it raised.
    assert broken[0].error == "GroupBrokenError" and "under FSDP" in broken[0].message, broken[0].message
    assert broken[1].error is not None
    record = json.loads((tmp_path / MICRO_BATCH_FILE).read_text())
    assert (record["splits"], record["old"], record["new"], record["worker"], record["step"]) == (2, 8, 4, 0, 2)
    assert record["restart"] is True
    again = run_gloo(2, _fsdp_restarted, run_dir)
    assert [o.error for o in again] == [None, None], [o.message for o in again]
    for worker in again:
        auto, smaller = worker.value
        assert auto["splits"] == 2  # from the record: the same OOM does not come back
        for name, p in auto["params"].items():
            assert torch.equal(p, smaller["params"][name]), name
    print("seconds in the workers:", [o.seconds for o in broken], [o.seconds for o in again])


def _ddp_breaks(rank: int, world: int, run_dir: str) -> None:
    from tests.support.oom import OOMInBackward

    engine = _engine(["accum.micro_batch=auto", "loss.reduction=sum"])
    micro_batches(engine, run_dir, rank, Sender(None))

    def loss_fn(model, batch, ctx):
        out = fakes.sum_loss(model, batch, ctx)
        if rank == 1 and ctx.step == 2 and ctx.micro_index == 1:  # the synchronising micro-batch
            out.loss = OOMInBackward.apply(out.loss)
        return out

    engine.loss_fn = loss_fn
    for step in range(STEPS):
        engine.train_step(_batches(rank, step))


def test_an_oom_that_breaks_ddps_all_reduce_records_the_halved_size_before_the_group_restarts(tmp_path):
    broken = run_gloo(2, _ddp_breaks, str(tmp_path))
    assert broken[1].error == "GroupBrokenError" and "synchronising micro-batch" in broken[1].message
    record = json.loads((tmp_path / MICRO_BATCH_FILE).read_text())
    assert (record["splits"], record["old"], record["new"], record["worker"], record["step"]) == (2, 8, 4, 1, 3)
    assert record["restart"] is True and record["per_update"] == 4


def test_split_batch_cuts_rows_through_tuples_dicts_and_lists():
    x = torch.arange(10.0).reshape(5, 2)
    batch = {"x": x, "pair": (x[:, 0], ["a", "b", "c", "d", "e"])}
    parts = split_batch(batch, 2)
    assert [len(p["pair"][1]) for p in parts] == [2, 3]
    assert torch.equal(torch.cat([p["x"] for p in parts]), x)
    assert parts[1]["pair"][1] == ["c", "d", "e"] and torch.equal(parts[1]["pair"][0], x[2:, 0])
    # A top-level list holds the batch's fields (default_collate of tuple samples).
    fields = split_batch([x, x[:, 0]], 2)
    assert isinstance(fields[0], list) and torch.equal(fields[1][1], x[2:, 0])
    with pytest.raises(SplitError, match=r"batch\[2\] is a int"):
        split_batch((x, x, 7), 2)
    with pytest.raises(SplitError, match="disagree on its rows"):
        split_batch((x, x[:3]), 2)
    with pytest.raises(SplitError, match="5 rows cannot be split into 8"):
        split_batch(x, 8)


def test_the_lm_task_splits_packed_sequences_with_their_own_token_counts():
    from raytrain_loops.tasks.lm import IGNORE, LMTask

    inputs = torch.arange(12).reshape(4, 3)
    targets = torch.tensor([[1, 2, IGNORE], [3, IGNORE, IGNORE], [4, 5, 6], [7, 8, IGNORE]])
    task = LMTask.__new__(LMTask)  # the split reads no parameter of the task
    parts = task.split_batch((inputs, targets, 8), 2)
    assert [p[2] for p in parts] == [3, 5]
    assert torch.equal(parts[1][0], inputs[2:])
    # The step counts the batch's rows past its token count (a number no row holds), and cuts it
    # with the task's own split; the default split refuses the number.
    micro = MicroBatches(auto=True, mean=False, split=task.split_batch)
    micro.splits = 2
    out = micro.parts([(inputs, targets, 8), None])  # None: a batch this worker has not
    assert [p if p is None else p[2] for p in out] == [3, 5, None, None]
    assert micro._rows == 4 and micro.smaller((inputs, targets, 8))[2] == 3
    with pytest.raises(SplitError, match=r"batch\[2\] is a int"):
        MicroBatches(auto=True, mean=False).parts([(inputs, targets, 8)])


def _counted(rows: list) -> tuple:
    """Spirals' rows collated with their number: a value no row holds."""
    x, y = torch.utils.data.default_collate(rows)
    return x, y, len(rows)


class CountedSpirals(SpiralTask):
    """Spirals whose batches carry their number of rows, with no split of the task's own."""

    def splits(self, data_dir):
        return {k: MapSplit(s.dataset, collate_fn=_counted) for k, s in super().splits(data_dir).items()}

    def criterion(self, model, batch, ctx):
        return super().criterion(model, batch[:2], ctx)

    def evaluate(self, model, batch):
        return super().evaluate(model, batch[:2])


class CutSpirals(CountedSpirals):
    """The same batches, cut by a split of the task's own that counts each part's rows."""

    def split_batch(self, batch, parts):
        return [(x, y, len(y)) for x, y in split_batch(batch[:2], parts)]


def test_a_task_whose_batches_cannot_be_cut_is_refused_before_the_run_directory_or_any_worker(tmp_path, monkeypatch):
    from raytrain_loops import fit
    from raytrain_loops.driver import fit as driver

    def workers(*args, **kwargs):
        raise AssertionError("the run's workers started")

    monkeypatch.setattr(driver, "_train", workers)  # where the run would start its workers (Ray, or local)
    config = {**CONFIG, "accum": {"micro_batch": "auto"}, "run": {"name": "counted", "storage_path": str(tmp_path)}}
    says = r"accum.micro_batch: auto cuts .* of task 'spirals' cannot be cut: batch\[2\] is a int.* Task.split_batch"
    with pytest.raises(ConfigError, match=says):
        fit(config, task=CountedSpirals())
    assert not list(tmp_path.iterdir())  # refused before the run directory was made
    for task, micro_batch in ((CountedSpirals(), "fixed"), (CutSpirals(), "auto")):  # both reach the workers
        with pytest.raises(AssertionError, match="workers started"):
            fit({**config, "accum": {"micro_batch": micro_batch}}, task=task)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["data.batch_size=1"], "data.batch_size=1 holds one row"),
        (["data.batch_size=3", "loss.reduction=mean"], "data.batch_size=3 is odd"),
    ],
)
def test_auto_is_refused_where_halving_would_change_the_update(overrides, says):
    with pytest.raises(ConfigError, match="accum.micro_batch") as err:
        load_config(None, ["accum.micro_batch=auto", *overrides])
    assert says in str(err.value)
    load_config(None, ["accum.micro_batch=auto", "data.batch_size=3", "loss.reduction=sum"])  # uneven halves: fine


def test_a_micro_batch_size_is_only_for_an_oom_fault():
    with pytest.raises(ConfigError, match="micro_batch"):
        load_config(None, ["fault.plan=[{step: 1, kind: nan, micro_batch: 4}]"])


def test_a_local_run_says_it_in_one_line_checkpoints_the_size_and_resumes_from_it(tmp_path, capsys):
    from raytrain_loops import fit

    # 64-row batches; from step 2 on, a micro-batch of more than 32 rows runs out of memory.
    base = {
        **CONFIG,
        "loop": {"max_steps": 4, "epochs": 6},
        "accum": {"micro_batch": "auto"},
        "fault": {"plan": [{"step": 2, "kind": "oom", "micro_batch": 32}]},
        "checkpoint": {"every_steps": 4},
        "scaling": {"num_workers": 0},
        "run": {"name": "auto", "storage_path": str(tmp_path), "progress": False},
    }
    first = fit(base, task=SpiralTask())
    out = capsys.readouterr().out
    assert "micro-batch 64 -> 32 after an out-of-memory error on worker 0 at step 2 (2 per update)\n" in out
    logged = records(Path(first.run_dir) / "metrics.jsonl")
    assert [r["step"] for r in logged] == [1, 2, 3, 4]  # the update at step 2 was retried, not skipped
    state = torch.load(Path(first.checkpoint) / "state.pt", weights_only=True)  # the engine's shared state
    assert state["counters"]["micro_batch_splits"] == 2
    # The checkpoint alone carries the size: without the run's record, the resumed run starts from it.
    (Path(first.run_dir) / MICRO_BATCH_FILE).unlink()
    second = fit({**base, "loop": {"max_steps": 6, "epochs": 6}}, task=SpiralTask())
    out = capsys.readouterr().out
    assert "resumed at step 4" in out and "micro-batches: each batch split in 2 (accum.micro_batch=auto)" in out
    assert "out-of-memory" not in out and second.metrics["step"] == 6
    # A rerun may turn auto on or off (the update is the same), and the run keeps its name.
    from raytrain_loops.driver.preflight import run_name
    from raytrain_loops.driver.run_checks import check_config

    rerun = {**base, "loop": {"max_steps": 6, "epochs": 6}}
    fixed = load_config({**rerun, "accum": {"micro_batch": "fixed"}})
    assert check_config(second.run_dir, fixed) == {"accum.micro_batch": ("auto", "fixed")}
    with pytest.raises(ConfigError, match="accum.steps"):
        check_config(second.run_dir, load_config({**rerun, "accum": {"micro_batch": "auto", "steps": 2}}))
    named = {**base, "run": {"storage_path": str(tmp_path)}}
    unnamed_fixed = load_config({**named, "accum": {"micro_batch": "fixed"}})
    assert run_name(load_config(named), SpiralTask()) == run_name(unnamed_fixed, SpiralTask())


def test_a_task_batch_sampler_is_refused_before_ray_starts(tmp_path):
    from raytrain_loops.driver.preflight import prepare

    base = [
        "task.name=grouped",
        "data.batch_size=3",
        "loss.reduction=sum",
        "scaling.num_workers=2",
        f"data.dir={tmp_path}",
    ]
    prepare(load_config(None, base), GroupedTask(GROUPS))  # fixed: the sampler's batches as they come
    with pytest.raises(ConfigError, match="accum.micro_batch: task 'grouped'.*own batch sampler"):
        prepare(load_config(None, [*base, "accum.micro_batch=auto"]), GroupedTask(GROUPS))
