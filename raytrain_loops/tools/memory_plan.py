"""``raytrain-loops plan``: the memory one training worker needs, before any run. Parameters,
gradients and optimizer state are computed from the task's model and the config, under DDP and
under FSDP for the configured world; the activations of one micro-batch are measured by one real
update on this machine's CPU, on the first micro-batch of the run's own data (rank 0's, epoch 0),
with the run's precision and activation checkpointing (compilation left out: eager). No Ray.

The meta device is not used for the activations: which attention kernel runs (and so what is
kept for backward) is chosen by device, and a meta tensor's kernel is not the CPU's or a GPU's;
criteria that read values (counts, masks) do not run on it either.

The total is what the worker holds all along (parameters, buffers, optimizer state, the EMA, the
DDP buckets or FSDP's gathered parameters) plus the largest sum of gradients and activations
alive at once during the measured update: gradients fill in as backward frees activations, so
the two peaks do not add (with ``accum.steps`` > 1 they do, and the plan adds them).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from raytrain_loops.config import Config
from raytrain_loops.config.engine import CompileConfig
from raytrain_loops.driver import preflight
from raytrain_loops.engine import Engine
from raytrain_loops.engine.distributed import sharding
from raytrain_loops.engine.rng import seed_everything
from raytrain_loops.engine.update import precision
from raytrain_loops.runtime.batches import first_batch
from raytrain_loops.runtime.wiring import task_engine
from raytrain_loops.tasks import Task
from raytrain_loops.tools.tensor_memory import TensorMemory

STATES = {"adamw": 2, "adam": 2}  # full-size tensors per parameter; SGD: 1 with momentum, else 0


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _shard(t: torch.Tensor, world: int) -> int:
    """One worker's shard under FSDP2: dim 0 cut into ``world`` equal parts, padded."""
    if t.ndim == 0:
        return _bytes(t)
    return math.ceil(t.shape[0] / world) * math.prod(t.shape[1:]) * t.element_size()


def optimizer_states(config: Config) -> int:
    """How many full-size state tensors the configured optimizer keeps per trained parameter."""
    optim = config.optim
    return STATES.get(optim.name, 1 if optim.momentum > 0 else 0)


def measured_dtype(config: Config) -> tuple[str, str]:
    """The precision the workers will run in, and why: the configured one, ``auto`` resolved for
    the CPU here, or, on GPUs, for one that computes bf16 natively (the plan's assumption)."""
    requested = config.precision.dtype
    if requested != "auto":
        return requested, "as configured"
    if config.scaling.use_gpu:
        hw = precision.Hardware("cuda", "a GPU with native bf16", True)
        return precision.resolve(requested, hw)[0], "auto, on a GPU with native bf16"
    return precision.decide(requested, torch.device("cpu"))[0], "auto, on this CPU"


@dataclass(frozen=True)
class Held:
    """What one worker holds all along, in bytes, under one strategy."""

    params: int
    buffers: int
    grads: int
    optimizer: int
    ema: int
    extra: int  # DDP's gradient buckets, or FSDP's gathered parameters
    extra_name: str

    @property
    def static(self) -> int:
        return self.params + self.buffers + self.optimizer + self.ema + self.extra


def held(model: nn.Module, config: Config, world: int, fsdp: bool, blocks: list[nn.Module]) -> Held:
    """The computed figures of ``model`` for ``world`` workers under FSDP (``fsdp``) or DDP."""
    size = (lambda t: _shard(t, world)) if fsdp else _bytes
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    p_bytes, t_bytes = sum(size(p) for p in params), sum(size(p) for p in trained)
    states = optimizer_states(config) * t_bytes + (4 * len(trained) if config.optim.name != "sgd" else 0)
    ema = p_bytes + sum(_bytes(b) for b in model.buffers()) if config.ema.enabled else 0
    if fsdp:
        extra, name = gathered(model, config, blocks), "FSDP gathered parameters"
    else:  # Ray's prepare_model wraps in DDP only when there is more than one worker
        extra, name = (t_bytes if world > 1 else 0), "DDP gradient buckets"
    return Held(p_bytes, sum(_bytes(b) for b in model.buffers()), t_bytes, states, ema, extra, name)


