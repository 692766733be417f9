"""The engine on CUDA: the LM recipe's model through the loop under NCCL in bf16 and fp16 (DDP,
FSDP, FSDP with regional compilation), the fp16 loss scaler on a real overflow, a bit-exact resume of
the CUDA RNG, pinned batches of both kinds of split, the next batch's copy beside the step, and
AdamW's fused kernel.

Skipped where no GPU is present (the project's CI machines); run on a GPU machine with
``python -m pytest -m gpu``. The process-group tests run on every GPU of the machine (one
process each) and on one.
"""

from __future__ import annotations

import copy
import functools
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from raytrain_loops.config import load_config
from raytrain_loops.config.engine import CompileConfig
from raytrain_loops.engine import Decision, Engine, LossOutput
from raytrain_loops.engine.distributed.sharding import prepare_model, shard
from raytrain_loops.engine.loop import Callback, Loop, LoopSettings
from raytrain_loops.recipes import resolve
from raytrain_loops.tasks.lm import LMTask
from tests.support import fakes
from tests.support.gloo import run_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = 80


def _lm_task() -> LMTask:
    # The stdlib's email package: a few hundred KB of text, prepared in seconds.
    source = Path(sysconfig.get_paths()["stdlib"]) / "email"
    return LMTask(dim=128, layers=2, heads=4, max_len=256, max_tokens=4096, val_percent=20.0, source=str(source))


def _rows(task: LMTask, data_dir: Path, split: str) -> list:
    """Each Parquet row of a split as one collated micro-batch (one packed batch of sequences)."""
    import pyarrow.parquet as pq

    path = task.splits(data_dir)[split].path
    table = pq.read_table(path).to_pydict()
    batches = []
    for tokens, lengths in zip(table["tokens"], table["lengths"], strict=True):
        row = {"tokens": np.array([tokens], dtype=object), "lengths": np.array([lengths], dtype=object)}
        batches.append(task.collate(row))
    return batches


class ListSource:
    """This worker's share of a list of batches: every ``world``-th from ``rank``."""

    def __init__(self, train: list, evaluation: list, rank: int, world: int):
        self.train, self.eval = train[rank::world], evaluation[rank::world]
        self.batches_per_epoch, self.has_eval = len(self.train), bool(self.eval)

    def batches(self, split: str, epoch: int, start: int = 0):
        return (self.train if split == "train" else self.eval)[start:]


class Recorder:
    def __init__(self):
        self.reports: list[dict] = []

    def report(self, metrics, checkpoint):
        self.reports.append(dict(metrics))


class Losses(Callback):
    """Records each step's decision and loss."""

    def __init__(self):
        self.steps: list[tuple[str, float]] = []

    def on_step(self, result, step, epoch):
        self.steps.append((result.decision.value, result.loss))


