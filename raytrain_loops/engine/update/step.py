"""The update: :class:`Engine`, one worker's model, optimizer, loss scaler, EMA and counters, and
its one optimizer update over K micro-batches (:meth:`Engine.train_step`), with the numerics of
the seed loops; its state dict is the checkpoint's ``model``, ``optimizer``, ``scaler``, ``ema``,
``counters``, ``callbacks``, ``meters``, ``rng`` and ``layout``. The step's semantics:
docs/engine.md; where it sits among the layers: docs/architecture.md.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from raytrain_loops.config.engine import EngineConfig
from raytrain_loops.engine.api import LossFn, LossOutput, StepContext, StepResult
from raytrain_loops.engine.devices import to_device, unwrap
from raytrain_loops.engine.distributed import collectives, sharding
from raytrain_loops.engine.distributed.strategy import Forward, Strategy, check_grad_sync
from raytrain_loops.engine.length import accum_steps
from raytrain_loops.engine.meters import Meters
from raytrain_loops.engine.optim import schedules
from raytrain_loops.engine.optim.clip import clip_and_normalise
from raytrain_loops.engine.optim.optimizer import apply_values, build_optimizer_scaler_ema, frozen_params, keep_kernel
from raytrain_loops.engine.rng import rng_state, set_rng_state
from raytrain_loops.engine.update.decision import Decision, Reduced, decide
from raytrain_loops.engine.update.guards import is_oom
from raytrain_loops.engine.update.micro import MicroBatches, SplitFn
from raytrain_loops.engine.update.precision import autocast
from raytrain_loops.engine.update.skips import REASONS, Skips, describe_nonfinite, reruns
from raytrain_loops.engine.update.sums import LocalSums
from raytrain_loops.errors import GroupBrokenError

__all__ = ["Engine"]


class Engine:
    """The per-worker training state and its update. Imports no Ray.

    ``model`` may be wrapped in ``DistributedDataParallel`` or sharded by FSDP2's ``fully_shard``
    (one of them is required when more than one worker runs). ``ema_module``: the EMA's copy of
    the model, prepared the same way, for a sharded model (which cannot be deep-copied).
    ``total_steps`` is the run's length in optimizer steps, for the schedules;
    ``total_epochs`` the epochs it spans (:func:`~raytrain_loops.engine.length.epochs_in_run`),
    required by ``per: epoch`` schedules, which follow ``Engine.epoch`` (set by the loop).

    Its parts, each with its own state: the DDP/FSDP side of the step (``strategy``, a
    :class:`~raytrain_loops.engine.distributed.strategy.Strategy`), the skip policy (``skips``),
    the micro-batching (``micro``) and the metric sums (``meters``). :meth:`state_dict`,
    :meth:`load_state_dict` and :meth:`sharded_targets` are its state, as checkpoints hold it.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        config: EngineConfig,
        *,
        total_steps: int,
        total_epochs: int = 0,
        task_param_groups: list[dict[str, Any]] | None = None,
        counts: Callable[[Any], dict[str, float]] | None = None,
        count_keys: Sequence[str] = (),
        after_step: Callable[[nn.Module, dict[str, torch.Tensor]], None] | None = None,
        ema_module: nn.Module | None = None,
        split_batch: SplitFn | None = None,
    ):
        if not isinstance(config, EngineConfig):
            raise TypeError(f"Engine takes an EngineConfig (a run config's .engine), not {type(config).__name__}")
        self.model = model
        self.module = unwrap(model)
        self.loss_fn = loss_fn
        self.config = config
        self.total_steps, self.total_epochs = total_steps, total_epochs
        per_epoch = sorted(n for n, sch in config.schedules.items() if sch.per == "epoch")
        if per_epoch and total_epochs < 1:
            raise ValueError(f"schedules {per_epoch} are per=epoch: the Engine needs total_epochs (the run's epochs)")
        self.world_size = collectives.world_size()
        self.strategy = Strategy(model, self.world_size)
        self.device = sharding.local(next(self.module.parameters())).device
        self._cdev = collectives.collective_device()
        # Under FSDP each worker holds its own shard of the gradients, whose norms differ by
        # design: there is nothing to compare, and the reduce-scatter leaves no copy to drift.
        self._check_sync = config.grad_sync.check and self.world_size > 1 and not self.strategy.sharded
        self._mean = config.loss.reduction == "mean"
        # accum.micro_batch=auto: each batch split into micro.splits, doubled on an OOM anywhere.
        self.micro = MicroBatches(config.accum.micro_batch == "auto", self._mean, split_batch)
        self.optimizer, self.scaler, self.ema = build_optimizer_scaler_ema(
            self.module,
            config,
            self.device,
            sharded=self.strategy.sharded,
            task_param_groups=task_param_groups,
            ema_module=ema_module,
        )
        self._params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self._frozen = frozen_params(self.module, config.freeze)
        if bool(counts) != bool(count_keys):
            raise ValueError("Engine: counts and count_keys go together (the keys fix the all-reduce's layout)")
        self._counts, self._count_keys = counts, tuple(count_keys)
        self._after_step = after_step
        self.meters = Meters(epochs=True)
        self.skips = Skips(config, self.optimizer, self.scaler)
        # Counters: all part of the saved state (with the skips' counts and the micro-batch splits).
        self.step = 0
        self.epoch = 0
        self.micro_batches = 0
        # The loop's callbacks' state by callback name, saved and restored with the engine's:
        # the loop sets it before each checkpoint and hands it back when a run resumes.
        self.callback_state: dict[str, Any] = {}

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded by FSDP2's ``fully_shard``."""
        return self.strategy.sharded

    @property
    def counts(self) -> dict[str, int]:
        """The updates skipped, by reason, and the micro-batches run."""
        return {**self.skips.counts, "micro_batches": self.micro_batches}

    @property
    def in_a_row(self) -> dict[str, int]:
        """The updates skipped in a row, by reason."""
        return self.skips.in_a_row

    # ------------------------------------------------------------------ the step

    def schedule_values(self) -> dict[str, float]:
        """Every schedule's value at the current step (and epoch, for ``per: epoch`` ones)."""
        return schedules.schedule_values(
            self.config.schedules, self.step, self.total_steps, self.epoch, self.total_epochs
        )

    def train_step(self, micro_batches: Sequence[Any], data_time: float = 0.0) -> StepResult:
        """One optimizer update over ``micro_batches`` (a ``None`` entry stands for a worker that
        has run out of data: it still joins the collectives, contributing nothing), on every
        worker: forward and backward of each micro-batch, gradients synchronised on the last one
        only; one all-reduce of the step's sums and one host read of it; :func:`decide` on the
        reduced values, the same on every worker; then apply (normalise, clip, step, count,
        EMA) or skip (:class:`Skips`). Under ``accum.micro_batch=auto`` each batch is split into
        ``micro.splits``, and an OOM on any worker doubles them on every worker and tries the
        same update again (:mod:`.micro`)."""
        start = time.perf_counter()
        attempt = self.micro.attempt(self.module)
        while True:
            result = self._try_step(self.micro.parts(micro_batches), start, data_time)
            if result is not None:
                return result
            attempt.restore()

    def _try_step(self, micro_batches: Sequence[Any], start: float, data_time: float) -> StepResult | None:
        """The update over these micro-batches; None when an OOM halved them (try again)."""
        values = self.schedule_values()
        apply_values(self.optimizer, values["lr"], values["weight_decay"])
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        ctx = StepContext(self.step, self.epoch, values, self.ema.module if self.ema else None)
        ctx.slots = self.world_size * len(micro_batches)
        ctx.totals = self._totals(micro_batches)
        local = self._forward_backward(micro_batches, ctx)
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.optimizer)
        grads = [sharding.local(p.grad) for p in self._params if p.grad is not None]
        reduced, stats = self._reduce(local, grads)
        if stats and self._after_step is None:
            raise ValueError(
                f"the criterion returned stats {sorted(stats)} but the Engine has no after_step to take them "
                "(pass after_step=task.after_step)"
            )
        decision = decide(reduced, fp16=self.scaler.is_enabled())
        if decision is Decision.SKIP_OOM and self.micro.halve(self.step, int(local.ooms)):
            self.skips.retry()
            return None
        if decision is Decision.APPLY:
            self._apply(reduced, grads, values["ema_momentum"])
            if self._after_step is not None and stats:
                self._after_step(self.module, stats)
            compute = time.perf_counter() - start
            self.meters.add_update(local.logs, reduced, values["lr"], compute, data_time, self.world_size)
        else:
            rerun = reruns(self.module, self.loss_fn, self.config.precision, self.device, ctx)
            describe = lambda: describe_nonfinite(  # noqa: E731
                self.strategy, self.module, rerun, micro_batches, local, self.step, self.epoch
            )
            self.skips.skip(decision, self.step, describe)
            compute = time.perf_counter() - start
        return StepResult(
            decision,
            reduced.loss,
            reduced.sample_size,
            reduced.grad_norm,
            values["lr"],
            compute,
            data_time=data_time,
            local_sample_size=local.sample_size,
        )

    def _totals(self, micro_batches: Sequence[Any]) -> dict[str, float]:
        """The task's counts summed over this update's micro-batches and all workers: one
        all-reduce, on every worker whatever its data (a ``None`` micro-batch counts zero), and
        none when the task declares no counts."""
        if self._counts is None:
            return {}
        sums = dict.fromkeys(self._count_keys, 0.0)
        for batch in micro_batches:
            if batch is None:
                continue
            counts = self._counts(batch)
            if set(counts) != set(sums):
                raise ValueError(f"Task.counts returned keys {sorted(counts)}; its count_keys are {sorted(sums)}")
            for key, n in counts.items():
                sums[key] += float(n)
        packed = torch.tensor([sums[k] for k in self._count_keys], dtype=torch.float64, device=self._cdev)
        collectives.all_reduce_sum(packed)
        return dict(zip(self._count_keys, packed.tolist(), strict=True))

    def _forward_backward(self, micro_batches: Sequence[Any], ctx: StepContext) -> LocalSums:
        """Forward and backward of each micro-batch; DDP synchronises on the last one only."""
        k = len(micro_batches)
        # accum.reduce=sum: the sum of the epoch's accum.steps micro-batches' mean-loss gradients
        # (k of them, or more when an elastic group runs more per worker); mean: their mean.
        divisor = k / accum_steps(self.config.accum, self.epoch) if self.config.accum.reduce == "sum" else k
        local = LocalSums()
        forward = self._forward(ctx)
        for i, batch in enumerate(micro_batches):
            ctx.micro_index = i
            last = i == k - 1
            if batch is None:
                _zero_weight(local, self.strategy.join(forward, last))
                continue
            batch = to_device(batch, self.device)
            if self.strategy.dummy_batch is None:
                # Kept before the forward: a worker whose very first micro-batch fails (OOM on
                # the first step after a restart) still has a batch to join the all-reduce with.
                self.strategy.dummy_batch = batch
            backward = False
            try:
                with self.strategy.sync(last):
                    out = forward(batch)
                    backward = True
                    self.scaler.scale(out.loss / divisor if self._mean else out.loss).backward()
            except Exception as err:
                if not is_oom(err):
                    raise
                self._recover_from_oom(err, forward, local, backward=backward, last=last)
                continue
            local.add(i, out)
        self.micro_batches += k
        return local

    def _forward(self, ctx: StepContext) -> Forward:
        """The criterion on one batch through the (wrapped) model, under the run's autocast."""

        def forward(batch: Any) -> LossOutput:
            with autocast(self.config.precision, self.device):
                return self.loss_fn(self.model, batch, ctx)

        return forward

    def _recover_from_oom(self, err: BaseException, forward: Forward, local: LocalSums, *, backward: bool, last: bool) -> None:
        """After an OOM in a micro-batch's forward/backward: count it (every worker decides alike
        after the all-reduce, ``oom.policy`` or ``accum.micro_batch=auto``), free the memory and
        join the collectives at zero weight; or, when the group cannot go on
        (:class:`GroupBrokenError`), halve this worker's micro-batch first under
        ``accum.micro_batch=auto`` and say so, so that the restarted group starts from it."""
        try:
            self.strategy.check_oom(err, self.step, backward=backward, last=last)
            local.ooms += 1
            self.optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if self.micro.auto:  # its zero-weight pass, at the size that just failed, might not fit
                self.strategy.dummy_batch = self.micro.smaller(self.strategy.dummy_batch)
            _zero_weight(local, self.strategy.join_after_oom(forward, last, err, self.step))
            self.optimizer.zero_grad(set_to_none=True)
        except GroupBrokenError:
            self.micro.before_restart(self.step)
            raise

    def _reduce(self, local: LocalSums, grads: list[torch.Tensor]) -> tuple[Reduced, dict[str, torch.Tensor]]:
        """The step's one all-reduce and its one host read; the criterion's ``stats`` ride along
        (summed over micro-batches and workers)."""
        norm_sq = torch.stack(torch._foreach_norm(grads)).double().square().sum() if grads else 0.0
        packed = torch.stack(
            [
                torch.as_tensor(v, dtype=torch.float64).to(self._cdev)
                for v in (local.sample_size, local.loss_sum, local.terms, local.ooms, norm_sq)
            ]
        )
        if self._check_sync:
            # Each worker's own norm in its own slot: the sum over workers is the list of norms,
            # so the consistency check costs no extra collective.
            slots = torch.zeros(self.world_size, dtype=torch.float64, device=self._cdev)
            slots[collectives.rank()] = packed[4]
            packed = torch.cat([packed, slots])
        head = packed.numel()
        names = sorted(local.stats)
        if names:
            packed = torch.cat([packed, *(local.stats[k].to(self._cdev) for k in names)])
        collectives.all_reduce_sum(packed)
        self.strategy.require_group(self.step)  # a group torn down mid-step reduced nothing
        stats, at = {}, head
        for k in names:
            n = local.stats[k].numel()
            stats[k] = packed[at : at + n].to(self.device)
            at += n
        sums = packed[:head].tolist()
        reduced = Reduced.from_sums(sums, mean=self._mean, world=self.world_size, sharded=self.strategy.sharded)
        return reduced, stats

    def _apply(self, reduced: Reduced, grads: list[torch.Tensor], ema_momentum: float) -> None:
        """Normalise, clip, freeze, step the optimizer and the loss scale, count, update the EMA."""
        if self._check_sync:
            check_grad_sync(list(reduced.norms), self.config.grad_sync.rtol, self.step)
        clip_and_normalise(
            grads,
            reduced.grad_factor,
            reduced.grad_norm,
            self.config.clip,
            across_shards=self.strategy.shards_across_workers,
            collective_device=self._cdev,
        )
        if self.epoch < self.config.freeze.last_layer_epochs:
            for p in self._frozen:
                p.grad = None
        self.optimizer.step()
        if self.scaler.is_enabled():
            self.scaler.update()
        self.step += 1
        self.skips.applied()
        if self.ema is not None and self.step % self.config.ema.every == 0:
            self.ema.update(ema_momentum)

    # ------------------------------------------------------------------ metrics

    def reduce_metrics(self) -> dict[str, float]:
        """The meters' means over all workers since the last call, plus the counters. Every worker
        must call it at the same point (it runs collectives)."""
        out = self.meters.reduce()
        out.update(step=float(self.step), epoch=float(self.epoch))
        out.update({k: float(v) for k, v in self.skips.counts.items()})
        if self.scaler.is_enabled():
            out["loss_scale"] = self.scaler.get_scale()
        return out

    def flush_epoch_metrics(self) -> None:
        """Reduce the epoch's metric sums so far over all workers, so that the state dict holds
        them for every worker (before a checkpoint). Every worker must call it at the same point."""
        self.meters.flush_epoch_at(self.step)

    def end_epoch_metrics(self) -> dict[str, float]:
        """The epoch's weighted means over all workers (DINO's and DETR's global averages), and a
        fresh epoch. Every worker must call it at the same point (one all-reduce)."""
        self.meters.flushed_at = self.step
        return self.meters.end_epoch()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-for-bit: weights, optimizer, scaler, EMA, counters and
        this worker's RNG states. Safe for ``torch.load(weights_only=True)``.

        Under FSDP ``model``, ``optimizer`` and ``ema`` hold this worker's shards (DTensors, the
        optimizer's state keyed by parameter name), for ``torch.distributed.checkpoint``, and
        ``layout`` is ``"sharded"``."""
        model, optimizer = self._model_optimizer_state()
        return {
            "model": model,
            "optimizer": optimizer,
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
            "ema": self.ema.state_dict() if self.ema else None,
            "counters": {
                "step": self.step,
                "epoch": self.epoch,
                "micro_batch_splits": self.micro.splits,
                **{f"count_{k}": v for k, v in self.counts.items()},
                **{f"in_a_row_{k}": v for k, v in self.in_a_row.items()},
            },
            "callbacks": dict(self.callback_state),
            "meters": self.meters.state_dict(),
            "rng": rng_state(),
            **({"layout": "sharded"} if self.strategy.sharded else {}),
        }

    def _model_optimizer_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if not self.strategy.sharded:
            return self.module.state_dict(), self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(self.module, self.optimizer)

    def sharded_targets(self) -> dict[str, Any]:
        """What a sharded checkpoint is loaded into (``torch.distributed.checkpoint.load`` fills it
        in place, resharding to this group's size): the model's and optimizer's state keyed by
        parameter name, and the EMA's, as this engine holds them (shards, or whole tensors when
        the model is not sharded). Hand the filled dict to :meth:`load_state_dict` with the rest
        of the state and ``layout="sharded"``."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optimizer": optimizer, "ema": self.ema.state_dict() if self.ema else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` captured (a sharded layout through
        :meth:`sharded_targets`)."""
        if state.get("layout") == "sharded":
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(
                self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
            )
        else:
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        keep_kernel(self.optimizer)
        if self.scaler.is_enabled() and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None:
            if state["ema"] is None:
                raise ValueError("the checkpoint has no EMA weights but ema.enabled is true")
            self.ema.load_state_dict(state["ema"])
        c = state["counters"]
        self.step, self.epoch = int(c["step"]), int(c["epoch"])
        self.skips.counts = {k: int(c[f"count_{k}"]) for k in REASONS}
        self.micro_batches = int(c["count_micro_batches"])
        self.micro.splits = int(c.get("micro_batch_splits", 1))
        self.skips.in_a_row = {k: int(c.get(f"in_a_row_{k}", 0)) for k in self.skips.in_a_row}
        self.callback_state = dict(state.get("callbacks") or {})
        self.meters.load_state_dict(state.get("meters") or {})
        self.meters.flushed_at = self.step
        if "rng" in state:  # absent when a group of another size resumes (each worker seeds its own)
            set_rng_state(state["rng"])


def _zero_weight(local: LocalSums, stats: dict[str, torch.Tensor] | None) -> None:
    """A zero-weight pass's ``stats`` (None: none ran), added so that the step's all-reduce has the
    same layout on every worker."""
    if stats is not None:
        local.add_stats(stats, 0.0)
