"""The per-worker loop without Ray: a fake batch source, a recording reporter, a real engine.

Cadence of evaluations, reports and checkpoints (the final ones exactly once), a mid-epoch
resume that continues bit for bit, and equal report counts on workers with uneven data.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from raytrain_loops.callbacks.run_log import RunLog
from raytrain_loops.callbacks.spike_guard import SpikeGuard
from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.engine.distributed import collectives
from raytrain_loops.engine.length import batches_per_epoch, total_steps
from raytrain_loops.engine.loop import Callback, Position
from raytrain_loops.errors import LossSpikeError, NonFiniteError
from tests.support import fakes
from tests.support.gloo import run_gloo
from tests.support.loops import CADENCE, Counting, loop_of, run_loop
from tests.support.runfiles import records, tb_scalars


def test_evaluations_reports_and_checkpoints_follow_their_cadence_and_the_final_ones_come_once():
    counting = Counting()
    engine, source, reporter = run_loop(*CADENCE, callbacks=[counting])
    # 7 batches of 2 micro-batches: 3 steps an epoch (one batch dropped), 9 in all.
    assert engine.step == 9 and engine.epoch == 3
    seen = [(r["metrics"]["step"], r["checkpoint"], "eval_mse" in r["metrics"]) for r in reporter.reports]
    assert seen == [
        (2, None, False),  # report_every_steps
        (3, None, True),  # end of epoch 0: evaluation (eval.every_steps=0), no checkpoint (every 4 steps)
        (4, Position(1, 2), True),  # checkpoint mid-epoch 1, one step (2 batches) into it
        (6, None, True),  # report_every_steps ...
        (6, None, True),  # ... and the end of epoch 1, with a new evaluation
        (8, Position(2, 4), True),
        (9, Position(3, 0), True),  # the final evaluation, checkpoint and report, once
    ]
    assert [r["metrics"].get("done") for r in reporter.reports] == [None] * 6 + [1.0]
    assert counting.calls == {"on_step": 9, "on_interval": 9, "on_eval": 3, "before_checkpoint": 3, "close": 1}
    # Every epoch's batches were read to the end (the dropped one too), none twice.
    assert source.yielded == [(e, i) for e in range(3) for i in range(7)]


def test_eval_and_checkpoint_every_n_steps_leave_epoch_ends_alone():
    engine, _, reporter = run_loop(
        "loop.epochs=2", "accum.steps=1", "eval.every_steps=5", "checkpoint.every_steps=5", "run.report_every_steps=100"
    )
    seen = [(r["metrics"]["step"], r["checkpoint"], r["metrics"].get("done")) for r in reporter.reports]
    assert engine.step == 14
    assert seen == [(5, Position(0, 5), None), (10, Position(1, 3), None), (14, Position(2, 0), 1.0)]


def test_a_run_resumed_mid_epoch_continues_bit_for_bit_with_the_batches_it_had_left():
    straight, straight_source, reporter = run_loop(*CADENCE)
    state, position = reporter.saved[4]  # step 4: epoch 1, 2 batches in
    assert position == Position(1, 2)
    resumed, resumed_source, _ = run_loop(*CADENCE, model=fakes.make_model(seed=9), position=position, state=state)
    assert resumed.step == straight.step == 9
    for name, value in straight.module.state_dict().items():
        assert torch.equal(value, resumed.module.state_dict()[name]), name
    # The resumed run read exactly what the straight one read after the checkpoint.
    cut = straight_source.yielded.index((1, 2))
    assert resumed_source.yielded == straight_source.yielded[cut:]


def _through_a_file(state, tmp_path):
    """The state as a resumed run reads it: saved, then loaded without unpickling code."""
    torch.save(state, tmp_path / "state.pt")
    return torch.load(tmp_path / "state.pt", weights_only=True)


def _scaled_at(update: int, factor: float):
    """The mean loss, times ``factor`` for every micro-batch of update number ``update``."""

    def loss(model, batch, ctx):
        out = fakes.mean_loss(model, batch, ctx)
        if ctx.step + 1 == update:
            out.loss = out.loss * factor
        return out

    return loss


SPIKE = ["loop.epochs=2", "checkpoint.every_steps=4", "spike.factor=5", "spike.window=4", "spike.min_steps=3"]


def test_a_resumed_run_calls_a_loss_spike_where_the_uninterrupted_one_does(tmp_path):
    spike = fakes.config(*SPIKE).spike
    straight, _, reporter = loop_of(*SPIKE, loss_fn=_scaled_at(6, 100.0), callbacks=[SpikeGuard(spike)])
    with pytest.raises(LossSpikeError) as called:
        straight.run()
    state, position = reporter.saved[4]
    assert position == Position(0, 4) and len(state["callbacks"]["SpikeGuard"]["history"]) == 4
    # Resumed at step 4, the guard has one loss of its own before step 6, fewer than min_steps:
    # only the saved history lets it call the spike, on the same mean.
    resumed, _, _ = loop_of(
        *SPIKE,
        loss_fn=_scaled_at(6, 100.0),
        callbacks=[SpikeGuard(spike)],
        model=fakes.make_model(seed=9),
        state=_through_a_file(state, tmp_path),
    )
    with pytest.raises(LossSpikeError) as again:
        resumed.run(position)
    assert str(again.value) == str(called.value) and "at step 6" in str(called.value)


SKIPS = ["loop.epochs=2", "checkpoint.every_steps=0", "nonfinite.policy=skip", "nonfinite.max_consecutive=3"]


def test_a_resumed_run_counts_skipped_updates_in_a_row_from_before_the_checkpoint(tmp_path):
    # 4 batches an epoch: updates 1-3 apply, then every call for update 4 is NaN. The epoch ends
    # (and checkpoints) after the first such skip; the third in a row, early in epoch 1, stops.
    nan = _scaled_at(4, float("nan"))
    straight, straight_source, reporter = loop_of(*SKIPS, batches=4, loss_fn=nan)
    with pytest.raises(NonFiniteError, match="3 updates in a row"):
        straight.run()
    state, position = reporter.saved[3]
    assert position == Position(1, 0) and state["counters"]["in_a_row_nonfinite"] == 1
    resumed, resumed_source, _ = loop_of(
        *SKIPS, batches=4, loss_fn=nan, model=fakes.make_model(seed=9), state=_through_a_file(state, tmp_path)
    )
    with pytest.raises(NonFiniteError, match="3 updates in a row"):
        resumed.run(position)
    assert resumed.engine.counts == straight.engine.counts  # 3 skips in all, not 4
    assert resumed_source.yielded == straight_source.yielded[4:] == [(1, 0), (1, 1)]
    # A checkpoint written before these were saved still loads: no skips in a row, no callback state.
    old = {**state, "counters": {k: v for k, v in state["counters"].items() if not k.startswith("in_a_row")}}
    del old["callbacks"]
    resumed.engine.load_state_dict(old)
    assert resumed.engine.state_dict()["counters"]["in_a_row_nonfinite"] == 0


def test_max_steps_inside_an_epoch_stops_there_and_checkpoints_the_position():
    engine, source, reporter = run_loop("loop.max_steps=5", "accum.steps=2", "checkpoint.every_steps=100")
    assert engine.step == 5 and engine.epoch == 1
    assert reporter.reports[-1]["checkpoint"] == Position(1, 4)  # 2 steps of 2 batches into epoch 1
    assert [r["checkpoint"] is not None for r in reporter.reports] == [False, True]  # epoch 0's end; the final one
    assert source.yielded[-1] == (1, 3)  # the rest of epoch 1 is left for a resumed run


def _uneven(rank: int, world: int):
    torch.manual_seed(0)
    counting = Counting()
    # Worker 1 has 2 batches fewer per epoch: it joins its last steps with placeholders.
    engine, _, reporter = run_loop(
        *CADENCE,
        "logging.every_steps=2",
        available=7 if rank == 0 else 5,
        model=DDP(fakes.make_model()),
        callbacks=[counting],
    )
    return {
        "reports": [(r["metrics"]["step"], r["checkpoint"] and r["checkpoint"].batches) for r in reporter.reports],
        "calls": counting.calls,
        "weights": fakes.params(engine.module),
    }


def test_workers_with_uneven_data_make_the_same_reports_and_end_with_the_same_weights():
    outcomes = run_gloo(2, _uneven)
    assert [o.error for o in outcomes] == [None, None], [o.message for o in outcomes]
    a, b = (o.value for o in outcomes)
    assert a["reports"] == b["reports"] and len(a["reports"]) == 7
    assert a["calls"] == b["calls"]
    for name in a["weights"]:
        assert torch.equal(a["weights"][name], b["weights"][name]), name


@pytest.mark.parametrize("rows,world,batch", [(1347, 2, 32), (10, 3, 3), (7, 4, 1), (100, 1, 7)])
def test_the_padded_count_matches_what_a_distributed_sampler_yields(rows, world, batch):
    data = list(range(rows))
    for rank in range(world):
        loader = DataLoader(data, batch_size=batch, drop_last=True, sampler=DistributedSampler(data, world, rank))
        assert batches_per_epoch(rows, world, batch, padded=True) == len(loader)
    assert batches_per_epoch(rows, world, batch) == rows // world // batch


def test_fit_rejects_an_epoch_shorter_than_one_update_before_ray_starts(tmp_path):
    from raytrain_loops import fit
    from raytrain_loops.recipes import resolve

    # 1347 training rows / 2 workers / 64 a batch = 10 batches per worker, fewer than 16.
    overrides = [f"data.dir={tmp_path / 'data'}", f"run.storage_path={tmp_path / 'runs'}", "accum.steps=16"]
    with pytest.raises(ConfigError) as info:
        fit(resolve("default"), overrides=overrides + ["data.batch_size=64"])
    assert info.value.key == "accum.steps" and "holds 10 batches per worker" in str(info.value)
    assert not (tmp_path / "runs").exists()  # refused before the run directory (and Ray) existed
    with pytest.raises(ConfigError, match="accum.steps"):
        total_steps(load_config(None).loop, load_config(None, ["accum.steps=3"]).accum, 2)


class EpochRecords(Callback):
    def __init__(self):
        self.records: list[tuple[int, int, dict]] = []

    def on_epoch(self, metrics, step, epoch):
        self.records.append((epoch, step, dict(metrics)))


EPOCHS = [*CADENCE, "logging.every_steps=2"]  # intervals of 2 steps straddle the epochs of 3


def _weighted_by_rank(rank: int):
    def loss(model, batch, ctx):
        out = fakes.mean_loss(model, batch, ctx)
        out.sample_size = 1 + 2 * rank  # worker 1's micro-batches weigh 3x worker 0's
        out.logs["rank"] = torch.tensor(float(rank))
        return out

    return loss


def _epoch_averages(rank: int, world: int):
    torch.manual_seed(0)
    kw = {"loss_fn": _weighted_by_rank(rank), "available": 7 if rank == 0 else 5}
    straight = EpochRecords()
    loop, _, reporter = loop_of(*EPOCHS, model=DDP(fakes.make_model()), callbacks=[straight], **kw)
    loop.run()
    state, position = reporter.saved[4]  # one step into epoch 1
    # Every worker resumes from rank 0's shared state with its own RNG, as from a checkpoint.
    shared = collectives.all_gather_object(state)[0]
    resumed = EpochRecords()
    loop2, _, reporter2 = loop_of(
        *EPOCHS,
        model=DDP(fakes.make_model(seed=9)),
        state={**shared, "rng": state["rng"]},
        callbacks=[resumed],
        **kw,
    )
    loop2.run(position)
    return {
        "straight": straight.records,
        "resumed": resumed.records,
        "position": (position.epoch, position.batches),
        "saved_epoch": state["meters"]["epoch"],
        "final": reporter.reports[-1]["metrics"],
    }


def _untimed(records):
    return [(e, s, {k: v for k, v in m.items() if "time" not in k and "_per_s" not in k}) for e, s, m in records]


def test_epoch_averages_over_two_workers_continue_across_a_mid_epoch_resume():
    outcomes = run_gloo(2, _epoch_averages)
    assert [o.error for o in outcomes] == [None, None], [o.message for o in outcomes]
    a, b = (o.value for o in outcomes)
    assert _untimed(a["straight"]) == _untimed(b["straight"])  # the same records on every worker
    assert [(e, s) for e, s, _ in a["straight"]] == [(0, 3), (1, 6), (2, 9)]
    for _, _, m in a["straight"]:
        # 3 updates an epoch: worker 0 gives 2 micro-batches of weight 1 to each; worker 1 (5
        # batches) 2, 2 and 1 of weight 3. Its "rank" is 1: 15 of the weight of 21.
        assert m["train_rank"] == pytest.approx(15 / 21)
        assert m["train_sample_size"] == pytest.approx((8 + 8 + 5) / 3)
    assert a["position"] == (1, 2) and a["saved_epoch"]  # the checkpoint holds epoch 1's first update
    # Resumed inside epoch 1, the run ends epochs 1 and 2 with the uninterrupted run's averages.
    assert _untimed(a["resumed"]) == _untimed(a["straight"][1:])
    assert _untimed(b["resumed"]) == _untimed(b["straight"][1:])
    # The final report (summary.json) carries the last epoch's averages.
    assert a["final"]["train_rank"] == a["straight"][-1][2]["train_rank"]
    assert a["final"]["train_loss"] == a["straight"][-1][2]["train_loss"]


def test_a_run_stopped_inside_an_epoch_by_max_steps_leaves_its_sums_to_a_longer_rerun():
    base = ["accum.steps=2", "checkpoint.every_steps=0", "logging.every_steps=2"]
    straight, whole = EpochRecords(), EpochRecords()
    run_loop(*base, "loop.max_steps=6", callbacks=[whole])  # two epochs of 3 updates
    _, _, reporter = run_loop(*base, "loop.max_steps=5", callbacks=[straight])
    state, position = reporter.saved[5]  # the final checkpoint, 2 updates into epoch 1
    assert [e for e, _, _ in straight.records] == [0] and position == Position(1, 4)
    rerun = EpochRecords()
    run_loop(*base, "loop.max_steps=6", model=fakes.make_model(seed=9), state=state, position=position, callbacks=[rerun])
    assert _untimed(rerun.records) == _untimed(whole.records[1:])


class Crash(Callback):
    """Ends the run (as a killed worker would) at the logging interval of step ``step``."""

    def __init__(self, step: int):
        self.step = step

    def on_interval(self, metrics, step):
        if step == self.step:
            raise RuntimeError(f"crashed at step {step}")


# 4 steps an epoch; the checkpoint at step 4 comes before epoch 0's end and its evaluation.
REPLAY = ["loop.epochs=3", "accum.steps=1", "eval.every_steps=0", "checkpoint.every_steps=4", "logging.every_steps=2"]


def _logged(run_dir):
    """A run log's files, without the wall-clock fields."""
    untimed = lambda r: {k: v for k, v in r.items() if "time" not in k and "_per_s" not in k}  # noqa: E731
    logs = {
        name: [untimed(r) for r in records(run_dir / name)] for name in ("metrics.jsonl", "eval.jsonl", "epochs.jsonl")
    }
    scalars = tb_scalars(run_dir / "tb")
    return logs, {tag: v for tag, v in scalars.items() if "time" not in tag and "_per_s" not in tag}


