"""FSDP2 (``scaling.strategy=fsdp``) against DDP on real gloo process groups: the same updates,
with accumulation, sum normalisation, global clipping, an EMA and bf16; sharded checkpoints
saved on two workers and loaded on one; activation checkpointing and regional compilation that
leave names and losses as they were."""

from __future__ import annotations

import copy
import io
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from raytrain_loops.engine import Engine
from raytrain_loops.engine.distributed.sharding import shard
from tests.support import fakes
from tests.support.gloo import run_gloo
from tests.support.plans import trained_rows
from tests.support.recording import restored
from tests.support.run_dirs import RayWouldStart, spiral_config, started_run
from tests.support.runfiles import records

STEPS = 4
# Two micro-batches per update of uneven sizes, different on each worker: sum normalisation must
# divide by the global sample count, not by a per-worker one.
SIZES = {0: [3, 7], 1: [6, 4]}
TRAIN = [
    "optim.name=adamw",
    "optim.param_groups=decay_split",
    "schedules.lr.value=0.05",
    "schedules.weight_decay.value=0.1",
    "loss.reduction=sum",
    "accum.steps=2",
    "clip.mode=global",
    "clip.max_norm=0.5",  # below the gradients' norm: clipping acts on every step
    "ema.enabled=true",
    "ema.arithmetic=weighted_sum",  # split into flat pieces of each worker's local shards
    "schedules.ema_momentum.value=0.5",
]


def _blocks(model):
    return [model.encoder, model.head]


def _full(state: dict) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def _engine(strategy: str, overrides: list[str], dtype: str = "fp32") -> Engine:
    """The tiny model under DDP or FSDP (blocks: encoder and head, then the root)."""
    config = fakes.config(*TRAIN, f"precision.dtype={dtype}", *overrides).engine
    model = fakes.make_model(d_hidden=32)
    ema = None
    if strategy == "fsdp":
        ema = copy.deepcopy(model)
        shard(model, _blocks(model), torch.device("cpu"), dtype)
        shard(ema, _blocks(ema), torch.device("cpu"), dtype)
    else:
        model = DDP(model)
    return Engine(model, fakes.sum_loss, config, total_steps=STEPS, ema_module=ema)


def _batches(rank: int, step: int):
    x, y = fakes.regression_data(n=40, seed=100 + 10 * step + rank)
    return fakes.split(x, y, SIZES[rank])


def _train(rank: int, world: int, strategy: str, dtype: str, overrides: list[str]):
    engine = _engine(strategy, overrides, dtype)
    norms = []
    for step in range(STEPS):
        result = engine.train_step(_batches(rank, step))
        assert result.applied, result.skipped
        norms.append(result.grad_norm)
    return {
        "model": _full(engine.module.state_dict()),
        "ema": _full(engine.ema.state_dict()),
        "norms": norms,
        "names": [n for n, _ in engine.module.named_parameters()],
    }


def _both(rank: int, world: int, dtype: str, overrides: list[str]):
    return {s: _train(rank, world, s, dtype, overrides) for s in ("ddp", "fsdp")}


def _run(dtype: str = "fp32", overrides: list[str] | None = None):
    """DDP's and FSDP's results on each of 2 workers (one process group for both: fewer spawns)."""
    outcomes = run_gloo(2, _both, dtype, overrides or [])
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message + outcomes[1].message
    values = [o.value for o in outcomes]
    return [v["ddp"] for v in values], [v["fsdp"] for v in values]


