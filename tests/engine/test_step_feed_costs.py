"""What a step costs around the model: the loop's calls per update into meters, callbacks and
reports, its host reads, the batches' pinning and the copy ahead to the device, the optimizer's
kernel, and a compiled step that builds its graphs once (docs/benchmarks.md, "Feeding the step").
The lm_gpt recipe at a tiny size, wired as local mode wires it (the run's own callbacks)."""

from __future__ import annotations

import functools
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch._dynamo.utils import counters

from raytrain_loops.checkpoint.local_reporter import LocalReporter
from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.config.engine import CompileConfig
from raytrain_loops.driver.preflight import prepare
from raytrain_loops.engine import Engine
from raytrain_loops.engine.devices import copied_ahead, pins
from raytrain_loops.engine.distributed.sharding import prepare_model
from raytrain_loops.engine.loop import Callback
from raytrain_loops.engine.optim.optimizer import adam_kernel
from raytrain_loops.recipes import resolve
from raytrain_loops.runtime import local
from raytrain_loops.runtime.batches import Batches, preprocessed_here
from raytrain_loops.runtime.wiring import WorkerPayload, wire
from raytrain_loops.tasks.lm import IGNORE, LMTask
from tests.support import fakes

TINY = [
    "task.params.vocab=512",
    "task.params.dim=32",
    "task.params.layers=1",
    "task.params.heads=2",
    "task.params.max_len=64",
    "task.params.max_tokens=256",
    "task.params.tokens=20000",
    "scaling.num_workers=0",
    "scaling.use_gpu=false",
    "precision.dtype=fp32",
    "compile.enabled=false",
    "logging.every_steps=10",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
    "run.report_every_steps=1000",
]
GENERATED = {"data": "generated", "vocab": 512, "dim": 32, "layers": 1, "heads": 2, "max_len": 64, "max_tokens": 256}
READS = ("item", "tolist", "cpu", "__float__", "__int__", "__bool__", "__index__")
HOOKS = ("before_step", "on_step", "checkpoint_now", "interval_meters", "interval_metrics", "on_interval")


def _wired(tmp_path: Path, *overrides: str):
    """The lm_gpt recipe at :data:`TINY`'s size, wired in this process as local mode wires it."""
    config = load_config(
        resolve("lm_gpt"), [*TINY, f"data.dir={tmp_path / 'data'}", f"run.storage_path={tmp_path}", *overrides]
    )
    task, splits, rows = prepare(config, None)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    payload = WorkerPayload(config, task, splits, rows, str(run_dir), None)
    sender = local.DisplaySender(local.Display())
    cpu = torch.device("cpu")
    return wire(
        payload,
        0,
        1,
        cpu,
        sender,
        prepare_model=local._prepare_model,
        batches=functools.partial(local._batches, device=cpu),
        reporter=functools.partial(LocalReporter, run_dir=str(run_dir), config=config, sender=sender),
    )


