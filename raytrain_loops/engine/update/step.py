"""The update: :class:`Engine`, the per-worker model, optimizer, loss scaler, EMA and counters,
and its one optimizer update over K micro-batches, with the numerics of the seed loops; its state
dict (the checkpoint's ``model``, ``optimizer``, ``scaler``, ``ema``, ``counters``, ``callbacks``,
``meters``, ``rng``, ``layout``).

Per step, on every worker (docs/architecture.md places it among the layers):

1. forward under autocast and backward for each micro-batch; DDP synchronises gradients only on
   the last one (``no_sync`` on the others), and so does FSDP (its reduce-scatter; every worker
   runs every micro-batch's forward, a zero-weight one when it has no data, since FSDP gathers
   the parameters in each forward): :mod:`~raytrain_loops.engine.distributed.step_sync`;
2. one all-reduce of a small vector ``[sample_size, loss_sum, loss_terms, ooms, grad_norm^2]``,
   each worker's part of the squared norm of its shard under FSDP,
   followed (``grad_sync.check``, DDP only) by one slot per worker for its own squared gradient norm and
   by the criterion's ``stats``, and one host read of it: every decision below is taken from the
   reduced values, so every worker takes the same one. A task that declares counts adds one
   small all-reduce before the forward passes (``ctx.totals``); nothing else synchronises;
3. :func:`~raytrain_loops.engine.update.decision.decide`, a pure function of the reduced values: apply,
   or skip (OOM anywhere, no data anywhere, fp16 overflow, non-finite) and possibly raise, the
   same on all workers (:mod:`~raytrain_loops.engine.update.skips`); raise when the workers' gradient
   norms differ (DDP left them unsynchronised);
4. otherwise normalise (``sum`` mode: multiply by ``world_size / total_sample_size``, DDP having
   averaged), clip (global or per-parameter), cancel the frozen last layer's gradients, step the
   optimizer, update the loss scale, count the step and update the EMA; the update's values go
   to the engine's meters (:func:`~raytrain_loops.engine.meters.log_step`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from raytrain_loops.config.engine import EngineConfig
from raytrain_loops.engine.api import LossFn, LossOutput, StepContext, StepResult
from raytrain_loops.engine.devices import to_device, unwrap
from raytrain_loops.engine.distributed import collectives, sharding, step_sync
from raytrain_loops.engine.length import accum_steps
from raytrain_loops.engine.meters import Meters, log_step
from raytrain_loops.engine.optim import schedules
from raytrain_loops.engine.optim.optimizer import apply_values, frozen_params, keep_kernel, optimizer_scaler_ema
from raytrain_loops.engine.rng import rng_state, set_rng_state
from raytrain_loops.engine.update import skips
from raytrain_loops.engine.update.decision import Decision, Reduced, decide
from raytrain_loops.engine.update.guards import is_oom
from raytrain_loops.engine.update.micro import MicroBatches, SplitFn
from raytrain_loops.engine.update.precision import autocast

__all__ = ["Engine"]


@dataclass
class LocalSums:
    """This worker's sums over its micro-batches, before the reduction."""

    sample_size: torch.Tensor | float = 0.0
    loss_sum: torch.Tensor | float = 0.0
    terms: float = 0.0
    ooms: int = 0
    losses: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (micro-batch index, loss)
    logs: list[tuple[dict[str, Any], Any]] = field(default_factory=list)  # (criterion logs, weight)
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # summed over micro-batches
    term_sums: dict[str, float] = field(default_factory=dict)  # unscaled terms, for error messages

    def add(self, index: int, out: LossOutput) -> None:
        """Add micro-batch ``index``'s criterion output (detached)."""
        loss = out.loss.detach().float()
        self.losses.append((index, loss))
        self.loss_sum = self.loss_sum + loss
        self.sample_size = self.sample_size + out.sample_size
        self.terms += 1.0
        self.add_stats(out.stats)
        if out.terms:
            self.logs.append(({**out.logs, **out.term_logs()}, out.sample_size))
            for name, t in out.terms.items():
                self.term_sums[name] = self.term_sums.get(name, 0.0) + t.detach().float()
        else:
            self.logs.append((out.logs, out.sample_size))

    def add_stats(self, stats: dict[str, torch.Tensor], weight: float = 1.0) -> None:
        for k, v in stats.items():
            v = v.detach().double().flatten() * weight
            self.stats[k] = v if k not in self.stats else self.stats[k] + v