def _lm_under_nccl(rank: int, world: int, dtype: str, data_dir: str, strategy: str = "ddp", compiled: bool = False):
    task = _lm_task()
    task.prepare(Path(data_dir))  # already written by the test: this reads the stats back
    train, evaluation = _rows(task, Path(data_dir), "train"), _rows(task, Path(data_dir), "eval")
    cfg = load_config(
        resolve("lm"),
        [f"precision.dtype={dtype}", f"loop.max_steps={STEPS}", "eval.every_steps=0", "logging.every_steps=10"],
    )
    torch.manual_seed(0)
    model = task.build_model().cuda()
    prepare_model(model, task.blocks(model), compile_cfg=CompileConfig(enabled=compiled, dynamic=True))
    if strategy == "fsdp":
        shard(model, task.blocks(model), torch.device("cuda", rank), dtype)
    else:
        model = DDP(model, device_ids=[rank])
    engine = Engine(model, task.criterion, cfg.engine, total_steps=STEPS)
    source, reporter, losses = ListSource(train, evaluation, rank, world), Recorder(), Losses()
    Loop(engine, source, reporter, LoopSettings.of(cfg), task.evaluate, [losses]).run()
    final = reporter.reports[-1]
    return {
        "device": str(engine.device),
        "collective_device": str(engine._cdev),
        "steps": losses.steps,
        "applied": engine.step,
        "eval_bpb": final["eval_bpb"],
        "eval_unigram_bpb": final["eval_unigram_bpb"],
        "loss_scale": engine.scaler.get_scale() if engine.scaler.is_enabled() else None,
        "weights": {k: _full(v).float().cpu() for k, v in engine.module.state_dict().items()},
    }


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.parametrize("strategy,compiled", [("ddp", False), ("fsdp", False), ("fsdp", True)])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("world", sorted({1, torch.cuda.device_count()}))
def test_the_lm_recipe_trains_on_gpus_under_nccl(tmp_path, dtype, world, strategy, compiled):
    _lm_task().prepare(tmp_path)
    outcomes = run_group("nccl", world, _lm_under_nccl, dtype, str(tmp_path), strategy, compiled, timeout=400)
    assert [o.error for o in outcomes] == [None] * world, [o.message for o in outcomes]
    first = outcomes[0].value
    assert first["device"] == "cuda:0" and first["collective_device"] == "cuda:0"
    applied = [loss for decision, loss in first["steps"] if decision == "applied"]
    if dtype == "bf16":
        assert first["applied"] == STEPS and len(first["steps"]) == STEPS  # bf16 needs no loss scale: no skips
    else:
        # fp16: the scale starts high, so the first steps may overflow; each skip is counted and
        # the run still makes its STEPS updates.
        skipped = [d for d, _ in first["steps"] if d != "applied"]
        assert set(skipped) <= {"overflow"} and first["applied"] == STEPS
        assert first["loss_scale"] is not None and first["loss_scale"] >= 1.0
    assert np.mean(applied[-10:]) < 0.75 * np.mean(applied[:10])  # per-token loss falls
    assert first["eval_bpb"] < first["eval_unigram_bpb"]  # better than the byte frequencies alone
    for other in outcomes[1:]:  # DDP keeps every GPU's weights equal (FSDP: the gathered ones)
        for name, w in first["weights"].items():
            assert torch.equal(w, other.value["weights"][name]), name


def test_fp16_overflow_on_cuda_skips_the_update_keeps_the_weights_and_halves_the_scale():
    cfg = fakes.config("precision.dtype=fp16", "precision.init_scale=1024")
    model = fakes.make_model().cuda()
    blow_up = {"on": True}

    def loss_fn(m, batch, ctx):
        x, y = batch
        out = m(x)
        if blow_up["on"]:
            out = out * torch.tensor(float("inf"), device=out.device)
        return LossOutput(torch.nn.functional.mse_loss(out.float(), y), sample_size=len(x))

    engine = Engine(model, loss_fn, cfg.engine, total_steps=10)
    x, y = fakes.regression_data()
    batch = (x.cuda(), y.cuda())
    before = fakes.params(engine.module)
    result = engine.train_step([batch])
    assert result.decision is Decision.SKIP_OVERFLOW
    assert engine.step == 0 and engine.counts["overflow"] == 1
    assert engine.scaler.get_scale() == 512.0
    for name, value in fakes.params(engine.module).items():
        assert torch.equal(value, before[name]), name
    blow_up["on"] = False
    assert engine.train_step([batch]).decision is Decision.APPLY and engine.step == 1


def test_a_resumed_engine_redraws_the_same_cuda_dropout_masks():
    cfg = fakes.config("schedules.lr.value=0.05")
    x, y = fakes.regression_data(n=64)
    batch = (x.cuda(), y.cuda())

    def engine():
        return Engine(fakes.make_model(dropout=0.5).cuda(), fakes.mean_loss, cfg.engine, total_steps=10)

    straight = engine()
    for _ in range(3):
        straight.train_step([batch])
    saved = copy.deepcopy(straight.state_dict())
    for _ in range(3):
        straight.train_step([batch])
    resumed = engine()
    torch.cuda.manual_seed_all(123)  # a restarted process starts from other CUDA RNG states
    resumed.load_state_dict(saved)
    for _ in range(3):
        resumed.train_step([batch])
    for name, value in straight.module.state_dict().items():
        assert torch.equal(value, resumed.module.state_dict()[name]), name
    # Without the saved RNG the masks differ, and so do the weights: the check above can fail.
    redrawn = engine()
    torch.cuda.manual_seed_all(123)
    saved.pop("rng")
    redrawn.load_state_dict(saved)
    for _ in range(3):
        redrawn.train_step([batch])
    assert not torch.equal(straight.module.encoder.weight, redrawn.module.encoder.weight)


