"""How a group of workers trains one model: alone, with DDP or with FSDP2. The engine owns one
:class:`Strategy`, which holds every difference between them that the step meets: the gradient
sync of each micro-batch, the zero-weight pass of a worker without data, what an out-of-memory
error leaves, and the check that the step's collectives still had every worker.
:func:`check_grad_sync` compares the workers' gradient norms after DDP."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from typing import Any

from torch import nn

from raytrain_loops.engine.api import LossOutput
from raytrain_loops.engine.distributed import collectives, sharding
from raytrain_loops.errors import GradSyncError, GroupBrokenError, TrainingError

__all__ = ["Strategy", "check_grad_sync"]

Forward = Callable[[Any], LossOutput]
"""The criterion on one batch, under the run's autocast (the engine's)."""


class Strategy:
    """The parallel side of ``model``'s step on ``world_size`` workers: ``model`` wrapped in
    ``DistributedDataParallel`` (``ddp``) or sharded by ``fully_shard`` (``sharded``), one of
    them required when more than one worker runs. ``dummy_batch``: the batch a worker without
    data joins the collectives with, at zero weight (the first batch it saw)."""

    def __init__(self, model: nn.Module, world_size: int):
        self.model, self.world_size = model, world_size
        self.ddp, self.sharded = hasattr(model, "no_sync"), sharding.is_sharded(model)
        if world_size > 1 and not (self.ddp or self.sharded):
            raise ValueError(
                f"{world_size} workers are running but the model is neither wrapped in "
                "DistributedDataParallel nor sharded by fully_shard"
            )
        self.dummy_batch: Any = None

    @property
    def shards_across_workers(self) -> bool:
        """Whether each worker holds a shard of the parameters, gradients and optimizer state
        that the others do not: FSDP on more than one worker."""
        return self.sharded and self.world_size > 1

    def sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Where a micro-batch's backward synchronises gradients: on the last micro-batch only."""
        if self.sharded:
            # FSDP2's counterpart of no_sync: gradients stay unsharded and accumulate until the
            # last micro-batch's backward reduce-scatters their sum.
            self.model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        if self.ddp and not last:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def join(self, forward: Forward, last: bool) -> dict[str, Any] | None:
        """Run a zero-weight forward/backward on :attr:`dummy_batch` so that DDP's all-reduce on
        the last micro-batch still gets this worker's (zero) contribution; off the last
        micro-batch nothing is needed. Under FSDP every micro-batch needs it: each forward
        gathers the parameters from all workers. Returns the criterion's ``stats`` (to be added
        at zero weight, so that the step's all-reduce has the same layout on every worker), or
        None when no pass was needed."""
        if self.world_size == 1 or not (self.sharded or (last and self.ddp)):
            return None
        if self.dummy_batch is None:
            raise TrainingError(
                "a worker has no batch to join the gradient all-reduce with: its first micro-batch "
                "failed or it had no data at all; check data.batch_size against the rows per worker"
            )
        with self.sync(last):
            out = forward(self.dummy_batch)
        (out.loss * 0.0).backward()
        return out.stats

    def check_oom(self, err: BaseException, step: int, *, backward: bool, last: bool) -> None:
        """After an out-of-memory error in a micro-batch's forward/backward: raise
        :class:`GroupBrokenError` when the other workers are inside collectives of this
        micro-batch that this one cannot rejoin (FSDP's gathers and reduce-scatters, DDP's
        all-reduce in the last backward); otherwise this worker may join at zero weight."""
        rank = collectives.rank()
        if self.shards_across_workers:
            raise GroupBrokenError(
                f"out of memory in forward/backward on worker {rank} at step {step} under FSDP: "
                "the other workers are inside the parameter all-gathers and gradient reduce-scatters of "
                "this micro-batch, which this one cannot rejoin in order; the group restarts from the last "
                "checkpoint. If this repeats, lower the micro-batch size"
            ) from err
        if backward and last and self.ddp and self.world_size > 1:
            raise GroupBrokenError(
                f"out of memory in the backward pass of the synchronising micro-batch on worker "
                f"{rank} at step {step}: DDP's gradient all-reduce was under way and cannot "
                "be completed; the group restarts from the last checkpoint"
            ) from err

    def join_after_oom(self, forward: Forward, last: bool, err: BaseException, step: int) -> dict[str, Any] | None:
        """:meth:`join` after an out-of-memory error; when that fails too, the other workers wait
        in DDP's all-reduce for this one, and only a restart of the group (from the last
        checkpoint) ends that wait on every worker: :class:`GroupBrokenError`."""
        try:
            return self.join(forward, last)
        except Exception as again:
            raise GroupBrokenError(
                f"out of memory on worker {collectives.rank()} at step {step}, and its zero-weight pass to join "
                f"the gradient all-reduce failed too ({type(again).__name__}: {again}); the group restarts from "
                "the last checkpoint. If this repeats, lower the micro-batch size"
            ) from err

    def require_group(self, step: int) -> None:
        """Raise :class:`GroupBrokenError` when the process group the engine was built in is gone:
        Ray destroys it when it tears the group down (a preemption's restart, another worker's
        failure) while this worker's training thread may be mid-step, and from then on the
        collectives are no-ops that leave this worker's own values (a gradient norm of 0 for every
        other worker, a loss of this worker's batches alone). Judged as they are, those would be a
        training stop (``GradSyncError``, a non-finite loss) where Ray retries a group failure."""
        if collectives.torn_down(self.world_size):
            raise GroupBrokenError(
                f"the process group of {self.world_size} workers was destroyed during step {step + 1} "
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