def test_a_run_resumed_from_a_checkpoint_logs_each_step_epoch_and_evaluation_once(tmp_path):
    def log(run_dir, **kw):
        return RunLog(str(run_dir), rank=0, total_steps=12, progress=False, **kw)

    run_loop(*REPLAY, batches=4, callbacks=[log(tmp_path / "straight")])
    # The first attempt crashes at step 6, after writing epoch 0's end and evaluation (at step
    # 4, after the checkpoint) and steps 5-6; everything it wrote is in the files.
    loop, _, reporter = loop_of(*REPLAY, batches=4, callbacks=[log(tmp_path / "run"), Crash(6)])
    with pytest.raises(RuntimeError, match="crashed at step 6"):
        loop.run()
    state, position = reporter.saved[4]
    assert position == Position(0, 4)  # epoch 0 has yet to end
    assert [r["step"] for r in records(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    # The resumed attempt keeps what was written up to the checkpoint, then writes the rest.
    kept = state["callbacks"]["RunLog"]["files"]
    resumed = log(tmp_path / "run", start_step=4, kept=kept)
    run_loop(*REPLAY, batches=4, model=fakes.make_model(seed=9), state=state, position=position, callbacks=[resumed])

    logs, scalars = _logged(tmp_path / "run")
    assert [r["step"] for r in logs["metrics.jsonl"]] == list(range(1, 13))
    assert [(r["step"], r["epoch"]) for r in logs["eval.jsonl"]] == [(4, 1), (8, 2), (12, 3)]
    assert [(r["epoch"], r["step"]) for r in logs["epochs.jsonl"]] == [(0, 4), (1, 8), (2, 12)]
    assert [s for s, _ in scalars["loss"]] == [2, 4, 6, 8, 10, 12]
    assert [s for s, _ in scalars["eval_mse"]] == [4, 8, 12]
    assert [s for s, _ in scalars["train_loss"]] == [4, 8, 12]  # the epoch's average, at its last step
    # The uninterrupted run's records, value for value.
    assert (logs, scalars) == _logged(tmp_path / "straight")