def test_map_style_batches_of_a_cuda_worker_are_pinned_and_copied_to_it():
    from raytrain_loops.data import GroupedBatchSampler, MapBatches
    from raytrain_loops.engine.devices import to_device
    from raytrain_loops.tasks import MapSplit

    rows = torch.utils.data.TensorDataset(torch.randn(24, 3), torch.arange(24))
    sampler = functools.partial(GroupedBatchSampler, [i % 2 for i in range(24)])
    splits = {"train": MapSplit(rows, batch_sampler=sampler), "eval": MapSplit(rows)}
    for loader_workers in (0, 2):
        data = load_config(None, ["data.batch_size=4", f"data.loader_workers={loader_workers}"]).data
        on_gpu = MapBatches(splits, data, 0, 0, 1, torch.device("cuda", 0))
        for split in ("train", "eval"):
            x, ids = next(iter(on_gpu.batches(split, 0)))
            assert x.is_pinned() and ids.is_pinned(), (split, loader_workers)  # non_blocking copies are async
            moved = to_device({"x": x, "ids": ids}, torch.device("cuda", 0))
            assert moved["x"].is_cuda and torch.equal(moved["ids"].cpu(), ids)
        on_cpu = MapBatches(splits, data, 0, 0, 1, torch.device("cpu"))
        x, _ = next(iter(on_cpu.batches("train", 0)))
        assert not x.is_pinned()  # a CPU worker pins nothing


def test_parquet_batches_of_a_cuda_worker_are_pinned_and_adam_runs_fused(tmp_path):
    from raytrain_loops.driver.preflight import prepare
    from raytrain_loops.runtime.batches import Batches, preprocessed_here

    tiny = ["task.params.vocab=512", "task.params.dim=32", "task.params.layers=1", "task.params.heads=2"]
    tiny += ["task.params.max_len=64", "task.params.max_tokens=256", "task.params.tokens=20000"]
    # The engine is built here, not by the wiring that resolves precision.dtype=auto first.
    config = load_config(resolve("lm_gpt"), [*tiny, f"data.dir={tmp_path}", "precision.dtype=bf16"])
    task, splits, rows = prepare(config, None)
    for device, pinned in ((torch.device("cuda", 0), True), (torch.device("cpu"), False)):
        batch = next(iter(Batches(task, config, splits, rows, 0, 1, device, preprocessed_here).batches("train", 0)))
        assert [t.is_pinned() for t in batch if torch.is_tensor(t)] == [pinned] * 3, device
    engine = Engine(task.build_model().cuda(), task.criterion, config.engine, total_steps=2)
    assert (engine.optimizer.defaults["fused"], engine.optimizer.defaults["foreach"]) == (True, False)
    engine.train_step([batch])
    assert engine.step == 1