# fp32: the same sums in another order (reduce-scatter of shards against an all-reduce), a few
# float32 ulps after 4 AdamW steps. bf16: FSDP gathers the parameters in bf16 where autocast
# under DDP rounds them per op (norm weights stay fp32 under autocast): differences of bf16's
# resolution (2^-8 relative) on the gradients, damped by Adam's normalisation.
TOLERANCE = {"fp32": dict(atol=2e-6, rtol=1e-5), "bf16": dict(atol=1e-2, rtol=1e-2)}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fsdp_and_ddp_give_the_same_updates_with_accumulation_sum_clipping_and_ema(dtype):
    ddp, fsdp = _run(dtype)
    start = fakes.params(fakes.make_model(d_hidden=32))
    assert fsdp[0]["names"] == ddp[0]["names"] == list(start), "names are those of the plain model"
    moved = max((ddp[0]["model"][k] - start[k]).abs().max().item() for k in start)
    assert moved > 0.05, "the updates must move the weights"
    tol = TOLERANCE[dtype]
    worst = max((fsdp[1]["model"][k] - ddp[0]["model"][k]).abs().max().item() for k in start)
    print(f"{dtype}: largest |fsdp - ddp| after {STEPS} steps: {worst:.3g}")
    for rank in (0, 1):
        for name in start:
            torch.testing.assert_close(fsdp[rank]["model"][name], ddp[0]["model"][name], **tol, msg=name)
            torch.testing.assert_close(fsdp[rank]["ema"][name], ddp[0]["ema"][name], **tol, msg=f"ema {name}")
        # The clipping threshold is below every norm: a norm over one shard only would clip less.
        torch.testing.assert_close(fsdp[rank]["norms"], ddp[0]["norms"], **tol)
    assert min(ddp[0]["norms"]) > 0.5


def test_fsdp_per_parameter_clipping_takes_each_parameters_whole_norm():
    over = ["clip.mode=per_param", "clip.max_norm=0.05"]
    ddp, fsdp = _run("fp32", over)
    for name, ref in ddp[0]["model"].items():
        torch.testing.assert_close(fsdp[1]["model"][name], ref, **TOLERANCE["fp32"], msg=name)


class Gained(torch.nn.Module):
    """TinyNet whose output adds ``(gain[1] - 1) * 1e38``: zero in the forward, but the gradient
    of ``gain[1]`` overflows under any loss scale. Sharded over two workers, ``gain[1]`` lies in
    worker 1's shard only: worker 0's own gradients are all finite."""

    def __init__(self):
        super().__init__()
        self.net = fakes.make_model(d_hidden=32)
        self.gain = torch.nn.Parameter(torch.ones(2))

    def forward(self, x):
        return self.net(x) * self.gain[0] + (self.gain[1].float() - 1.0) * 1e38


def _policies(rank: int, world: int):
    out = {}
    config = fakes.config("precision.dtype=fp16", "precision.init_scale=1024", "loss.reduction=sum").engine
    model = shard(Gained(), [], torch.device("cpu"), "fp16")
    engine = Engine(model, fakes.sum_loss, config, total_steps=2)
    before = _full(model.state_dict())
    result = engine.train_step(_batches(rank, 0))
    out["overflow"] = (result.skipped, engine.scaler.get_scale(), engine.counts["overflow"])
    out["unchanged"] = all(torch.equal(v, _full(model.state_dict())[k]) for k, v in before.items())

    config = fakes.config("nonfinite.policy=stop", "loss.reduction=sum").engine
    model = fakes.make_model(d_hidden=32)
    engine = Engine(shard(model, _blocks(model), torch.device("cpu")), fakes.sum_loss, config, total_steps=2)
    batches = _batches(rank, 0)
    if rank == 1:
        batches[1][0][0, 0] = float("nan")
    try:
        engine.train_step(batches)
        out["nonfinite"] = "no error"
    except Exception as err:
        out["nonfinite"] = f"{type(err).__name__}: {err}"
    return out


def test_fsdp_fp16_overflow_in_one_workers_shard_backs_off_every_workers_scale_and_nan_stops_all():
    outcomes = run_gloo(2, _policies)
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message + outcomes[1].message
    for o in outcomes:
        # Worker 0's shard is finite: the scale backs off on it too (DTensor's unscale_ takes the
        # max of found_inf over the shards), so the workers keep one scale.
        assert o.value["overflow"] == ("overflow", 512.0, 1)
        assert o.value["unchanged"]
        assert o.value["nonfinite"].startswith("NonFiniteError: non-finite loss or gradient at step 0")
        assert "module 'encoder' on worker 1, micro-batch 1" in o.value["nonfinite"]


def _save_and_go_on(rank: int, world: int, directory: str):
    """Two steps, a sharded checkpoint, two more steps: the weights at the checkpoint and after."""
    from raytrain_loops.checkpoint import files as ckpt

    engine = _engine("fsdp", [])
    for step in range(2):
        engine.train_step(_batches(rank, step))
    at_checkpoint = _full(engine.module.state_dict())
    state = engine.state_dict()
    ckpt.write_sharded(directory, rank, {ckpt.rank_file(rank): {"rng": state.pop("rng")}}, state, world)
    for step in range(2, 4):
        engine.train_step(_batches(rank, step))
    return {"at_checkpoint": at_checkpoint, "end": _full(engine.module.state_dict())}