def gathered(model: nn.Module, config: Config, blocks: list[nn.Module]) -> int:
    """FSDP's unsharded parameters during forward and backward, in ``precision.dtype``: the root's
    own (kept from forward to backward) and two blocks (the one running and the one prefetched),
    or every block with ``scaling.reshard_after_forward=false``."""
    dtype, _ = measured_dtype(config)
    width = sharding.PARAM_DTYPES[dtype].itemsize
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    sizes = sorted((sum(p.numel() for p in b.parameters()) for b in blocks), reverse=True)
    kept = sizes if not config.scaling.reshard_after_forward else sizes[:2]
    return (root + sum(kept)) * width


@dataclass(frozen=True)
class Measured:
    """One update on this CPU: the peak of the activations (every tensor it made that is neither
    a gradient nor the optimizer's state), the peaks of activations and gradients together (the
    gradients whole, and as one of ``world`` FSDP shards), and the gradients and optimizer state
    it made (the computed figures' check)."""

    activations: int
    with_grads: int
    with_grad_shards: int
    grads: int
    optimizer: int
    batch: str
    dtype: str
    why: str
    seconds: float


def run_config(config: Config) -> Config:
    """The config one worker's update runs with here: the run's precision resolved
    (:func:`measured_dtype`), no compilation."""
    dtype, _ = measured_dtype(config)
    return dataclasses.replace(
        config, precision=dataclasses.replace(config.precision, dtype=dtype), compile=CompileConfig(enabled=False)
    )


def build_engine(task: Task, config: Config, batches_per_epoch: int, device: torch.device | None = None) -> Engine:
    """The engine of one worker, on this CPU or ``device``, as a run builds it (seeded weights,
    the task's parameter groups, its activation checkpointing), for ``config`` from
    :func:`run_config`."""
    seed_everything(config.loop.seed)
    model = task.build_model()
    sharding.prepare_model(model, task.blocks(model), checkpointing=config.checkpointing, compile_cfg=config.compile)
    model.to(device or torch.device("cpu"))
    return task_engine(task, model, config, batches_per_epoch)


def describe(batch: Any) -> str:
    """A batch's tensors' shapes, as the plan names the micro-batch it measured."""
    leaves = torch.utils._pytree.tree_flatten(batch)[0]
    shapes = ["x".join(map(str, t.shape)) for t in leaves if isinstance(t, torch.Tensor)]
    return ", ".join(shapes) or "no tensors"