def test_twenty_updates_read_the_host_once_each_and_call_meters_callbacks_and_reports_a_fixed_count(
    tmp_path, monkeypatch
):
    """Host reads (``.item()``, ``.tolist()``, ``.cpu()`` and a tensor's conversion to a number or
    a bool) inside each of 20 updates, logged every 10: one, the decision's, plus the logging
    interval's meters (one all-reduce read; the first interval agrees the names first, one
    more). torch's own Adam reads its step counts, host tensors it keeps on the host (on CUDA,
    fused, it keeps them on the device): not counted. The same updates' calls into the meters,
    the callbacks and the reporter are the same number every update."""
    wired = _wired(tmp_path, "loop.max_steps=20")
    loop, engine = wired.loop, wired.engine
    reads: list[Counter] = []
    calls: list[Counter] = []
    inside = [False]

    def counting(name, original):
        def read(self, *args, **kwargs):
            caller = traceback.extract_stack(limit=2)[0].filename
            if inside[0] and "/torch/optim/" not in caller:
                reads[-1][f"{name} at {caller.split('raytrain_loops/')[-1]}"] += 1
            return original(self, *args, **kwargs)

        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))

    def counted(key, method):
        def call(*args, **kwargs):
            if inside[0]:
                calls[-1][key] += 1
            return method(*args, **kwargs)

        return call

    for cb in loop.callbacks:
        for hook in HOOKS:
            setattr(cb, hook, counted(f"{type(cb).__name__}.{hook}", getattr(cb, hook)))
    engine.meters.add = counted("meters.add", engine.meters.add)
    engine.meters.reduce = counted("meters.reduce", engine.meters.reduce)
    loop.reporter.report = counted("report", loop.reporter.report)
    step = loop._step

    def one_update(*args, **kwargs):
        reads.append(Counter())
        calls.append(Counter())
        inside[0] = True
        try:
            return step(*args, **kwargs)
        finally:
            inside[0] = False

    loop._step = one_update
    loop.run(wired.position)
    assert engine.step == 20 and len(reads) == 20
    decision = "tolist at engine/update/step.py"
    assert all(set(r) == {decision} and r[decision] == 1 for i, r in enumerate(reads) if i not in (9, 19)), reads
    interval = "tolist at engine/meters.py"
    assert [reads[9], reads[19]] == [Counter({decision: 1, interval: 2}), Counter({decision: 1, interval: 1})]

    names = sorted(type(cb).__name__ for cb in loop.callbacks)
    # The criterion's bpt; loss, grad_norm, lr, sample_size, its rate and the step's 3 times.
    plain = Counter({"meters.add": 9})
    plain.update({f"{n}.{h}": 1 for n in names for h in ("before_step", "on_step", "checkpoint_now")})
    # An interval adds one reduction, and throughput's 4 meters (memory, FLOPs a sample, its rates).
    logged = plain + Counter({"meters.reduce": 1, "meters.add": 4})
    logged.update({f"{n}.{h}": 1 for n in names for h in ("interval_meters", "interval_metrics", "on_interval")})
    assert [calls[i] for i in (0, 5, 18)] == [plain] * 3
    assert [c == plain for c in calls].count(True) == 18 and calls[9] == logged
    # The run's last update asks no callback for a checkpoint: the run's final one follows the loop.
    assert calls[19] == logged - Counter({f"{n}.checkpoint_now": 1 for n in names})
    assert "report" not in sum(calls, Counter())  # none due inside the 20 updates: the run's last comes after


def test_a_cuda_worker_pins_parquet_and_map_style_batches_and_the_copy_ahead_is_the_cuda_path_only(tmp_path):
    """The pinning decision for both kinds of split (on CPU: the decision, not the pinning);
    the copy ahead leaves a CPU worker's groups as they are, in order, with their waits."""
    config = load_config(resolve("lm_gpt"), [*TINY, f"data.dir={tmp_path / 'data'}"])
    task, splits, rows = prepare(config, None)
    for device, pinned in (("cuda", True), (torch.device("cuda", 1), True), ("cpu", False), (None, False)):
        assert pins(device) is pinned
        source = Batches(task, config, splits, rows, 0, 1, device, preprocessed_here)
        assert (source.pin, source.maps.pin_memory) == (pinned, pinned)
    source = Batches(task, config, splits, rows, 0, 1, "cpu", preprocessed_here)
    first = next(iter(source.batches("train", 0)))
    assert not first[0].is_pinned()
    groups = [([first], 0.5), ([None, first], 0.25)]
    assert list(copied_ahead(iter(groups), torch.device("cpu"))) == groups


class _Preprocessed(LMTask):
    """The lm task with a ``preprocess`` that passes its rows on as they are."""

    def preprocess(self, batch, train):
        return batch