def _resume(rank: int, world: int, directory: str):
    from raytrain_loops.checkpoint import files as ckpt

    assert ckpt.verify(directory) == 2
    engine = _engine("fsdp", [])
    targets = engine.sharded_targets()
    ckpt.read_sharded(directory, targets)
    rng = ckpt.read_file(directory, ckpt.rank_file(rank))["rng"]
    engine.load_state_dict({**ckpt.read_file(directory, ckpt.STATE), **targets, "rng": rng})
    assert engine.step == 2
    for step in range(2, 4):
        engine.train_step(_batches(rank, step))
    return _full(engine.module.state_dict())


def test_fsdp_checkpoint_resumes_exactly_on_two_workers_and_loads_on_one(tmp_path):
    from raytrain_loops.checkpoint import files as ckpt

    directory = str(tmp_path / "checkpoint_00000002")
    first = run_gloo(2, _save_and_go_on, directory)
    assert [o.error for o in first] == [None, None], first[0].message + first[1].message
    manifests = [ckpt._manifest(tmp_path / "checkpoint_00000002" / f"manifest.rank{r}.json") for r in (0, 1)]
    # Each worker wrote its own shards and lists them with checksums; rank 0 also the metadata.
    assert {n for n in manifests[0]["files"] if n.startswith("dcp/")} == {"dcp/.metadata", "dcp/__0_0.distcp"}
    assert {n for n in manifests[1]["files"] if n.startswith("dcp/")} == {"dcp/__1_0.distcp"}

    again = run_gloo(2, _resume, directory)
    assert [o.error for o in again] == [None, None], again[0].message + again[1].message
    for rank in (0, 1):
        for name, ref in first[rank].value["end"].items():
            assert torch.equal(again[rank].value[name], ref), f"rank {rank}: {name} differs after the resume"

    # One worker, no process group: the shards of two reassembled into whole tensors.
    single = Engine(fakes.make_model(d_hidden=32), fakes.sum_loss, fakes.config(*TRAIN).engine, total_steps=STEPS)
    targets = single.sharded_targets()
    ckpt.read_sharded(directory, targets)
    single.load_state_dict({**ckpt.read_file(directory, ckpt.STATE), **targets})
    saved = first[0].value["at_checkpoint"]
    for name, value in single.module.state_dict().items():
        assert torch.equal(value, saved[name]), name
    assert single.optimizer.state_dict()["state"][0]["step"] == 2  # Adam's moments came along
    assert single.train_step(_batches(0, 2)).applied

    # A single file for inference, keyed as the plain model.
    exported = ckpt.export(directory, tmp_path / "state.pt")
    plain = fakes.make_model(d_hidden=32)
    plain.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True)["model"])
    assert all(torch.equal(v, saved[k]) for k, v in plain.state_dict().items())
    assert exported["counters"]["step"] == 2 and set(exported["ema"]) == set(saved)


def _save(engine: Engine, run: str, rank: int, world: int) -> None:
    """This worker's part of a checkpoint of ``engine`` (sharded or plain), as the reporter writes it."""
    from raytrain_loops.checkpoint import files as ckpt

    state = engine.state_dict()
    files = {ckpt.rank_file(rank): {"rng": state.pop("rng"), "data": {"epoch": 0, "batches": engine.step}}}
    directory = f"{run}/checkpoint_{engine.step:08d}"
    if engine.sharded:
        ckpt.write_sharded(directory, rank, files, state, world)
    else:
        ckpt.write_files(directory, rank, {**files, **({ckpt.STATE: state} if rank == 0 else {})}, world)


def _restore(engine: Engine, run: str, rank: int, world: int):
    from raytrain_loops.checkpoint.ray_reporter import RayReporter
    from raytrain_loops.checkpoint.restore import candidates

    reporter = RayReporter(engine, rank, world, run)
    position = reporter.restore_from(candidates(run, None))
    return (position.epoch, position.batches), reporter.loaded  # plain values: the outcome is read weights-only