def measure(engine: Engine, batch: Any, config: Config) -> Measured:
    """One update of ``batch`` by ``engine`` (:func:`build_engine`), every tensor it makes followed."""
    start = time.perf_counter()
    with TensorMemory() as mem:
        engine.train_step([batch])
    seconds = time.perf_counter() - start
    tl = mem.timeline
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    grads = tl.indices_of(p.grad for p in params if p.grad is not None)
    state = tl.indices_of(v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    world = config.scaling.workers
    dtype, why = measured_dtype(config)
    return Measured(
        activations=int(tl.peak({i: 0.0 for i in grads | state})),
        with_grads=int(tl.peak({**{i: 0.0 for i in state}, **{i: 1.0 for i in grads}})),
        with_grad_shards=int(tl.peak({**{i: 0.0 for i in state}, **{i: 1.0 / world for i in grads}})),
        grads=sum(tl.sizes[i] for i in grads),
        optimizer=sum(tl.sizes[i] for i in state),
        batch=describe(batch),
        dtype=dtype,
        why=why,
        seconds=seconds,
    )


@dataclass(frozen=True)
class MemoryPlan:
    """The plan of one worker: the computed figures under DDP and FSDP for ``world`` workers,
    the measured update, and the total of each (:attr:`totals`)."""

    recipe: str
    config: Config
    world: int
    n_params: int
    n_trained: int
    ddp: Held
    fsdp: Held
    measured: Measured

    def peak(self, fsdp: bool) -> int:
        """Activations and gradients at their largest together; added whole when gradients
        accumulate over several micro-batches (each forward runs beside the gradients so far)."""
        m, held_ = self.measured, self.fsdp if fsdp else self.ddp
        together = m.with_grad_shards if fsdp else m.with_grads
        if self.config.accum.steps > 1:
            together = max(together, m.activations + held_.grads)
        return together

    def totals(self) -> tuple[int, int]:
        """The total of one worker under DDP and under FSDP."""
        return self.ddp.static + self.peak(False), self.fsdp.static + self.peak(True)


def make_plan(config: Config, recipe: str) -> MemoryPlan:
    """The task built and its data prepared as ``train`` does before Ray starts (the same errors,
    naming the key, file or column), then the figures."""
    task, splits, rows = preflight.prepare(config, None)
    here = run_config(config)
    batch, source = first_batch(task, here, splits, rows)
    engine = build_engine(task, here, source.batches_per_epoch)
    return plan_of(engine, task, config, recipe, measure(engine, batch, config))


def plan_of(engine: Engine, task: Task, config: Config, recipe: str, measured: Measured) -> MemoryPlan:
    """The plan of ``engine``'s model (its shapes: the update it ran changes none) with the
    update :func:`measure` followed."""
    model = engine.module
    blocks = list(task.blocks(model))
    world = config.scaling.workers
    params = list(model.parameters())
    return MemoryPlan(
        recipe,
        config,
        world,
        sum(p.numel() for p in params),
        sum(p.numel() for p in params if p.requires_grad),
        held(model, config, world, False, blocks),
        held(model, config, world, True, blocks),
        measured,
    )


def size(n: int | None) -> str:
    """Bytes as a reader compares them: KiB, MiB from 1 MiB on, GiB from 1 GiB on; ``-`` for none."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n / 2**10:,.1f} KiB"


def _millions(n: int) -> str:
    return f"{n / 1e6:,.1f}M" if n >= 100_000 else f"{n:,}"


def render(plan: MemoryPlan) -> str:
    """The plan as the console shows it: a line per figure, DDP and FSDP side by side, each
    marked computed or measured, and the total."""
    c, m, d, f = plan.config, plan.measured, plan.ddp, plan.fsdp
    mode = (
        "local mode, one process"
        if c.scaling.local
        else f"{plan.world} worker{'s' if plan.world > 1 else ''}, configured {c.scaling.strategy}"
    )
    states = optimizer_states(c)
    head = [
        f"memory plan of {plan.recipe}: per worker, {mode}",
        f"model: {_millions(plan.n_params)} parameters ({_millions(plan.n_trained)} trained); "
        f"micro-batch: data.batch_size={c.data.batch_size} ({m.batch}); accum.steps={c.accum.steps}; "
        f"precision {m.dtype} ({m.why})",
        "",
        f"{'':44}{'DDP':>14}{'FSDP x' + str(plan.world):>14}",
    ]
    rows = [
        ("parameters", d.params, f.params, "computed"),
        ("buffers", d.buffers, f.buffers, "computed (not sharded)"),
        ("gradients", d.grads, f.grads, "computed"),
        (f"optimizer state ({c.optim.name}: {states} per parameter)", d.optimizer, f.optimizer, "computed"),
        ("EMA of the weights", d.ema, f.ema, "computed (ema.enabled)"),
        (d.extra_name, d.extra, None, "computed (none with one worker)"),
        (f.extra_name, None, f.extra, f"computed: the root's own and {_blocks(c)}, in {m.dtype}"),
        ("activations of one micro-batch", m.activations, m.activations, "measured: one update on this CPU, eager"),
    ]
    body = [f"{name:<44}{size(a):>14}{size(b):>14}   {how}" for name, a, b, how in rows if (a or 0) + (b or 0) > 0]
    ddp_total, fsdp_total = plan.totals()
    tail = [
        f"{'total':<44}{size(ddp_total):>14}{size(fsdp_total):>14}",
        "",
        "total: what the worker holds all along plus the largest sum of gradients and activations alive at once "
        f"in the measured update ({size(plan.peak(False))} under DDP, {size(plan.peak(True))} under FSDP)"
        + (", gradients added whole: they accumulate over micro-batches" if c.accum.steps > 1 else ""),
        f"measured in {m.seconds:.1f} s on this CPU: gradients {size(m.grads)}, optimizer state {size(m.optimizer)} "
        "made by the update (the computed figures' check); compile.enabled would lower the activations",
    ]
    return "\n".join(head + body + tail)


def _blocks(config: Config) -> str:
    return "every block" if not config.scaling.reshard_after_forward else "two blocks"