def test_flex_attention_trains_as_the_boolean_mask_does_on_cuda(tmp_path):
    """``task.params.attention=flex`` against ``sdpa`` on rows of 256 tokens holding several
    sequences, the same weights: the same loss and gradients (fp32, FlexAttention unfused here,
    as outside a compiled block), then the same loss after three updates of SGD."""
    params = {"data": "generated", "vocab": 512, "dim": 64, "layers": 2, "heads": 2, "max_len": 256}
    params |= {"max_tokens": 1024, "tokens": 20000, "packing": "fixed"}
    task = LMTask(**params)
    task.prepare(tmp_path)
    batches = [tuple(t.cuda() if torch.is_tensor(t) else t for t in b) for b in _rows(task, tmp_path, "train")[:4]]
    torch.manual_seed(0)
    sdpa = task.build_model().cuda()
    flex = LMTask(**{**params, "attention": "flex"}).build_model().cuda()
    flex.load_state_dict(sdpa.state_dict())
    losses = {}
    for name, model in (("sdpa", sdpa), ("flex", flex)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses[name] = []
        for batch in batches:
            opt.zero_grad()
            out = task.criterion(model, batch, None)
            (out.loss / out.sample_size).backward()
            losses[name].append(out.loss.item() / out.sample_size)
            if len(losses[name]) == 1:
                grads = [p.grad.clone() for p in model.parameters()]
                if name == "sdpa":
                    first = grads
                else:
                    for a, b in zip(grads, first, strict=True):
                        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
            opt.step()
    torch.testing.assert_close(torch.tensor(losses["flex"]), torch.tensor(losses["sdpa"]), atol=1e-4, rtol=1e-4)


def test_the_next_batch_is_copied_to_the_gpu_beside_the_step():
    """Six steps of a fixed length, each using its batch (64 MiB, pinned): with the copy ahead on
    its side stream they take about six steps and one copy (CUDA events on the step's stream);
    with each copy on the step's stream before its step, six of each."""
    from raytrain_loops.engine.devices import copied_ahead

    dev = torch.device("cuda", 0)
    host = [torch.full((64 * 2**20,), i, dtype=torch.uint8).pin_memory() for i in range(6)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def elapsed(work) -> float:
        torch.cuda.synchronize()
        start.record()
        work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    seen = []
    cycles = 1000

    def steps(groups):
        for (batch,), _ in groups:
            torch.cuda._sleep(cycles)
            seen.append(batch[:1])  # the batch, as this stream sees it after its step

    def ahead() -> None:
        steps(copied_ahead((([t], 0.0) for t in host), dev))

    def serial() -> None:
        steps(([t.to(dev, non_blocking=True)], 0.0) for t in host)

    # Warm-up: the caching allocator's first blocks (a synchronous cudaMalloc) and the clocks' ramp.
    for work in (ahead, serial, ahead, serial):
        elapsed(work)
    copy_ms = min(elapsed(lambda: host[0].to(dev, non_blocking=True)) for _ in range(3))
    cycles = int(1e6 * 4 * copy_ms / min(elapsed(lambda: torch.cuda._sleep(int(1e6))) for _ in range(3)))
    seen.clear()
    times = {"ahead": [], "serial": []}
    for _ in range(3):
        times["ahead"].append(elapsed(ahead))
        times["serial"].append(elapsed(serial))
    assert [int(b) for b in torch.cat(seen).tolist()] == list(range(6)) * 6  # each step saw its own batch
    best = {k: min(v) for k, v in times.items()}
    print(f"copy {copy_ms:.2f} ms; six steps: ahead {best['ahead']:.2f} ms, serial {best['serial']:.2f} ms")
    assert best["ahead"] < best["serial"] - 0.5 * 5 * copy_ms, (times, copy_ms)


class Intervals(Callback):
    """Records the metrics of every logging interval."""

    def __init__(self):
        self.metrics: list[dict[str, float]] = []

    def on_interval(self, metrics, step):
        self.metrics.append(dict(metrics))


def test_throughput_reports_tflops_mfu_and_the_intervals_peak_gpu_memory():
    from raytrain_loops.callbacks.throughput import Throughput, gpu_peak_tflops

    peak = gpu_peak_tflops(torch.cuda.get_device_name())  # None (and a warning) for a GPU not in the table
    overrides = [] if peak else ["logging.throughput.peak_tflops=100"]
    cfg = fakes.config("schedules.lr.value=0.01", "precision.dtype=bf16", "logging.every_steps=4", *overrides)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [(torch.randn(256, 1024, device="cuda", generator=g),) * 2 for _ in range(12)]
    engine = Engine(model, fakes.mean_loss, cfg.engine, total_steps=12)
    intervals = Intervals()
    callbacks = [Throughput(cfg.logging.throughput, engine, fakes.mean_loss), intervals]
    Loop(engine, ListSource(batches, [], 0, 1), Recorder(), LoopSettings.of(cfg), None, callbacks).run()
    m = intervals.metrics[-1]
    # Per sample: the forward's two matrix products, both weight gradients and the second
    # layer's input gradient (the first layer's input needs none): 5 x 2 x 1024 x 4096.
    assert m["flops_per_sample"] == 5 * 2 * 1024 * 4096
    assert m["tflops_per_s"] == pytest.approx(m["samples_per_s"] * m["flops_per_sample"] / 1e12)
    assert m["mfu"] == pytest.approx(m["tflops_per_s"] / (peak or 100.0)) and 0 < m["mfu"] < 1
    # fp32 weights and gradients (plain SGD: no optimizer state) were allocated in the interval.
    held = 2 * 4 * sum(p.numel() for p in model.parameters()) / 2**30
    assert held < m["gpu_max_allocated_gib"] == m["gpu_max_allocated_gib/rank0"] < held + 1.0
    assert "cpu_peak_rss_gib" not in m
