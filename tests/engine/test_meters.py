"""Meters: the progress line's smoothing against hand computations, epoch averages over two gloo
workers with unequal weights, their state across a resume, and the progress line itself."""

from __future__ import annotations

import json

import pytest
import torch

from raytrain_loops.callbacks.run_log import RunLog
from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.engine import Engine
from raytrain_loops.engine.distributed import collectives
from raytrain_loops.engine.meters import Meters, Smoother
from tests.support import fakes
from tests.support.gloo import run_gloo
from tests.support.runfiles import records


def test_momentum_smoothing_weighs_earlier_intervals_by_powers_of_the_momentum():
    s = Smoother("momentum", momentum=0.5)
    assert s.update({"loss": 4.0}) == {"loss": 4.0}  # the first value as is, no pull towards 0
    assert s.update({"loss": 2.0})["loss"] == pytest.approx((0.5 * 4 + 2) / (0.5 + 1))
    third = s.update({"loss": 8.0, "loss_ce": 1.0})  # a name seen first now starts at its own value
    assert third["loss"] == pytest.approx((0.25 * 4 + 0.5 * 2 + 8) / (0.25 + 0.5 + 1))
    assert third["loss_ce"] == 1.0
    assert s.update({"loss": 0.0})["loss_ce"] == 1.0  # a name missing from an interval keeps its value
    assert Smoother("momentum", momentum=0.0).update({"x": 3.0}) == {"x": 3.0}


def test_smoothing_counts_in_steps_whatever_the_logging_cadence():
    # An interval of 3 steps is smoothed as 3 steps of its mean, so the line does not lag more
    # (in steps) when metrics are gathered less often.
    per_step, per_interval = Smoother("momentum", 0.8), Smoother("momentum", 0.8, steps_per_interval=3)
    for v in (4.0, 1.0, 7.0):
        for _ in range(3):
            expected = per_step.update({"loss": v})
        assert per_interval.update({"loss": v})["loss"] == pytest.approx(expected["loss"])
    median = Smoother("median", window=6, steps_per_interval=3)  # the last 2 intervals
    assert [median.update({"x": v})["x"] for v in (5.0, 1.0, 9.0)] == [5.0, 3.0, 5.0]


def test_median_smoothing_is_the_median_of_the_last_window_intervals():
    s = Smoother("median", window=3)
    seen = [s.update({"loss": v})["loss"] for v in (5.0, 1.0, 9.0, 3.0, 7.0)]
    assert seen == [5.0, 3.0, 5.0, 3.0, 7.0]  # [5], [5 1], [5 1 9], [1 9 3], [9 3 7]
    assert [Smoother("median", window=1).update({"x": v})["x"] for v in (2.0, 6.0)] == [2.0, 6.0]
    wide = Smoother("median", window=5)  # the window fills up before it slides
    assert [wide.update({"x": v})["x"] for v in (1.0, 9.0, 8.0, 7.0, 2.0, 3.0)] == [1.0, 5.0, 8.0, 7.5, 7.0, 7.0]


