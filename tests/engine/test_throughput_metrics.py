"""Throughput, FLOPs, MFU and memory in the interval metrics, and the peak table; the loop
without Ray on 2 gloo workers."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from raytrain_loops.callbacks.throughput import Throughput, gpu_peak_tflops, peak_tflops
from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.engine import Engine, LossOutput, unwrap
from raytrain_loops.engine.length import total_steps
from raytrain_loops.engine.loop import Loop, LoopSettings
from tests.support import fakes
from tests.support.fakes import RecordingReporter
from tests.support.gloo import run_gloo
from tests.support.loops import BATCH, FakeSource, evaluate_mse

# TinyNet(6 -> 16 -> 3) per sample: forward 2 * (6 * 16 + 16 * 3) = 288 multiply-adds counted
# twice; backward: the encoder's weight gradient (192; its input needs none), the head's weight
# and input gradients (96 + 96). Norms and activations are not matrix products: not counted. The
# criterion below runs the encoder twice: 2 * 96 forward and 192 backward more.
TINY_FLOPS_PER_SAMPLE = 288 + 192 + 192 + 192 + 192
TINY_MODEL_FLOPS_PER_SAMPLE = 288 + 192 + 192  # the model alone (fakes.sum_loss)


def prod_loss(model, batch, ctx) -> LossOutput:
    """MSE plus a product over the hidden features: under any Python dispatch mode autograd takes
    another branch of ``prod``'s backward, which differs in the last bit, so a step run under the
    FLOP counter would not be the step of a run without it."""
    x, y = batch
    hidden = unwrap(model).encoder(x)
    return LossOutput(F.mse_loss(model(x), y) + (1 + 0.1 * hidden.tanh()).prod(), sample_size=len(x))


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A10G", 70.0),
        ("NVIDIA A10", 125.0),
        ("Tesla V100-SXM2-16GB", 125.0),
        ("Tesla V100-PCIE-32GB", 112.0),
        ("Tesla V100S-PCIE-32GB", 130.0),
    ],
)
def test_the_peak_table_knows_the_common_gpus_by_their_cuda_names(name, tflops):
    assert gpu_peak_tflops(name) == tflops


def test_an_unknown_gpu_has_no_peak_and_warns_once_and_a_configured_peak_wins():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert gpu_peak_tflops("NVIDIA Quantum Widget 9") is None
        assert gpu_peak_tflops("NVIDIA Quantum Widget 9") is None
    assert [str(w.message) for w in caught] == [
        "no peak TFLOP/s known for GPU 'NVIDIA Quantum Widget 9': MFU is not reported; "
        "set logging.throughput.peak_tflops"
    ]
    assert peak_tflops(0.0, torch.device("cpu")) is None  # no MFU on a CPU unless configured
    assert peak_tflops(2.5, torch.device("cpu")) == 2.5
    with pytest.raises(ConfigError, match=r"^logging\.throughput\.peak_tflops: must be >= 0"):
        load_config(None, ["logging.throughput.peak_tflops=-1"])


def _train(rank: int, world: int, overrides: tuple[str, ...], throughput: bool, available: int):
    """A Ray-free loop on this worker (``available`` training batches of 4 rows); the last report's
    metrics and the final weights."""
    cfg = fakes.config("schedules.lr.value=0.05", "loop.epochs=2", "logging.every_steps=3", *overrides)
    source = FakeSource(7, available=available)
    total = total_steps(cfg.loop, cfg.accum, source.batches_per_epoch)
    torch.manual_seed(0)
    model = fakes.make_model(dropout=0.3)  # dropout: the run's RNG stream shows in the weights
    model = DDP(model) if world > 1 else model
    engine = Engine(model, prod_loss, cfg.engine, total_steps=total)
    torch.manual_seed(10 + rank)
    reporter = RecordingReporter(engine)
    callbacks = [Throughput(cfg.logging.throughput, engine, prod_loss)] if throughput else []
    Loop(engine, source, reporter, LoopSettings.of(cfg), evaluate_mse, callbacks).run()
    intervals = [r["metrics"] for r in reporter.reports]
    return {"metrics": intervals, "weights": fakes.params(engine.module), "rng": torch.rand(3)}


def _both(rank: int, world: int, overrides: tuple[str, ...]):
    # Rank 1 runs out of data after 5 of its 7 batches: unequal units per worker.
    available = 7 if rank == 0 else 5
    return [_train(rank, world, overrides, on, available) for on in (True, False)]


@pytest.mark.deadline  # compares rates timed on each worker with the group's: a starved worker skews them
def test_throughput_flops_and_memory_over_two_workers_leave_the_weights_and_rng_alone():
    outcomes = run_gloo(2, _both, ("accum.steps=1",))
    assert [o.error for o in outcomes] == [None, None], [o.message for o in outcomes]
    for outcome in outcomes:
        measured, plain = outcome.value
        for name, w in plain["weights"].items():  # the counted step changed nothing
            assert torch.equal(measured["weights"][name], w), name
        assert torch.equal(measured["rng"], plain["rng"])
        assert not any("samples_per_s" in k for r in plain["metrics"] for k in r)
    first, second = (o.value[0]["metrics"] for o in outcomes)
    assert first == second  # every worker holds the same interval metrics
    m = first[0]  # step 3
    assert m["flops_per_sample"] == TINY_FLOPS_PER_SAMPLE
    assert m["samples_per_s"] == pytest.approx(m["samples_per_s/rank0"] + m["samples_per_s/rank1"])
    assert m["samples_per_s/rank0"] > 0 and m["samples_per_s/rank1"] > 0
    for r in (0, 1):
        assert m[f"gflops_per_s/rank{r}"] == pytest.approx(m[f"samples_per_s/rank{r}"] * TINY_FLOPS_PER_SAMPLE / 1e9)
    assert m["gflops_per_s"] == pytest.approx(m["gflops_per_s/rank0"] + m["gflops_per_s/rank1"])
    assert m["cpu_peak_rss_gib"] == max(m["cpu_peak_rss_gib/rank0"], m["cpu_peak_rss_gib/rank1"]) > 0.05
    assert "mfu" not in m and "tflops_per_s" not in m  # a CPU has no known peak
    # Each worker counts its own units: the sum is the engine's global units per second of step
    # time (each worker counting the global units would double it).
    for r in first:
        assert 0.7 < r["samples_per_s"] / r["sample_size_per_s"] < 1.4, r


def test_a_configured_peak_gives_mfu_on_a_cpu():
    m = _train(0, 1, ("logging.throughput.peak_tflops=0.001",), True, 7)["metrics"][0]
    assert m["mfu"] == pytest.approx(m["gflops_per_s"] / 1e3 / 0.001)


def test_throughput_can_be_turned_off():
    cfg = load_config(None, ["logging.throughput.enabled=false"])
    engine = Engine(fakes.make_model(), fakes.mean_loss, fakes.config().engine, total_steps=2)
    cb = Throughput(cfg.logging.throughput, engine, fakes.mean_loss)
    x, y = fakes.regression_data(n=BATCH)
    cb.before_step(0, [(x, y)])
    cb.on_step(engine.train_step([(x, y)]), 1, 0)
    assert cb.flops_per_sample is None and cb.interval_meters() == {} and cb.interval_metrics({}) == {}


def test_a_count_that_fails_leaves_out_the_flop_metrics_with_a_warning_and_the_run_goes_on():
    calls = {"n": 0}

    def first_call_runs_out_of_memory(model, batch, ctx):
        calls["n"] += 1
        if calls["n"] <= 2:  # the count on the meta copy, then on the real one
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return fakes.mean_loss(model, batch, ctx)

    cfg = fakes.config("schedules.lr.value=0.05", "loop.max_steps=4", "logging.every_steps=2")
    engine = Engine(fakes.make_model(), first_call_runs_out_of_memory, cfg.engine, total_steps=4)
    intervals = []

    class Intervals(Throughput):
        def on_interval(self, metrics, step):
            intervals.append(metrics)

    cb = Intervals(cfg.logging.throughput, engine, first_call_runs_out_of_memory)
    with pytest.warns(UserWarning, match=r"could not be counted \(no room for a copy of the model\)"):
        Loop(engine, FakeSource(7), RecordingReporter(engine), LoopSettings.of(cfg), evaluate_mse, [cb]).run()
    assert engine.step == 4 and [sorted(k for k in m if "flops" in k or k == "mfu") for m in intervals] == [[], []]
    assert all(m["samples_per_s"] > 0 for m in intervals)


def test_a_criterion_that_needs_values_is_counted_on_a_real_copy_after_the_meta_one_fails():
    devices = []

    def branches_on_a_value(model, batch, ctx):
        devices.append(batch[0].device.type)
        loss = prod_loss(model, batch, ctx)
        return loss if loss.loss.item() > -1 else loss  # .item() has no value on meta

    cfg = fakes.config()
    engine = Engine(fakes.make_model(), branches_on_a_value, cfg.engine, total_steps=2)
    cb = Throughput(cfg.logging.throughput, engine, branches_on_a_value)
    cb.before_step(0, [fakes.regression_data(n=BATCH)])
    assert devices == ["meta", "cpu"] and cb.flops_per_sample == TINY_FLOPS_PER_SAMPLE


def test_the_count_includes_attention_and_skips_a_compiled_forward():
    """The lm model's FLOPs per target token: 3 x the forward's matrix products (12 d^2 per block
    and the 256-way head) and the attention's T x T scores (QK^T and AV, forward and the two-fold
    backward). A CPU kernel of fused attention has no FLOP formula: a count on the live kernel
    would leave attention out. The copy drops ``nn.Module.compile``'s forward, which is bound to
    the original module (its backward would reach the live gradients)."""
    from raytrain_loops.callbacks.throughput import plain_copy
    from raytrain_loops.tasks.lm import LMTask

    b, t, d, layers = 2, 16, 32, 2
    task = LMTask(dim=d, layers=layers, heads=4, max_len=t, max_tokens=64)
    model = task.build_model()
    model.blocks[0].compile()  # lazy: nothing is traced unless it runs
    copied = plain_copy(model, "meta")
    assert model.blocks[0]._compiled_call_impl is not None
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in copied.modules())
    assert {p.device.type for p in copied.parameters()} == {"meta"}
    cfg = fakes.config()
    engine = Engine(model, task.criterion, cfg.engine, total_steps=2)
    cb = Throughput(cfg.logging.throughput, engine, task.criterion, plain=plain_copy(model, "meta"))
    tokens = torch.randint(0, 256, (b, t))
    cb.before_step(0, [(tokens, tokens, b * t)])
    assert cb.flops_per_sample == 6 * (12 * d * d * layers + 256 * d) + 12 * t * d * layers
    assert all(p.grad is None for p in model.parameters())


def _sharded(rank: int, world: int):
    """The tiny model sharded by FSDP2 over 2 workers, counted on its plain structure."""
    from raytrain_loops.callbacks.throughput import plain_copy
    from raytrain_loops.engine.distributed.sharding import shard

    cfg = fakes.config(
        "schedules.lr.value=0.01", "logging.every_steps=2", "loop.max_steps=4", "logging.throughput.peak_tflops=0.001"
    )
    torch.manual_seed(0)
    model = fakes.make_model(dropout=0.3)
    plain = plain_copy(model, "meta")
    shard(model, [model.encoder, model.head], torch.device("cpu"))
    engine = Engine(model, fakes.sum_loss, cfg.engine, total_steps=4)
    reporter = RecordingReporter(engine)
    counted = Throughput(cfg.logging.throughput, engine, fakes.sum_loss, plain=plain)
    Loop(engine, FakeSource(7), reporter, LoopSettings.of(cfg), evaluate_mse, [counted]).run()
    return [r["metrics"] for r in reporter.reports]


def test_a_sharded_model_is_counted_whole_and_gives_mfu():
    outcomes = run_gloo(2, _sharded)
    assert [o.error for o in outcomes] == [None, None], [o.message for o in outcomes]
    first, second = (o.value for o in outcomes)
    assert first == second
    m = first[0]
    assert m["flops_per_sample"] == TINY_MODEL_FLOPS_PER_SAMPLE  # the whole model's, not a shard's
    assert m["gflops_per_s"] == pytest.approx(m["samples_per_s"] * TINY_MODEL_FLOPS_PER_SAMPLE / 1e9)
    assert m["mfu"] == pytest.approx(m["gflops_per_s"] / 2 / 1e3 / 0.001)  # the mean over workers