def _one_sided_damage(rank: int, world: int, run: str, marker: str):
    """Sharded checkpoints at steps 1 and 2; rank 1's own file of step 2 is replaced by a whole
    pickle that would run code (its manifest rewritten to match): only rank 1 reads it."""
    from pathlib import Path

    from raytrain_loops.checkpoint import files as ckpt
    from tests.support.checkpoints import rewritten
    from tests.support.pickles import Exploit

    engine = _engine("fsdp", [])
    for step in range(2):
        engine.train_step(_batches(rank, step))
        _save(engine, run, rank, world)
        if step == 0:
            at_first = _full(engine.module.state_dict())
    torch.distributed.barrier()
    if rank == 0:
        crafted = io.BytesIO()
        torch.save({"rng": torch.zeros(1), "data": Exploit(marker)}, crafted)
        rewritten(Path(run) / "checkpoint_00000002", ckpt.rank_file(1), crafted.getvalue(), rank=1)
    torch.distributed.barrier()
    fresh = _engine("fsdp", [])
    start = time.perf_counter()
    position, loaded = _restore(fresh, run, rank, world)
    seconds = time.perf_counter() - start
    model = _full(fresh.module.state_dict())
    return {"position": position, "loaded": loaded, "model": model, "at_first": at_first, "seconds": seconds}


@pytest.mark.deadline
def test_damage_only_one_worker_sees_moves_every_worker_to_the_sharded_checkpoint_before(tmp_path):
    marker = tmp_path / "pwned"
    outcomes = run_gloo(2, _one_sided_damage, str(tmp_path / "run"), str(marker))
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message + outcomes[1].message
    assert not marker.exists()
    for o in outcomes:
        assert o.value["position"] == (0, 1)
        assert o.value["loaded"]["checkpoint"].endswith("checkpoint_00000001")
        [skip] = o.value["loaded"]["skipped"]
        assert skip["checkpoint"].endswith("checkpoint_00000002") and skip["refused"]
        assert skip["reason"].startswith("worker 1: ") and "rank1.pt: refused or unreadable" in skip["reason"]
        for name, value in o.value["at_first"].items():
            assert torch.equal(o.value["model"][name], value), name
    # Two votes per candidate and one collective load, not a wait for the group's 30 s timeout.
    assert max(o.value["seconds"] for o in outcomes) < 25, [o.value["seconds"] for o in outcomes]


def _transient_failure_in_the_collective_load(rank: int, world: int, run: str):
    """Sharded checkpoints at steps 1 and 2; rank 1's storage fails (EIO) reading step 2's shards
    inside DCP's load, after every worker checked the checkpoint."""
    import errno

    from torch.distributed.checkpoint.filesystem import FileSystem

    engine = _engine("fsdp", [])
    for step in range(2):
        engine.train_step(_batches(rank, step))
        _save(engine, run, rank, world)
    torch.distributed.barrier()
    if rank == 1:
        real = FileSystem.create_stream

        def create_stream(self, path, mode):
            if "checkpoint_00000002" in str(path):
                raise OSError(errno.EIO, "Input/output error", str(path))
            return real(self, path, mode)

        FileSystem.create_stream = create_stream
    return _restore(_engine("fsdp", []), run, rank, world)


def test_an_io_error_inside_a_sharded_load_stops_every_worker_instead_of_taking_an_older_checkpoint(tmp_path):
    outcomes = run_gloo(2, _transient_failure_in_the_collective_load, str(tmp_path / "run"))
    # DCP gathers every worker's failure: each worker raises rank 1's I/O error (the group
    # restarts from this checkpoint), none moves on to the one before.
    for o in outcomes:
        assert o.error == "OSError", o.message
        assert "[Errno 5] Input/output error" in o.message and "checkpoint_00000002/dcp/__1_0.distcp" in o.message


def _write_where_one_worker_cannot(rank: int, world: int, root: str):
    """Each worker writes into its own scratch directory (as on Ray); rank 1's holds a file where
    the shards' directory goes."""
    from pathlib import Path

    from raytrain_loops.checkpoint import files as ckpt

    engine = _engine("fsdp", [])
    directory = Path(root) / f"worker{rank}"
    directory.mkdir(parents=True)
    if rank == 1:
        (directory / ckpt.DCP_DIR).write_text("not a directory")
    state = engine.state_dict()
    ckpt.write_sharded(directory, rank, {ckpt.rank_file(rank): {"rng": state.pop("rng")}}, state, world)