def test_a_split_is_collated_ahead_on_a_thread_at_most_prefetch_batches_ahead(tmp_path):
    """A Parquet split is read, cut and collated (pinned on CUDA) on a thread,
    ``data.prefetch_batches`` batches ahead of the loop, which takes the same batches in the same
    order as when its own thread does it all (``prefetch_batches=0``); so is one through
    ``preprocess``; a stream closed early ends the threads, and an error in ``collate`` is raised
    in the loop."""
    config = load_config(resolve("lm_gpt"), [*TINY, f"data.dir={tmp_path / 'data'}"])
    task, splits, rows = prepare(config, None)
    collate, threads = task.collate, []

    def recorded(batch):
        threads.append(threading.current_thread().name)
        if len(threads) == fail_at:
            raise ValueError("a row the task cannot collate")
        return collate(batch)

    task.collate, fail_at = recorded, None
    inline = load_config(resolve("lm_gpt"), [*TINY, f"data.dir={tmp_path / 'data'}", "data.prefetch_batches=0"])
    here = list(Batches(task, inline, splits, rows, 0, 1, "cpu", preprocessed_here).batches("train", 0))
    assert len(here) > 20 and set(threads) == {threading.current_thread().name}

    source = Batches(task, config, splits, rows, 0, 1, "cpu", preprocessed_here)
    threads.clear()
    ahead = [b for b in source.batches("train", 0)]
    assert set(threads) == {"collate-ahead"} and len(threads) == len(here)
    for got, want in zip(ahead, here, strict=True):
        assert all(torch.equal(got[i], want[i]) for i in (0, 1, 3)) and got[2] == want[2]

    # A split through ``preprocess`` (here in the process, as local mode runs it): the same.
    passed = _Preprocessed(**config.task.params)
    passed.collate = recorded
    threads.clear()
    through = list(Batches(passed, config, splits, rows, 0, 1, "cpu", preprocessed_here).batches("train", 0))
    assert set(threads) == {"collate-ahead"} and [b[2] for b in through] == [b[2] for b in here]

    threads.clear()
    stream = iter(source.batches("train", 0))
    next(stream)
    # One taken, prefetch_batches (2) queued, one collated and waiting for room: 4 calls, no more.
    for _ in range(500):
        if len(threads) >= 4:
            break
        time.sleep(0.01)
    time.sleep(0.2)
    assert len(threads) == 2 + 2
    stream.close()
    assert not [t for t in threading.enumerate() if t.name in ("collate-ahead", "parquet-prefetch")]
    time.sleep(0.1)
    assert len(threads) == 4  # nothing collated after the close

    threads.clear()
    fail_at = 3
    with pytest.raises(ValueError, match="cannot collate"):
        for _ in source.batches("train", 0):
            pass
    assert threads == ["collate-ahead"] * 3
    assert not [t for t in threading.enumerate() if t.name in ("collate-ahead", "parquet-prefetch")]


def test_adam_runs_fused_on_cuda_foreach_elsewhere_and_a_checkpoint_keeps_this_devices_choice():
    assert adam_kernel({"cuda"}, {torch.float32, torch.bfloat16}) == {"fused": True, "foreach": False}
    assert adam_kernel({"cuda"}, {torch.float16}) == {"fused": True, "foreach": False}
    for devices, dtypes in (({"cpu"}, {torch.float32}), ({"cuda", "cpu"}, {torch.float32}), ({"cuda"}, set())):
        assert adam_kernel(devices, dtypes) == {"fused": False, "foreach": True}
    assert adam_kernel({"cuda"}, {torch.float8_e4m3fn}) == {"fused": False, "foreach": True}

    engine = Engine(fakes.make_model(), fakes.sum_loss, fakes.config("optim.name=adamw").engine, total_steps=4)
    assert (engine.optimizer.defaults["fused"], engine.optimizer.defaults["foreach"]) == (False, True)
    x, y = fakes.regression_data()
    engine.train_step([(x, y)])
    state = engine.state_dict()
    for group in state["optimizer"]["param_groups"]:  # as a CUDA worker's checkpoint holds them
        group.update(fused=True, foreach=False)
    engine.load_state_dict(state)
    assert {(g["fused"], g["foreach"]) for g in engine.optimizer.param_groups} == {(False, True)}
    engine.train_step([(x, y)])
    assert engine.step == 2 and np.isfinite(engine.meters.reduce()["loss"])


