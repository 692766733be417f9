"""A skipped update, the same on every worker once :func:`~raytrain_loops.engine.update.decision.decide`
has said skip: the skip policy (:func:`skip`: drop the gradients, count the skip, close the loss
scaler's step, raise when a limit or ``nonfinite.policy``/``oom.policy`` says stop), and the
diagnosis its errors carry: a persistent OOM, or where a non-finite loss or gradient was first
seen (the module, agreed by all workers in collectives of its own, and the loss terms' means
over all workers)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from raytrain_loops.engine.api import StepContext
from raytrain_loops.engine.devices import to_device
from raytrain_loops.engine.distributed import collectives
from raytrain_loops.engine.update.decision import Decision
from raytrain_loops.engine.update.guards import (
    LossScaleError,
    NonFiniteError,
    OOMError,
    first_nonfinite_grad,
    first_nonfinite_module,
)
from raytrain_loops.engine.update.precision import autocast

if TYPE_CHECKING:
    from raytrain_loops.engine.update.step import Engine, LocalSums

__all__ = ["retry", "skip"]


def skip(engine: Engine, decision: Decision, micro_batches: Sequence[Any], local: LocalSums, ctx: StepContext) -> None:
    """Drop the update on every worker, count it, and raise when a limit or policy says stop.
    Every skip closes the loss scaler's step (``unscale_`` ran), so the next step can run."""
    optimizer, scaler = engine.optimizer, engine.scaler
    if decision is Decision.SKIP_EMPTY:
        optimizer.zero_grad(set_to_none=True)
        if scaler.is_enabled():
            scaler.update(scaler.get_scale())  # no data is no overflow: the scale stays
        return
    if decision is Decision.SKIP_OVERFLOW:
        optimizer.zero_grad(set_to_none=True)
        _overflow(engine)
        return
    reason = decision.value
    engine.counts[reason] += 1
    engine.in_a_row[reason] += 1
    # The error is worked out while the gradients are still there: the detector may name one.
    if decision is Decision.SKIP_OOM:
        error = _oom_error(engine)
    else:
        error = _nonfinite_error(engine, micro_batches, local, ctx)
    optimizer.zero_grad(set_to_none=True)
    if scaler.is_enabled():
        scaler.update()
    if error is not None:
        raise error


def retry(engine: Engine) -> None:
    """An update that ran out of memory and is tried again with smaller micro-batches
    (``accum.micro_batch=auto``): its gradients dropped, the OOM counted, the loss scaler's step
    closed with the scale as it was (memory is no overflow)."""
    engine.optimizer.zero_grad(set_to_none=True)
    engine.counts["oom"] += 1
    if engine.scaler.is_enabled():
        engine.scaler.update(engine.scaler.get_scale())


def _overflow(engine: Engine) -> None:
    engine.counts["overflow"] += 1
    engine.scaler.update()
    scale = engine.scaler.get_scale()
    floor = engine.config.precision.min_scale
    if scale < floor:
        raise LossScaleError(
            f"fp16 loss scale fell to {scale:g}, below precision.min_scale={floor:g}: "
            "the loss or gradients are non-finite even at a tiny scale; try precision.dtype=bf16 or a lower lr"
        )


def _oom_error(engine: Engine) -> OOMError | None:
    cfg = engine.config.oom
    if cfg.policy == "raise":
        return OOMError(
            f"out of memory in forward/backward at step {engine.step} (oom.policy=raise); lower the "
            "micro-batch size or set oom.policy=skip"
        )
    if engine.in_a_row["oom"] < cfg.max_consecutive:
        return None
    return OOMError(
        f"out of memory on {engine.in_a_row['oom']} updates in a row (oom.max_consecutive="
        f"{cfg.max_consecutive}); lower the micro-batch size or raise accum.steps"
    )


