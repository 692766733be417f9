"""The step's DDP/FSDP mechanics, on every worker: the model's wrapping (:func:`wrapping`), the
gradient synchronisation of each micro-batch (:func:`sync`), the zero-weight pass that joins
the collectives without data (:func:`join_with_dummy`), what an OOM in forward/backward leaves
(:func:`recover_from_oom`: a zero-weight join, or the group's restart when the collectives
under way cannot be rejoined), the check that the step's collectives still had every worker
(:func:`require_group`) and the check that DDP left the same gradients on every worker
(:func:`check_grad_sync`)."""

from __future__ import annotations

import contextlib
import gc
import statistics
from typing import TYPE_CHECKING

import torch
from torch import nn

from raytrain_loops.engine.api import StepContext
from raytrain_loops.engine.distributed import collectives, sharding
from raytrain_loops.engine.update.guards import GradSyncError, GroupBrokenError, TrainingError
from raytrain_loops.engine.update.precision import autocast

if TYPE_CHECKING:
    from raytrain_loops.engine.update.step import Engine, LocalSums

__all__ = ["check_grad_sync", "join_with_dummy", "recover_from_oom", "require_group", "sync", "wrapping"]


def wrapping(model: nn.Module, world_size: int) -> tuple[bool, bool]:
    """Whether ``model`` is wrapped in ``DistributedDataParallel`` and whether it is sharded by
    ``fully_shard``; one of them is required when more than one worker runs."""
    ddp, sharded = hasattr(model, "no_sync"), sharding.is_sharded(model)
    if world_size > 1 and not (ddp or sharded):
        raise ValueError(
            f"{world_size} workers are running but the model is neither wrapped in "
            "DistributedDataParallel nor sharded by fully_shard"
        )
    return ddp, sharded


def sync(engine: Engine, last: bool) -> contextlib.AbstractContextManager:
    """Where a micro-batch's backward synchronises gradients: on the last micro-batch only."""
    if engine.sharded:
        # FSDP2's counterpart of no_sync: gradients stay unsharded and accumulate until the
        # last micro-batch's backward reduce-scatters their sum.
        engine.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    if engine.ddp and not last:
        return engine.model.no_sync()
    return contextlib.nullcontext()


def join_with_dummy(engine: Engine, ctx: StepContext, last: bool, local: LocalSums) -> None:
    """Run a zero-weight forward/backward so DDP's all-reduce on the last micro-batch still
    gets this worker's (zero) contribution; off the last micro-batch nothing is needed. Under
    FSDP every micro-batch needs it: each forward gathers the parameters from all workers."""
    if engine.world_size == 1 or not (engine.sharded or (last and engine.ddp)):
        return
    if engine.dummy_batch is None:
        raise TrainingError(
            "a worker has no batch to join the gradient all-reduce with: its first micro-batch "
            "failed or it had no data at all; check data.batch_size against the rows per worker"
        )
    with sync(engine, last), autocast(engine.config.precision, engine.device):
        out = engine.loss_fn(engine.model, engine.dummy_batch, ctx)
    (out.loss * 0.0).backward()
    # Zero-weight stats give the step's all-reduce the same layout on every worker.
    local.add_stats(out.stats, 0.0)


def recover_from_oom(
    engine: Engine, ctx: StepContext, err: BaseException, local: LocalSums, *, backward: bool, last: bool
) -> None:
    """After an OOM in a micro-batch's forward/backward: count it (every worker decides alike
    after the all-reduce, ``oom.policy`` or ``accum.micro_batch=auto``), free the memory and join
    the collectives at zero weight; or raise :class:`GroupBrokenError` when the other workers are
    inside collectives of this micro-batch that this one cannot rejoin (under
    ``accum.micro_batch=auto`` this worker halves its micro-batch first and says so, so that the
    restarted group starts from the smaller one)."""
    try:
        _recover(engine, ctx, err, local, backward=backward, last=last)
    except GroupBrokenError:
        engine.micro.before_restart(engine)
        raise


def _recover(
    engine: Engine, ctx: StepContext, err: BaseException, local: LocalSums, *, backward: bool, last: bool
) -> None:
    rank = collectives.rank()
    if engine.sharded and engine.world_size > 1:
        raise GroupBrokenError(
            f"out of memory in forward/backward on worker {rank} at step {engine.step} under FSDP: "
            "the other workers are inside the parameter all-gathers and gradient reduce-scatters of "
            "this micro-batch, which this one cannot rejoin in order; the group restarts from the last "
            "checkpoint. If this repeats, lower the micro-batch size"
        ) from err
    if backward and last and engine.ddp and engine.world_size > 1:
        raise GroupBrokenError(
            f"out of memory in the backward pass of the synchronising micro-batch on worker "
            f"{rank} at step {engine.step}: DDP's gradient all-reduce was under way and cannot "
            "be completed; the group restarts from the last checkpoint"
        ) from err
    local.ooms += 1
    engine.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
    if engine.micro.auto:  # its zero-weight pass, at the size that just failed, might not fit
        engine.dummy_batch = engine.micro.smaller(engine.dummy_batch)
    try:
        join_with_dummy(engine, ctx, last, local)
    except Exception as again:
        # The other workers wait in DDP's all-reduce for this one: only a restart of the
        # group (from the last checkpoint) ends that wait on every worker.
        raise GroupBrokenError(
            f"out of memory on worker {rank} at step {engine.step}, and its zero-weight pass to join "
            f"the gradient all-reduce failed too ({type(again).__name__}: {again}); the group restarts from "
            "the last checkpoint. If this repeats, lower the micro-batch size"
        ) from err
    engine.optimizer.zero_grad(set_to_none=True)


def require_group(engine: Engine) -> None:
    """Raise :class:`GroupBrokenError` when the process group the engine was built in is gone:
    Ray destroys it when it tears the group down (a preemption's restart, another worker's
    failure) while this worker's training thread may be mid-step, and from then on the
    collectives are no-ops that leave this worker's own values (a gradient norm of 0 for every
    other worker, a loss of this worker's batches alone). Judged as they are, those would be a
    training stop (``GradSyncError``, a non-finite loss) where Ray retries a group failure."""
    if collectives.torn_down(engine.world_size):
        raise GroupBrokenError(
            f"the process group of {engine.world_size} workers was destroyed during step {engine.step + 1} "
            "(the group is being torn down); the step's collectives did not reach the other workers"
        )


def check_grad_sync(norms: list[float], rtol: float, step: int) -> None:
    """Raise on every worker when DDP left different gradients on different workers (fairseq's
    ``_check_grad_norms``): ``norms``, each worker's gradient norm, came through the step's
    all-reduce, so every worker decides alike."""
    reference = statistics.median(norms)  # with three or more workers, the odd ones out
    off = [r for r, n in enumerate(norms) if abs(n - reference) > rtol * max(norms)]
    if off:
        detail = ", ".join(f"worker {r}: {n:.10g}" for r, n in enumerate(norms))
        raise GradSyncError(
            f"gradients differ between workers after DDP synchronisation at step {step}: "
            f"gradient norms {detail}; worker(s) {', '.join(map(str, off))} differ by more than "
            f"grad_sync.rtol={rtol:g}. Parameters that DDP does not synchronise, or a custom comm hook "
            "or wrapper that skips the all-reduce, let the workers drift apart; set grad_sync.check=false "
            "only if that is intended"
        )