class _Graphs(Callback):
    """The graphs dynamo has built, after each update."""

    def __init__(self):
        self.after: list[int] = []

    def on_step(self, result, step, epoch):
        self.after.append(counters["stats"]["unique_graphs"])


def _graphs_over_30_updates(tmp_path: Path, packing: str) -> list[int]:
    torch._dynamo.reset()
    counters.clear()
    wired = _wired(
        tmp_path,
        "loop.max_steps=30",
        f"task.params.packing={packing}",
        "compile.enabled=true",
        "compile.backend=eager",
        "compile.dynamic=null",
        "logging.throughput.enabled=false",
    )
    graphs = _Graphs()
    wired.loop.callbacks.append(graphs)
    wired.loop.run(wired.position)
    assert wired.engine.step == 30
    return graphs.after


def test_fixed_packing_gives_one_shape_and_the_compiled_step_builds_no_graph_after_its_first_3_updates(tmp_path):
    """The lm_gpt recipe compiled block by block (dynamo's graphs captured, ``backend=eager``):
    with fixed packing every micro-batch is ``max_tokens`` tokens of one shape and no graph is
    built after the first 3 updates of 30; variable packing's shapes keep building them."""
    fixed = _graphs_over_30_updates(tmp_path / "fixed", "fixed")
    assert fixed[0] >= 1 and fixed[2] == fixed[-1], fixed
    variable = _graphs_over_30_updates(tmp_path / "variable", "variable")
    assert variable[-1] > variable[2], variable


def test_the_lm_loss_is_the_models_own_and_a_model_compiled_whole_compiles_it_with_the_head(tmp_path):
    """The lm criterion's loss comes from the model's forward (``targets=``): equal to the
    cross-entropy of its logits, gradients included, and inside the graph that compiling the
    model whole (``compile.scope=model``) captures, so the compiler can fuse it with the head."""
    import torch.nn.functional as F

    task = LMTask(**{**GENERATED, "packing": "fixed", "tokens": 2000})
    task.prepare(tmp_path)
    table = pq.read_table(task.splits(tmp_path)["train"].path).to_pydict()
    batch = task.collate(
        {"tokens": np.array([table["tokens"][0]], object), "lengths": np.array([table["lengths"][0]], object)}
    )
    inputs, targets, _, documents = batch
    torch.manual_seed(0)
    model = task.build_model()
    loss = task.criterion(model, batch, None).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    of_logits = F.cross_entropy(
        model(inputs, documents).flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    of_logits.backward()
    assert torch.equal(loss, of_logits)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters(), strict=True))

    graphs = []

    def capture(gm, example_inputs):  # a dynamo backend that keeps the graphs and runs them as they are
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model.compile(backend=capture)  # what prepare_model does under compile.scope=model
    compiled = task.criterion(model, batch, None).loss
    called = {
        getattr(n.target, "__name__", str(n.target)) for g in graphs for n in g.graph.nodes if n.op == "call_function"
    }
    assert "cross_entropy" in called, sorted(called)
    torch.testing.assert_close(compiled, loss, rtol=1e-6, atol=0)


