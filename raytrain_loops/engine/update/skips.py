"""A skipped update, the same on every worker once :func:`~raytrain_loops.engine.update.decision.decide`
has said skip: :class:`Skips`, the skip policy and its counts, and the diagnosis its errors carry
(:func:`describe_nonfinite`: where a non-finite loss or gradient was first seen, agreed by all
workers, and the loss terms' means over all workers)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from raytrain_loops.config.engine import EngineConfig, PrecisionConfig
from raytrain_loops.engine.api import LossFn, StepContext
from raytrain_loops.engine.devices import to_device
from raytrain_loops.engine.distributed import collectives
from raytrain_loops.engine.distributed.strategy import Strategy
from raytrain_loops.engine.update.decision import Decision
from raytrain_loops.engine.update.guards import first_nonfinite_grad, first_nonfinite_module
from raytrain_loops.engine.update.precision import autocast
from raytrain_loops.engine.update.sums import LocalSums
from raytrain_loops.errors import LossScaleError, NonFiniteError, OOMError

__all__ = ["REASONS", "Skips", "describe_nonfinite", "reruns"]

REASONS = ("overflow", "nonfinite", "oom")
"""What a skipped update is counted as (``nonfinite`` and ``oom`` also in a row)."""

Rerun = Callable[[Any, int], "str | None"]
"""The criterion run again on a micro-batch (by its index): the first module whose output is
non-finite, or None."""


class Skips:
    """The skip policy of one worker's engine: the skips counted by reason (``counts``), those in a
    row (``in_a_row``, reset by each applied update), and what a skip does to the optimizer and
    the loss scaler. ``config``: the engine's (``nonfinite``, ``oom``, ``precision.min_scale``)."""

    def __init__(self, config: EngineConfig, optimizer: torch.optim.Optimizer, scaler: Any):
        self.config, self.optimizer, self.scaler = config, optimizer, scaler
        self.counts = dict.fromkeys(REASONS, 0)
        self.in_a_row = {"nonfinite": 0, "oom": 0}

    def applied(self) -> None:
        """An update was applied: no skip in a row."""
        self.in_a_row = {"nonfinite": 0, "oom": 0}

    def skip(self, decision: Decision, step: int, describe: Callable[[], str]) -> None:
        """Drop the update on every worker, count it, and raise when a limit or policy says stop
        (``describe``: the non-finite diagnosis, worked out only when an error needs it). Every
        skip closes the loss scaler's step (``unscale_`` ran), so the next step can run."""
        optimizer, scaler = self.optimizer, self.scaler
        if decision is Decision.SKIP_EMPTY:
            optimizer.zero_grad(set_to_none=True)
            if scaler.is_enabled():
                scaler.update(scaler.get_scale())  # no data is no overflow: the scale stays
            return
        if decision is Decision.SKIP_OVERFLOW:
            optimizer.zero_grad(set_to_none=True)
            self._overflow()
            return
        reason = decision.value
        self.counts[reason] += 1
        self.in_a_row[reason] += 1
        # The error is worked out while the gradients are still there: the detector may name one.
        error = self._oom_error(step) if decision is Decision.SKIP_OOM else self._nonfinite_error(describe)
        optimizer.zero_grad(set_to_none=True)
        if scaler.is_enabled():
            scaler.update()
        if error is not None:
            raise error

    def retry(self) -> None:
        """An update that ran out of memory and is tried again with smaller micro-batches
        (``accum.micro_batch=auto``): its gradients dropped, the OOM counted, the loss scaler's
        step closed with the scale as it was (memory is no overflow)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.counts["oom"] += 1
        if self.scaler.is_enabled():
            self.scaler.update(self.scaler.get_scale())

    def _overflow(self) -> None:
        self.counts["overflow"] += 1
        self.scaler.update()
        scale = self.scaler.get_scale()
        floor = self.config.precision.min_scale
        if scale < floor:
            raise LossScaleError(
                f"fp16 loss scale fell to {scale:g}, below precision.min_scale={floor:g}: "
                "the loss or gradients are non-finite even at a tiny scale; try precision.dtype=bf16 or a lower lr"
            )

    def _oom_error(self, step: int) -> OOMError | None:
        cfg = self.config.oom
        if cfg.policy == "raise":
            return OOMError(
                f"out of memory in forward/backward at step {step} (oom.policy=raise); lower the "
                "micro-batch size or set oom.policy=skip"
            )
        if self.in_a_row["oom"] < cfg.max_consecutive:
            return None
        return OOMError(
            f"out of memory on {self.in_a_row['oom']} updates in a row (oom.max_consecutive="
            f"{cfg.max_consecutive}); lower the micro-batch size or raise accum.steps"
        )

    def _nonfinite_error(self, describe: Callable[[], str]) -> NonFiniteError | None:
        cfg = self.config.nonfinite
        if cfg.policy == "stop":
            return NonFiniteError(describe())
        if self.in_a_row["nonfinite"] < cfg.max_consecutive:
            return None
        return NonFiniteError(
            f"{self.in_a_row['nonfinite']} updates in a row had a non-finite loss or gradient "
            f"(nonfinite.max_consecutive={cfg.max_consecutive}); " + describe()
        )


def reruns(module: nn.Module, loss_fn: LossFn, precision: PrecisionConfig, device: torch.device, ctx: StepContext) -> Rerun:
    """The criterion run again on a micro-batch through ``module`` (unwrapped), under the run's
    autocast: the first module whose output is non-finite."""

    def rerun(batch: Any, index: int) -> str | None:
        batch = to_device(batch, device)
        ctx.micro_index = index

        def loss() -> torch.Tensor:
            with autocast(precision, device):
                return loss_fn(module, batch, ctx).loss

        return first_nonfinite_module(module, loss)

    return rerun


def describe_nonfinite(
    strategy: Strategy, module: nn.Module, rerun: Rerun, micro_batches: Sequence[Any], local: LocalSums, step: int, epoch: int
) -> str:
    """Name the first module whose output was non-finite, agreed by all workers, and the loss
    terms' means over all workers' micro-batches (one collective)."""
    where = None
    bad = [i for i, loss in local.losses if not bool(torch.isfinite(loss))]
    if strategy.shards_across_workers:
        where = _nonfinite_module_sharded(strategy, rerun, bad, micro_batches)
    elif bad:
        where = _where(rerun(micro_batches[bad[0]], bad[0]), bad[0])
    terms = {k: float(v) for k, v in local.term_sums.items()}
    reports = collectives.all_gather_object((where, terms, len(local.losses)))
    first = next((r for r, _, _ in reports if r), None)
    if first is None:
        param = _first_nonfinite_grad(strategy, module)
        first = f"the gradient of parameter '{param}'" if param else "an unknown place"
    message = f"non-finite loss or gradient at step {step} (epoch {epoch}): first seen in {first}"
    n = sum(count for _, _, count in reports)
    names = sorted({k for _, t, _ in reports for k in t})
    if names and n:
        means = {k: sum(t.get(k, 0.0) for _, t, _ in reports) / n for k in names}
        message += "; loss terms over all workers (unscaled means): " + ", ".join(
            f"{k}={v:.6g}" for k, v in means.items()
        )
    return message


def _nonfinite_module_sharded(strategy: Strategy, rerun: Rerun, bad: list[int], micro_batches: Sequence[Any]) -> str | None:
    """Under FSDP a forward gathers parameters from every worker, so all of them rerun the
    same micro-batch index (the first worker's first bad one; their own batch, or the zero
    weight one) and the workers whose loss there was non-finite name the module."""
    firsts = collectives.all_gather_object(bad[0] if bad else None)
    index = next((i for i in firsts if i is not None), None)
    if index is None:
        return None
    batch = micro_batches[index] if micro_batches[index] is not None else strategy.dummy_batch
    module = rerun(batch, index)
    return _where(module, index) if index in bad else None


def _where(module: str | None, index: int) -> str:
    where = f"module '{module}'" if module else "the criterion (every module's output was finite)"
    return where + f" on worker {collectives.rank()}, micro-batch {index}"


def _first_nonfinite_grad(strategy: Strategy, module: nn.Module) -> str | None:
    """The first parameter (in the model's order) with a non-finite gradient; under FSDP the
    first over all workers' shards."""
    if not strategy.shards_across_workers:
        return first_nonfinite_grad(module)
    names = [n for n, _ in module.named_parameters()]
    found = [n for n in collectives.all_gather_object(first_nonfinite_grad(module)) if n is not None]
    return min(found, key=names.index) if found else None