def test_a_sharded_write_that_fails_on_one_worker_is_an_error_on_every_worker(tmp_path):
    outcomes = run_gloo(2, _write_where_one_worker_cannot, str(tmp_path))
    # DCP's CheckpointException (a BaseException) comes out as the worker's cause, an Exception
    # that the reporter's callers handle like any other failed write.
    for o in outcomes:
        assert o.error == "FileExistsError", o.message
        assert "worker1/dcp" in o.message
    assert not (tmp_path / "worker0" / "manifest.rank0.json").exists()


def _ddp_then_fsdp(rank: int, world: int, run: str):
    """Two DDP steps, a plain checkpoint, two more; then an FSDP engine restores the checkpoint
    and takes the same two steps."""
    ddp = _engine("ddp", [])
    for step in range(2):
        ddp.train_step(_batches(rank, step))
    _save(ddp, run, rank, world)
    for step in range(2, 4):
        ddp.train_step(_batches(rank, step))
    fsdp = _engine("fsdp", [])
    position, loaded = _restore(fsdp, run, rank, world)
    for step in range(2, 4):
        assert fsdp.train_step(_batches(rank, step)).applied
    return {
        "position": position,
        "loaded": loaded["checkpoint"],
        "ddp": {"model": _full(ddp.module.state_dict()), "ema": _full(ddp.ema.state_dict())},
        "fsdp": {"model": _full(fsdp.module.state_dict()), "ema": _full(fsdp.ema.state_dict())},
        "step": fsdp.step,
    }


def test_a_ddp_run_goes_on_under_fsdp_from_its_plain_checkpoint_with_the_same_updates(tmp_path):
    outcomes = run_gloo(2, _ddp_then_fsdp, str(tmp_path / "run"))
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message + outcomes[1].message
    for o in outcomes:
        assert o.value["position"] == (0, 2) and o.value["loaded"].endswith("checkpoint_00000002")
        assert o.value["step"] == 4
        # AdamW's moments and the EMA came along: the same two updates as DDP's.
        for what, ref in o.value["ddp"].items():
            for name, value in ref.items():
                torch.testing.assert_close(
                    o.value["fsdp"][what][name], value, **TOLERANCE["fp32"], msg=f"{what} {name}"
                )