class Engine:
    """The per-worker training state and its update. Imports no Ray.

    ``model`` may be wrapped in ``DistributedDataParallel`` or sharded by FSDP2's ``fully_shard``
    (one of them is required when more than one worker runs). ``ema_module``: the EMA's copy of
    the model, prepared the same way, for a sharded model (which cannot be deep-copied).
    ``total_steps`` is the run's length in optimizer steps, for the schedules;
    ``total_epochs`` the epochs it spans (:func:`~raytrain_loops.engine.length.epochs_in_run`),
    required by ``per: epoch`` schedules, which follow ``Engine.epoch`` (set by the loop).

    The step's DDP/FSDP mechanics (:mod:`~raytrain_loops.engine.distributed.step_sync`), a
    skipped update (:mod:`~raytrain_loops.engine.update.skips`) and the meters' logging
    (:mod:`~raytrain_loops.engine.meters`) are functions taking the engine, reading its public
    attributes. :meth:`state_dict`, :meth:`load_state_dict` and :meth:`sharded_targets` are its
    state, as checkpoints hold it.
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
        self.ddp, self.sharded = step_sync.wrapping(model, self.world_size)
        self.device = sharding.local(next(self.module.parameters())).device
        self._cdev = collectives.collective_device()
        # Under FSDP each worker holds its own shard of the gradients, whose norms differ by
        # design: there is nothing to compare, and the reduce-scatter leaves no copy to drift.
        self._check_sync = config.grad_sync.check and self.world_size > 1 and not self.sharded
        self._mean = config.loss.reduction == "mean"
        # accum.micro_batch=auto: each batch split into micro.splits, doubled on an OOM anywhere.
        self.micro = MicroBatches(config.accum.micro_batch == "auto", self._mean, split_batch)
        self.optimizer, self.scaler, self.ema = optimizer_scaler_ema(
            self.module,
            config,
            self.device,
            sharded=self.sharded,
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
        self.dummy_batch: Any = None  # a batch to join the collectives with at zero weight
        # Counters: all part of the saved state.
        self.step = 0
        self.epoch = 0
        self.counts = {"overflow": 0, "nonfinite": 0, "oom": 0, "micro_batches": 0}
        self.in_a_row = {"nonfinite": 0, "oom": 0}
        # The loop's callbacks' state by callback name, saved and restored with the engine's:
        # the loop sets it before each checkpoint and hands it back when a run resumes.
        self.callback_state: dict[str, Any] = {}

    # ------------------------------------------------------------------ the step

    def schedule_values(self) -> dict[str, float]:
        """Every schedule's value at the current step (and epoch, for ``per: epoch`` ones)."""
        return schedules.schedule_values(
            self.config.schedules, self.step, self.total_steps, self.epoch, self.total_epochs
        )

    def train_step(self, micro_batches: Sequence[Any], data_time: float = 0.0) -> StepResult:
        """One optimizer update over ``micro_batches`` (a ``None`` entry stands for a worker that
        has run out of data: it still joins the collectives, contributing nothing). Under
        ``accum.micro_batch=auto`` each is split into ``micro.splits``, and an OOM on any worker
        doubles them on every worker and tries the same update again (:mod:`.micro`)."""
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
        if decision is Decision.SKIP_OOM and self.micro.halve(self, int(local.ooms)):
            skips.retry(self)
            return None
        if decision is Decision.APPLY:
            self._apply(reduced, grads, values["ema_momentum"])
            if self._after_step is not None and stats:
                self._after_step(self.module, stats)
            compute = time.perf_counter() - start
            log_step(self, local.logs, reduced, values["lr"], compute, data_time)
        else:
            skips.skip(self, decision, micro_batches, local, ctx)
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

    def _forward_backward(self, micro_batches: Sequence[Any], ctx: StepContext) -> LocalSums:
        """Forward and backward of each micro-batch; DDP synchronises on the last one only."""
        k = len(micro_batches)
        # accum.reduce=sum: the sum of the epoch's accum.steps micro-batches' mean-loss gradients
        # (k of them, or more when an elastic group runs more per worker); mean: their mean.
        divisor = k / accum_steps(self.config.accum, self.epoch) if self.config.accum.reduce == "sum" else k
        local = LocalSums()
        for i, batch in enumerate(micro_batches):
            ctx.micro_index = i
            last = i == k - 1
            if batch is None:
                step_sync.join_with_dummy(self, ctx, last, local)
                continue
            batch = to_device(batch, self.device)
            if self.dummy_batch is None:
                # Kept before the forward: a worker whose very first micro-batch fails (OOM on
                # the first step after a restart) still has a batch to join the all-reduce with.
                self.dummy_batch = batch
            backward = False
            try:
                with step_sync.sync(self, last):
                    with autocast(self.config.precision, self.device):
                        out = self.loss_fn(self.model, batch, ctx)
                    backward = True
                    self.scaler.scale(out.loss / divisor if self._mean else out.loss).backward()
            except Exception as err:
                if not is_oom(err):
                    raise
                step_sync.recover_from_oom(self, ctx, err, local, backward=backward, last=last)
                continue
            local.add(i, out)
        self.counts["micro_batches"] += k
        return local

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
        step_sync.require_group(self)  # a group torn down mid-step reduced nothing
        stats, at = {}, head
        for k in names:
            n = local.stats[k].numel()
            stats[k] = packed[at : at + n].to(self.device)
            at += n
        sums = packed[:head].tolist()
        return Reduced.from_sums(sums, mean=self._mean, world=self.world_size, sharded=self.sharded), stats

    def _apply(self, reduced: Reduced, grads: list[torch.Tensor], ema_momentum: float) -> None:
        """Normalise, clip, freeze, step the optimizer and the loss scale, count, update the EMA."""
        if self._check_sync:
            step_sync.check_grad_sync(list(reduced.norms), self.config.grad_sync.rtol, self.step)
        self._clip_and_normalise(grads, reduced.grad_factor, reduced.grad_norm)
        if self.epoch < self.config.freeze.last_layer_epochs:
            for p in self._frozen:
                p.grad = None
        self.optimizer.step()
        if self.scaler.is_enabled():
            self.scaler.update()
        self.step += 1
        self.in_a_row = {"nonfinite": 0, "oom": 0}
        if self.ema is not None and self.step % self.config.ema.every == 0:
            self.ema.update(ema_momentum)

    # ------------------------------------------------------------------ pieces of the step

    def _clip_and_normalise(self, grads: list[torch.Tensor], factor: float, grad_norm: float) -> None:
        clip = self.config.clip
        if clip.mode == "global":
            factor *= min(1.0, clip.max_norm / (grad_norm + 1e-6))
        if factor != 1.0 and grads:
            torch._foreach_mul_(grads, factor)
        if clip.mode == "per_param" and grads:
            norms = torch._foreach_norm(grads)
            if self.sharded and self.world_size > 1:
                # A parameter's norm spans every worker's shard: one all-reduce of the squares.
                squares = torch.stack(norms).double().square().to(self._cdev)
                norms = list(collectives.all_reduce_sum(squares).sqrt().to(grads[0].device, grads[0].dtype).unbind())
            coefs = [torch.clamp(clip.max_norm / (n + 1e-6), max=1.0) for n in norms]
            torch._foreach_mul_(grads, coefs)

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
            **({"layout": "sharded"} if self.sharded else {}),
        }

    def _model_optimizer_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if not self.sharded:
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
        self.counts = {k: int(c[f"count_{k}"]) for k in self.counts}
        self.micro.splits = int(c.get("micro_batch_splits", 1))  # 1 in checkpoints from before it
        # Checkpoints written before these were saved resume with no skips in a row and no
        # callback state.
        self.in_a_row = {k: int(c.get(f"in_a_row_{k}", 0)) for k in self.in_a_row}
        self.callback_state = dict(state.get("callbacks") or {})
        self.meters.load_state_dict(state.get("meters") or {})  # older checkpoints: a fresh epoch
        self.meters.flushed_at = self.step
        if "rng" in state:  # absent when a group of another size resumes (each worker seeds its own)
            set_rng_state(state["rng"])