def test_a_fixed_batch_holds_whole_sequences_in_rows_of_max_len_and_each_sees_only_itself(tmp_path):
    """Every batch of the split is ``(max_tokens / max_len, max_len)``, the split's tokens all
    there once; a sequence's logits in a packed row are those of the sequence alone."""
    params = {**GENERATED, "packing": "fixed", "tokens": 5000}
    task = LMTask(**params)
    task.prepare(tmp_path)
    table = pq.read_table(task.splits(tmp_path)["train"].path).to_pydict()
    batches = [
        task.collate({"tokens": np.array([t], object), "lengths": np.array([ls], object)})
        for t, ls in zip(table["tokens"], table["lengths"], strict=True)
    ]
    assert {tuple(b[0].shape) for b in batches} == {tuple(b[3].shape) for b in batches} == {(4, 64)}
    assert sum(b[2] for b in batches) == 5000 == sum(int((b[1] != IGNORE).sum()) for b in batches)
    assert max(int((b[3] > 0).sum(1).min()) for b in batches) > 32  # rows are filled, not one sequence each

    torch.manual_seed(0)
    model = task.build_model().eval()
    inputs, targets, _, documents = batches[0]
    with torch.no_grad():
        packed = model(inputs, documents)
        for row in range(inputs.shape[0]):
            for doc in documents[row].unique().tolist():
                at = (documents[row] == doc).nonzero().flatten()
                if doc == 0:
                    continue
                alone = model(inputs[row, at][None])[0]  # the sequence by itself, causal attention only
                torch.testing.assert_close(packed[row, at], alone, atol=1e-5, rtol=1e-4)
    with pytest.raises(ConfigError, match=r"task\.params\.max_tokens.*multiple of task\.params\.max_len=64"):
        LMTask(**{**params, "max_tokens": 100})
    with pytest.raises(ConfigError, match=r"task\.params\.compile.*compile\.scope=model"):
        LMTask(**{**params, "compile": True})


def test_flex_attention_gives_the_boolean_masks_logits_and_is_refused_where_it_cannot_serve(tmp_path):
    """``task.params.attention=flex``: FlexAttention's block mask over rows of 256 tokens (blocks
    of 128 that cross sequences, and blocks that do not) gives the logits of the boolean mask with
    the same weights (forward only: FlexAttention has no backward on CPU; the training step's
    gradients are a ``gpu`` test); refused without fixed packing, with dropout, or unknown."""
    params = {**GENERATED, "packing": "fixed", "tokens": 4000, "max_len": 256, "max_tokens": 1024}
    task = LMTask(**params)
    task.prepare(tmp_path)
    table = pq.read_table(task.splits(tmp_path)["train"].path).to_pydict()
    batch = task.collate(
        {"tokens": np.array(table["tokens"][:1], object), "lengths": np.array(table["lengths"][:1], object)}
    )
    inputs, _, _, documents = batch
    assert documents.shape == (4, 256) and int(documents.max()) > 4  # several sequences a row
    torch.manual_seed(0)
    sdpa = task.build_model().eval()
    flex = LMTask(**{**params, "attention": "flex"}).build_model().eval()
    flex.load_state_dict(sdpa.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(flex(inputs, documents), sdpa(inputs, documents), atol=1e-5, rtol=1e-4)
    for change, match in (
        ({"packing": "variable"}, r"task\.params\.attention.*needs task\.params\.packing=fixed"),
        ({"dropout": 0.1}, r"task\.params\.attention.*no attention dropout"),
        ({"attention": "flash"}, r"task\.params\.attention.*one of sdpa, flex; got 'flash'"),
    ):
        with pytest.raises(ConfigError, match=match):
            LMTask(**{**params, "attention": "flex", **change})


def test_compile_scope_model_compiles_the_whole_model_and_needs_no_blocks():
    model = LMTask(**GENERATED).build_model()
    prepare_model(model, [], compile_cfg=CompileConfig(enabled=True, scope="model", backend="eager"))
    assert model._compiled_call_impl is not None
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in model.blocks)
    with pytest.raises(ValueError, match="compile.enabled act on the task's blocks"):
        prepare_model(model, [], compile_cfg=CompileConfig(enabled=True, backend="eager"))
    blocks = LMTask(**GENERATED).build_model()
    prepare_model(blocks, list(blocks.blocks), compile_cfg=CompileConfig(enabled=True, backend="eager"))
    assert blocks._compiled_call_impl is None and all(b._compiled_call_impl is not None for b in blocks.blocks)