def _nonfinite_error(
    engine: Engine, micro_batches: Sequence[Any], local: LocalSums, ctx: StepContext
) -> NonFiniteError | None:
    cfg = engine.config.nonfinite
    if cfg.policy == "stop":
        return NonFiniteError(_describe_nonfinite(engine, micro_batches, local, ctx))
    if engine.in_a_row["nonfinite"] < cfg.max_consecutive:
        return None
    return NonFiniteError(
        f"{engine.in_a_row['nonfinite']} updates in a row had a non-finite loss or gradient "
        f"(nonfinite.max_consecutive={cfg.max_consecutive}); " + _describe_nonfinite(engine, micro_batches, local, ctx)
    )


def _describe_nonfinite(engine: Engine, micro_batches: Sequence[Any], local: LocalSums, ctx: StepContext) -> str:
    """Name the first module whose output was non-finite, agreed by all workers, and the loss
    terms' means over all workers' micro-batches (one collective)."""
    where = None
    bad = [i for i, loss in local.losses if not bool(torch.isfinite(loss))]
    if engine.sharded and engine.world_size > 1:
        where = _nonfinite_module_sharded(engine, bad, micro_batches, ctx)
    elif bad:
        where = _where(_rerun(engine, micro_batches[bad[0]], bad[0], ctx), bad[0])
    terms = {k: float(v) for k, v in local.term_sums.items()}
    reports = collectives.all_gather_object((where, terms, len(local.losses)))
    first = next((r for r, _, _ in reports if r), None)
    if first is None:
        param = _first_nonfinite_grad(engine)
        first = f"the gradient of parameter '{param}'" if param else "an unknown place"
    message = f"non-finite loss or gradient at step {engine.step} (epoch {engine.epoch}): first seen in {first}"
    n = sum(count for _, _, count in reports)
    names = sorted({k for _, t, _ in reports for k in t})
    if names and n:
        means = {k: sum(t.get(k, 0.0) for _, t, _ in reports) / n for k in names}
        message += "; loss terms over all workers (unscaled means): " + ", ".join(
            f"{k}={v:.6g}" for k, v in means.items()
        )
    return message


def _nonfinite_module_sharded(
    engine: Engine, bad: list[int], micro_batches: Sequence[Any], ctx: StepContext
) -> str | None:
    """Under FSDP a forward gathers parameters from every worker, so all of them rerun the
    same micro-batch index (the first worker's first bad one; their own batch, or the zero
    weight one) and the workers whose loss there was non-finite name the module."""
    firsts = collectives.all_gather_object(bad[0] if bad else None)
    index = next((i for i in firsts if i is not None), None)
    if index is None:
        return None
    batch = micro_batches[index] if micro_batches[index] is not None else engine.dummy_batch
    module = _rerun(engine, batch, index, ctx)
    return _where(module, index) if index in bad else None


def _rerun(engine: Engine, batch: Any, index: int, ctx: StepContext) -> str | None:
    """Run the criterion again on micro-batch ``index``; the first module whose output is
    non-finite, or None."""
    batch = to_device(batch, engine.device)
    ctx.micro_index = index

    def rerun():
        with autocast(engine.config.precision, engine.device):
            return engine.loss_fn(engine.module, batch, ctx).loss

    return first_nonfinite_module(engine.module, rerun)


def _where(module: str | None, index: int) -> str:
    where = f"module '{module}'" if module else "the criterion (every module's output was finite)"
    return where + f" on worker {collectives.rank()}, micro-batch {index}"


def _first_nonfinite_grad(engine: Engine) -> str | None:
    """The first parameter (in the model's order) with a non-finite gradient; under FSDP the
    first over all workers' shards."""
    if not (engine.sharded and engine.world_size > 1):
        return first_nonfinite_grad(engine.module)
    names = [n for n, _ in engine.module.named_parameters()]
    found = [n for n in collectives.all_gather_object(first_nonfinite_grad(engine.module)) if n is not None]
    return min(found, key=names.index) if found else None