@pytest.mark.ray
def test_an_lm_run_with_fsdp_on_ray_checkpoints_shards_resumes_locally_and_exports(ray_session, tmp_path):
    """The lm recipe's epoch on 2 Ray workers under FSDP: it counts every token it trains on (the
    2-worker plan's rows), checkpoints shards, continues in one process and exports."""
    import json
    import math
    import sysconfig
    from pathlib import Path

    import numpy as np
    import pyarrow.parquet as pq

    from raytrain_loops import fit
    from raytrain_loops.checkpoint import files as ckpt
    from raytrain_loops.cli import main
    from raytrain_loops.config import load_config
    from raytrain_loops.data.parquet import index_split
    from raytrain_loops.recipes import resolve
    from raytrain_loops.tasks.lm import LMTask

    params = dict(dim=32, layers=2, heads=2, max_len=128, max_tokens=1024, val_percent=20.0)
    params["source"] = str(Path(sysconfig.get_paths()["stdlib"]) / "json")
    overrides = [f"task.params.{k}={v}" for k, v in params.items()] + [
        "scaling.strategy=fsdp",
        "checkpointing=full",
        "ema.enabled=true",
        "loop.max_steps=0",
        "loop.epochs=1",
        "checkpoint.every_steps=12",
        "eval.every_steps=0",  # at the end of the run: 3 eval rows, 2 on one worker and 1 on the other
        "schedules.lr.warmup_steps=0",
        "logging.every_steps=5",
        "run.name=fsdp",
        "run.progress=false",
        f"data.dir={tmp_path / 'data'}",
        f"run.storage_path={tmp_path}",
    ]
    result = fit(resolve("lm"), overrides=overrides)
    run_dir = Path(result.run_dir)
    assert result.metrics["eval_bpb"] < math.log2(256) and "eval_ema_bpb" in result.metrics  # better than uniform bytes
    # FLOPs of the whole model, counted on its plain structure: at least the matrix products'.
    d, layers = params["dim"], params["layers"]
    m = result.metrics
    assert m["flops_per_sample"] > 6 * (12 * d * d * layers + 256 * d) and m["gflops_per_s"] > 0

    # Every token it trained on counted: one packed row per worker and step, over the epoch's plan.
    task = LMTask(**params)
    splits = task.splits(tmp_path / "data")
    train_rows = pq.read_table(splits["train"].path).column("tokens").to_pylist()
    logged = records(run_dir / "metrics.jsonl")
    assert len(logged) == len(train_rows) // 2 and all(r["applied"] for r in logged)
    assert len({r["sample_size"] for r in logged}) > 1  # variable-size batches
    splits["train"].index = index_split(splits["train"].path, splits["train"].columns)
    config = load_config(resolve("lm"), overrides)
    trained = trained_rows(splits["train"], config.data, config.loop.seed)
    assert sum(r["sample_size"] for r in logged) == sum(len(train_rows[i]) for i in trained)
    assert m["sample_size_per_s"] > 0
    # The unigram baseline is scored on exactly the validation bytes the model was scored on: every
    # row of the split, once.
    bits = np.array(json.loads((task.data_subdir(tmp_path / "data") / "stats.json").read_text())["unigram_bits"])
    valid_rows = pq.read_table(splits["eval"].path).column("tokens").to_pylist()
    baseline = sum(bits[np.frombuffer(r, dtype=np.uint8)].sum() for r in valid_rows) / sum(map(len, valid_rows))
    assert abs(baseline - m["eval_unigram_bpb"]) < 1e-4, (baseline, m)

    steps = len(logged)
    final = run_dir / f"checkpoint_{steps:08d}"
    assert ckpt.verify(final) == 2 and ckpt.is_sharded(final)
    assert {p.name for p in (final / "dcp").iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}

    # The same run goes on in one process (local mode, no second Ray run): the two workers' shards
    # gathered into one whole model (resharding under FSDP at another world: the gloo tests above).
    fit(resolve("lm"), overrides=[*overrides, f"loop.max_steps={steps + 2}", "scaling.num_workers=0"])
    init = restored(run_dir)
    assert init["checkpoint"].endswith(final.name) and init["world_size"] == 2
    assert ckpt.verify(run_dir / f"checkpoint_{steps + 2:08d}") == 1

    assert main(["export", str(final), str(tmp_path / "state.pt")]) == 0
    model = task.build_model()
    model.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True)["model"])  # strict: every key


def _lm_model():
    from raytrain_loops.tasks.gpt import GPT

    torch.manual_seed(0)
    return GPT(dim=32, layers=2, heads=2)