def test_the_smoothing_state_continues_after_a_file_round_trip_and_other_settings_start_afresh(tmp_path):
    s = Smoother("momentum", momentum=0.8)
    for v in (1.0, 5.0, 2.0):
        s.update({"loss": v})
    torch.save(s.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    resumed = Smoother("momentum", momentum=0.8)
    resumed.load_state_dict(state)
    assert resumed.update({"loss": 9.0}) == s.update({"loss": 9.0})
    other = Smoother("median", window=3)
    other.load_state_dict(state)  # logging may change on a rerun: no mixing of the two
    assert other.update({"loss": 9.0}) == {"loss": 9.0}


def test_smoothing_settings_are_checked_naming_the_key():
    cfg = load_config(None, ["logging.smoothing.kind=median", "logging.smoothing.window=3"])
    assert (cfg.logging.smoothing.kind, cfg.logging.smoothing.window) == ("median", 3)
    for bad, key in [
        ("logging.smoothing.momentum=1.0", "logging.smoothing.momentum"),
        ("logging.smoothing.window=0", "logging.smoothing.window"),
        ("logging.smoothing.kind=mean", "logging.smoothing.kind"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(None, [bad])
        assert info.value.key == key


def _counted(calls: list[str]):
    reduce, gather = collectives.all_reduce_sum, collectives.all_gather_object

    def counted_reduce(t):
        calls.append("all_reduce")
        return reduce(t)

    def counted_gather(obj):
        calls.append("gather")
        return gather(obj)

    return counted_reduce, counted_gather


def _epoch_sums(rank: int, world: int):
    m = Meters(epochs=True)
    if rank == 0:
        m.add("loss", 1.0, 1.0)
        m.add("loss", torch.tensor(3.0), torch.tensor(1.0))
    else:
        m.add("loss", 10.0, 2.0)
        m.add("only_rank1", 4.0, 2.0)
    interval = m.reduce()
    if rank == 0:
        m.add("loss", 2.0, 3.0)
    else:
        m.add("loss", 6.0, 1.0)
    m.flush_epoch()  # before a checkpoint
    state = m.state_dict()
    resumed = Meters(epochs=True)
    resumed.load_state_dict(state)
    for meters in (m, resumed):  # the rest of the epoch, in the run and in a run resumed from the state
        if rank == 1:
            meters.add("loss", 0.0, 4.0)
    calls: list[str] = []
    original = collectives.all_reduce_sum, collectives.all_gather_object
    collectives.all_reduce_sum, collectives.all_gather_object = _counted(calls)
    try:
        epoch = m.end_epoch()
    finally:
        collectives.all_reduce_sum, collectives.all_gather_object = original
    return {
        "interval": interval,
        "epoch": epoch,
        "resumed": resumed.end_epoch(),
        "next": m.end_epoch(),
        "collectives": calls,
        "state": state,
    }


def test_epoch_averages_over_two_workers_with_unequal_weights_match_a_hand_computation():
    outcomes = run_gloo(2, _epoch_sums)
    assert [o.error for o in outcomes] == [None, None], [o.message for o in outcomes]
    a, b = (o.value for o in outcomes)
    # rank 0: 1 (w 1), 3 (w 1), 2 (w 3); rank 1: 10 (w 2), 6 (w 1), 0 (w 4)
    loss = (1 + 3 + 2 * 3 + 10 * 2 + 6 * 1 + 0 * 4) / (1 + 1 + 3 + 2 + 1 + 4)
    for o in (a, b):
        assert o["interval"] == {"loss": pytest.approx((1 + 3 + 20) / 4), "only_rank1": 4.0}
        assert o["epoch"] == {"loss": pytest.approx(loss), "only_rank1": 4.0}
        assert o["resumed"] == o["epoch"]  # the flushed sums carry the epoch across a resume
        assert o["next"] == {}  # a new epoch starts empty
        assert o["collectives"] == ["all_reduce"]  # the epoch's end: one all-reduce, no gather of names
    assert a["state"] == b["state"]  # what rank 0 saves holds every worker's part


def test_batch_time_is_data_time_plus_compute_time():
    engine = Engine(fakes.make_model(), fakes.mean_loss, fakes.config().engine, total_steps=2)
    x, y = fakes.regression_data(n=8)
    engine.train_step([(x, y)], data_time=0.25)
    engine.train_step([(x, y)], data_time=0.75)
    m = engine.reduce_metrics()
    assert m["data_time"] == 0.5
    assert m["batch_time"] == pytest.approx(m["data_time"] + m["compute_time"])
    assert engine.end_epoch_metrics()["batch_time"] == pytest.approx(m["batch_time"])


INTERVALS = [
    {"loss": 2.0, "loss_ce": 1.0, "loss_ce_unscaled": 1.0, "class_error": 50.0, "lr": 1e-3, "epoch": 1.0},
    {"loss": 4.0, "loss_ce": 3.0, "loss_ce_unscaled": 3.0, "class_error": 30.0, "lr": 5e-4, "epoch": 2.0},
]
TIMES = [{"data_time": 0.010, "batch_time": 0.050, "compute_time": 0.040}, {"data_time": 0.030, "batch_time": 0.070}]


def test_the_progress_line_shows_every_term_smoothed_the_lr_and_data_and_batch_time(tmp_path, capsys):
    log = RunLog(str(tmp_path), rank=0, total_steps=40, progress=True, workers=2)
    state = None
    for i, (metrics, times) in enumerate(zip(INTERVALS, TIMES, strict=True)):
        speed = {"samples_per_s": 1200.0 + i, "samples_per_s/rank0": 600.0, "gflops_per_s": 3.5, "mfu": 0.25}
        log.on_interval({**metrics, **times, **speed}, step=10 * (i + 1))
        state = state or log.state_dict()
    line = capsys.readouterr().out.strip().splitlines()[-1]
    # The interval's rates over one span, its step time (batch 0.070 s): then the eta at the rate since the start.
    assert "| 14.3 steps/s, 1201 samples/s, MFU 25.0% (step time) | eta " in line, line
    assert line.endswith(" steps/s overall)"), line
    assert "gflops" not in line and "rank0" not in line  # throughput figures are not loss terms
    m = 0.9  # the default momentum
    smooth = lambda a, b: (m * a + b) / (m + 1)  # noqa: E731
    assert line.startswith("step 20/40 (50%) | epoch 2 | ")
    for text in (
        f"loss {smooth(2.0, 4.0):.4g} class_error {smooth(50.0, 30.0):.4g} loss_ce {smooth(1.0, 3.0):.4g} |",
        "| lr 5.00e-04 |",  # the interval's lr, not smoothed
        f"| data {smooth(0.010, 0.030):.3f}s batch {smooth(0.050, 0.070):.3f}s |",
        "| eta ",
    ):
        assert text in line, line
    assert "unscaled" not in line and "compute" not in line
    # A restarted rank 0 continues the smoothing from the checkpointed state.
    resumed = RunLog(str(tmp_path), rank=0, total_steps=40, progress=True, start_step=10, workers=2)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    resumed.on_interval({**INTERVALS[1], **TIMES[1]}, step=20)
    again = capsys.readouterr().out.strip().splitlines()[-1]
    assert again.split(" | ")[:3] == line.split(" | ")[:3]
    for run_log in (log, resumed):
        run_log.close()


def test_an_epochs_averages_go_to_epochs_jsonl_and_the_console(tmp_path, capsys):
    log = RunLog(str(tmp_path), rank=0, total_steps=40, progress=True)
    log.on_epoch({"train_loss": 0.5, "train_acc": 0.75}, step=21, epoch=0)
    times = {"train_lr": 1e-3, "train_data_time": 0.002, "train_batch_time": 0.1, "train_grad_norm": 3.0}
    log.on_epoch({"train_loss": 0.25, "train_acc": 0.875, **times}, step=42, epoch=1)
    log.close()
    logged = records(tmp_path / "epochs.jsonl")
    assert [(r["epoch"], r["step"], r["train_loss"], r["train_acc"]) for r in logged] == [
        (0, 21, 0.5, 0.75),
        (1, 42, 0.25, 0.875),
    ]
    out = capsys.readouterr().out.splitlines()[-1]
    assert out == (
        "epoch 1 ended at step 42, averages over the epoch (train_*): loss 0.25 acc 0.875 | lr 1.00e-03 | "
        "data_time 0.002s | batch_time 0.100s"
    )
    assert not (tmp_path / "metrics.jsonl").read_text()  # the per-step log keeps one line per step only


def test_throughput_memory_and_per_worker_series_go_to_tensorboard_only_with_system_series(tmp_path):
    from tests.support.runfiles import tb_scalars

    interval = {"loss": 0.5, "lr": 1e-3, "step": 10.0, "epoch": 0.0, "batch_time": 0.1, "samples_per_s": 640.0}
    interval.update({"samples_per_s/rank0": 320.0, "cpu_peak_rss_gib": 1.5, "mfu": 0.3})
    epoch = {"train_loss": 0.4, "train_data_time": 0.01, "train_sample_size": 64.0}
    for system, expected in ((False, {"loss", "lr", "train_loss"}), (True, (set(interval) | set(epoch)) - {"step", "epoch"})):
        log = RunLog(str(tmp_path / str(system)), rank=0, total_steps=20, progress=False, system_series=system)
        log.on_interval(interval, step=10)
        log.on_epoch(epoch, step=12, epoch=0)
        log.close()
        scalars = tb_scalars(tmp_path / str(system) / "tb")
        assert set(scalars) == expected
        assert scalars["train_loss"] == [(12, pytest.approx(0.4))]  # against the step, not the epoch