def _backward_ops(model, tokens) -> tuple[float, dict[str, float], dict[str, int]]:
    """Loss, gradients, and the matmuls and GELUs run during the backward pass."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = {"mm": 0, "gelu": 0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in ("mm", "addmm", "bmm"):
                self.counts["mm"] += 1
            if name == "gelu":
                self.counts["gelu"] += 1
            return func(*args, **(kwargs or {}))

    loss = model(tokens).float().logsumexp(-1).mean()
    with Count() as count:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, count.counts


def test_activation_checkpointing_per_block_keeps_names_and_gradients_and_recomputes_what_it_says():
    from raytrain_loops.engine.distributed.sharding import prepare_model

    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    plain = _lm_model()
    ref_loss, ref_grads, ref_ops = _backward_ops(plain, tokens)
    ops = {}
    for mode in ("full", "selective"):
        model = _lm_model()
        prepare_model(model, list(model.blocks), checkpointing=mode)
        assert list(model.state_dict()) == list(plain.state_dict()), mode
        loss, grads, ops[mode] = _backward_ops(model, tokens)
        assert loss == ref_loss
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-6, rtol=1e-5, msg=f"{mode} {name}")
    # Without checkpointing no GELU runs in backward; both modes recompute it in each block;
    # only full recomputes the block's matmuls too (selective kept their outputs).
    assert ref_ops["gelu"] == 0 and ops["full"]["gelu"] == ops["selective"]["gelu"] == 2
    assert ops["selective"]["mm"] == ref_ops["mm"] < ops["full"]["mm"]


def test_regional_compile_keeps_names_and_checkpoints_and_gives_the_same_loss():
    from torch._dynamo.utils import counters

    from raytrain_loops.config.engine import CompileConfig
    from raytrain_loops.engine.distributed.sharding import prepare_model

    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    plain = _lm_model()
    ref_loss, ref_grads, _ = _backward_ops(plain, tokens)
    model = _lm_model()
    counters.clear()
    prepare_model(model, list(model.blocks), compile_cfg=CompileConfig(enabled=True))
    loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    assert counters["stats"]["unique_graphs"] >= 1, "the blocks were not compiled"
    assert type(model.blocks[0]).__name__ == "Block" and list(model.state_dict()) == list(plain.state_dict())
    torch.testing.assert_close(loss.item(), ref_loss, atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    with pytest.raises(ValueError, match="Task.blocks"):
        prepare_model(_lm_model(), [], checkpointing="full")


def test_the_lm_gpt_recipe_is_gpt2_small_shaped_and_sharded_block_by_block():
    from raytrain_loops.config import load_config
    from raytrain_loops.recipes import builtin, describe
    from raytrain_loops.tasks.base import build_task

    config = load_config(builtin()["lm_gpt"])
    assert "GPT-2-small" in describe(builtin()["lm_gpt"])
    assert (config.scaling.strategy, config.scaling.use_gpu, config.precision.dtype) == ("fsdp", True, "auto")
    assert config.compile.enabled and config.loss.reduction == "sum"
    task = build_task(config.task.name, config.task.params)
    assert (task.data, task.vocab, task.max_len) == ("generated", 50304, 1024)
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = task.build_model()
    blocks = task.blocks(model)
    assert len(blocks) == 12 and blocks[0].attn.qkv.in_features == 768 and blocks[0].attn.heads == 12
    assert model.head.weight is model.embed.weight  # tied: GPT-2 small counts its 50304 x 768 table once
    count = sum(p.numel() for p in model.parameters())
    # 50304 x 768 tokens + 12 blocks of 7,087,872 + the final norm (rotary positions: no position table)
    assert count == 123_689_472, count


def _oom_on_rank0(rank: int, world: int):
    model = fakes.make_model(d_hidden=32)
    engine = Engine(
        shard(model, _blocks(model), torch.device("cpu")), fakes.sum_loss, fakes.config().engine, total_steps=3
    )

    def loss_fn(m, batch, ctx):
        if rank == 0 and engine.step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return fakes.sum_loss(m, batch, ctx)

    engine.loss_fn = loss_fn
    for step in range(3):
        engine.train_step(_batches(rank, step))


@pytest.mark.deadline
def test_fsdp_oom_on_one_worker_ends_every_worker_as_a_retryable_failure():
    outcomes = run_gloo(2, _oom_on_rank0)
    # The other worker is inside this micro-batch's all-gathers: no zero-weight pass can rejoin
    # them in order, so the group restarts from its checkpoint (not a TrainingError: Ray retries).
    assert outcomes[0].error == "GroupBrokenError", outcomes[0].message
    assert "under FSDP" in outcomes[0].message and "at step 1" in outcomes[0].message
    assert outcomes[1].error is not None  # its collective fails: it does not wait on
    assert max(o.seconds for o in outcomes) < 25


def test_a_run_started_before_compile_and_checkpointing_existed_reruns_with_them(tmp_path, monkeypatch):
    import yaml

    from examples.custom_task import SpiralTask
    from raytrain_loops import fit
    from raytrain_loops.driver import fit as fit_module

    def stop(*args, **kwargs):
        raise RayWouldStart

    monkeypatch.setattr(fit_module, "ensure_ray", stop)
    run = started_run(tmp_path, spiral_config(tmp_path))
    old = yaml.safe_load((run / "config.yaml").read_text())
    for key in ("compile", "checkpointing"):  # how compute-only settings are absent from an older run's config
        del old[key]
    (run / "config.yaml").write_text(yaml.safe_dump(old))
    # They change how blocks run, not the state a checkpoint holds: not refused.
    with pytest.raises(RayWouldStart):
        fit(spiral_config(tmp_path, compile={"mode": "max-autotune"}, scaling={"strategy": "fsdp"}), task=SpiralTask())


def test_compile_or_checkpointing_on_a_task_without_blocks_is_refused_before_ray_starts(tmp_path, monkeypatch):
    from examples.custom_task import CONFIG, SpiralTask
    from raytrain_loops import ConfigError, fit
    from raytrain_loops.driver import fit as fit_module

    def ray_must_not_start(*args, **kwargs):
        raise AssertionError("Ray started")

    monkeypatch.setattr(fit_module, "ensure_ray", ray_must_not_start)
    base = {**CONFIG, "run": {"storage_path": str(tmp_path)}}
    for key, section in (
        ("compile.enabled", {"compile": {"enabled": True}}),
        ("checkpointing", {"checkpointing": "full"}),
    ):
        with pytest.raises(ConfigError, match="names none: override Task.blocks") as info:
            fit({**base, **section}, task=SpiralTask())
        assert info.value.key == key


TIED = dict(data="generated", vocab=96, tokens=2_000, dim=16, layers=2, heads=2, max_len=24, max_tokens=96)


def _tied_batches() -> list:
    """Two small batches of generated tokens for the tied model (one per worker)."""
    import numpy as np

    from raytrain_loops.tasks.datasets.tokens import Language, rng_for
    from raytrain_loops.tasks.lm import LMTask

    task = LMTask(**TIED)
    data, lengths = Language.make(TIED["vocab"] - 1, 0).sample(rng_for(0, 1), 120, 24, "<u2")
    ends = np.cumsum(lengths)
    batches = []
    for a, b in ((0, 3), (3, len(lengths))):
        piece = data[ends[a] - lengths[a] : ends[b - 1]].tobytes()
        row = {"tokens": np.array([piece], dtype=object), "lengths": np.empty(1, dtype=object)}
        row["lengths"][0] = lengths[a:b].astype(np.int32)
        batches.append(task.collate(row))
    return batches


def _tied_engine(sharded: bool) -> Engine:
    from raytrain_loops.tasks.lm import LMTask

    task = LMTask(**TIED)
    torch.manual_seed(0)
    model = task.build_model()
    if sharded:
        shard(model, task.blocks(model), torch.device("cpu"))
    config = fakes.config("loss.reduction=sum", "optim.name=adamw", "schedules.lr.value=0.01").engine
    return Engine(model, task.criterion, config, total_steps=4)


def _tied_fsdp(rank: int, world: int, directory: str, batches: list):
    """Two FSDP steps of the tied model (a batch per worker), then a sharded checkpoint."""
    from raytrain_loops.checkpoint import files as ckpt

    engine = _tied_engine(sharded=True)
    for _ in range(2):
        engine.train_step([batches[rank]])
    module = engine.module
    state = engine.state_dict()
    ckpt.write_sharded(directory, rank, {ckpt.rank_file(rank): {"rng": state.pop("rng")}}, state, world)
    return {"tied": module.head.weight is module.embed.weight, "model": _full(module.state_dict())}


def test_a_tied_embedding_and_head_stay_one_matrix_under_fsdp_and_through_a_sharded_checkpoint(tmp_path):
    from raytrain_loops.checkpoint import files as ckpt

    batches = _tied_batches()
    directory = str(tmp_path / "checkpoint_00000002")
    outcomes = run_gloo(2, _tied_fsdp, directory, batches)
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message + outcomes[1].message
    # The same two updates in one process, the two batches as two micro-batches (sum normalisation).
    plain = _tied_engine(sharded=False)
    for _ in range(2):
        plain.train_step(batches)
    ref = plain.module.state_dict()
    assert not torch.equal(ref["embed.weight"], _tied_engine(sharded=False).module.state_dict()["embed.weight"])
    for o in outcomes:
        assert o.value["tied"]
        got = o.value["model"]
        assert torch.equal(got["embed.weight"], got["head.weight"])
        for name, value in ref.items():
            torch.testing.assert_close(got[name], value, **TOLERANCE["fp32"], msg=name)

    # Loaded on one worker: the head is still the embedding, and the optimizer's moments came along.
    single = _tied_engine(sharded=False)
    targets = single.sharded_targets()
    ckpt.read_sharded(directory, targets)
    single.load_state_dict({**ckpt.read_file(directory, ckpt.STATE), **targets})
    module = single.module
    assert module.head.weight is module.embed.weight
    torch.testing.assert_close(module.embed.weight, outcomes[0].value["model"]["embed.weight"], atol=0, rtol=0)
    assert single.optimizer.state_dict()["state"][0]["step"] == 2
    exported = ckpt.export(directory, tmp_path / "state.pt")
    fresh = _tied_engine(sharded=False).module
    fresh.load_state_dict(exported["model"])  # strict: both names present
    assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.head.weight, module.embed.weight)
