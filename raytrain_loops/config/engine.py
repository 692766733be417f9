"""Config sections of the per-worker engine: one small dataclass per concern."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from raytrain_loops.config.base import ConfigError, at_least, opt
from raytrain_loops.config.tracking import MlflowConfig

__all__ = [
    "Schedule",
    "OptimConfig",
    "PrecisionConfig",
    "AccumConfig",
    "LossConfig",
    "ClipConfig",
    "FreezeConfig",
    "EMAConfig",
    "NonFiniteConfig",
    "OOMConfig",
    "GradSyncConfig",
    "SpikeConfig",
    "LoggingConfig",
    "SmoothingConfig",
    "EngineConfig",
    "ThroughputConfig",
    "ProfileConfig",
    "CompileConfig",
    "default_schedules",
]


@dataclass(kw_only=True, slots=True)
class Schedule:
    """A value as a pure function of the global step (``per: step``) or of the epoch (``per:
    epoch``). A bare number in YAML means a constant."""

    kind: Literal["constant", "cosine", "linear", "poly", "step"] = opt("constant", "Shape after warm-up.")
    per: Literal["step", "epoch"] = opt(
        "step",
        "step: a function of the optimizer step and the run's steps; epoch: of the epoch and the run's epochs, "
        "constant within an epoch (warmup_steps and milestones then count epochs).",
    )
    value: float = opt(0.0, "Value at the end of warm-up (the peak for cosine/linear/poly, the start for step).")
    end: float = opt(0.0, "Value at the last step (epoch with per=epoch) for cosine, linear and poly.")
    power: float = opt(0.9, "Exponent of kind=poly: end + (value - end) * (1 - progress) ** power.")
    warmup_steps: int = opt(
        0, "Linear warm-up from warmup_start to value over this many steps (epochs with per=epoch)."
    )
    warmup_start: float = opt(0.0, "Value at step 0 (epoch 0 with per=epoch) when warmup_steps > 0.")
    milestones: list[int] = opt([], "Steps (epochs with per=epoch) at which kind=step multiplies the value by gamma.")
    gamma: float = opt(0.1, "Factor applied at each milestone for kind=step.")
    convention: Literal["engine", "dino", "cvnets", "seamseg", "hf", "fairseq"] = opt(
        "engine",
        "Whose indexing of warm-up and decay (per=step only). engine: warm-up t/W, then decay reaching end at "
        "the last step. dino, cvnets, hf, fairseq (kind=cosine) and seamseg (kind=poly): the value at every "
        "update of DINO's cosine_scheduler, ml-cvnets' CosineScheduler, Hugging Face's "
        "get_cosine_schedule_with_warmup, fairseq's cosine, seamseg's poly under BurnInLR (docs/seeds.md).",
    )

    def __post_init__(self) -> None:
        at_least(self, 0, "warmup_steps")
        _check_convention(self)
        unit = "epochs" if self.per == "epoch" else "steps"
        if self.kind == "step" and sorted(self.milestones) != list(self.milestones):
            raise ConfigError("milestones", f"must be increasing; got {self.milestones}")
        if any(m <= 0 for m in self.milestones):
            raise ConfigError("milestones", f"must be positive {unit}; got {self.milestones}")
        if not self.power > 0:  # at 0 poly is a constant, below 0 it grows
            raise ConfigError("power", f"must be > 0; got {self.power}")

    @classmethod
    def from_scalar(cls, value: float) -> Schedule:
        return cls(value=value)


_CONVENTION_KIND = {"dino": "cosine", "cvnets": "cosine", "hf": "cosine", "fairseq": "cosine", "seamseg": "poly"}


def _check_convention(s: Schedule) -> None:
    """A reference convention defines one shape, per optimizer step: refuse any other pairing."""
    if s.convention == "engine":
        return
    kind = _CONVENTION_KIND.get(s.convention)
    if kind is None:
        raise ConfigError("convention", f"must be engine, {', '.join(_CONVENTION_KIND)}; got {s.convention!r}")
    if s.kind != kind:
        raise ConfigError("convention", f"{s.convention} defines kind={kind} only; got kind={s.kind}")
    if s.per != "step":
        raise ConfigError("convention", f"{s.convention} is a function of the optimizer step: needs per=step")


def default_schedules() -> dict[str, Schedule]:
    """The reserved schedules; any other name is a named value handed to the criterion."""
    return {
        "lr": Schedule(value=1e-3),
        "weight_decay": Schedule(value=0.0),
        "ema_momentum": Schedule(value=0.999),
    }


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """Optimizer and parameter groups. Learning rate and weight decay come from ``schedules``."""

    name: Literal["adamw", "adam", "sgd"] = opt("adamw", "Optimizer.")
    betas: list[float] = opt([0.9, 0.999], "Adam(W) betas.")
    eps: float = opt(1e-8, "Adam(W) epsilon.")
    momentum: float = opt(0.9, "SGD momentum.")
    nesterov: bool = opt(False, "SGD Nesterov momentum (seamseg); needs name=sgd and momentum > 0.")
    param_groups: Literal["decay_split", "single", "task"] = opt(
        "decay_split",
        "decay_split: weights first, then biases and norm parameters (1-D tensors); "
        "single: one group; task: the task's param_groups(model).",
    )
    weight_decay_groups: Literal["first", "all"] = opt(
        "first", "Which groups get schedules.weight_decay: the first (DINO; no decay on biases/norms) or all."
    )

    def __post_init__(self) -> None:
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError("betas", f"must be two numbers in [0, 1); got {self.betas}")
        if self.eps <= 0:
            raise ConfigError("eps", f"must be > 0; got {self.eps}")
        if self.nesterov and (self.name != "sgd" or self.momentum <= 0):
            got = f"name={self.name}" if self.name != "sgd" else f"momentum={self.momentum}"
            raise ConfigError("nesterov", f"is SGD's Nesterov momentum: needs name=sgd and momentum > 0; got {got}")


@dataclass(kw_only=True, slots=True)
class PrecisionConfig:
    """Autocast dtype and fp16 dynamic loss scaling."""

    dtype: Literal["fp32", "bf16", "fp16", "auto"] = opt(
        "fp32",
        "Autocast dtype for forward passes. auto: resolved on the workers' device at the run's first start "
        "(bf16 on a GPU or CPU that computes it natively, fp16 with the loss scaler on an older GPU, fp32 on "
        "other CPUs) and kept for the rest of the run.",
    )
    init_scale: float = opt(2.0**16, "fp16: initial loss scale.")
    growth_interval: int = opt(2000, "fp16: steps without overflow before the scale doubles.")
    min_scale: float = opt(1e-4, "fp16: a loss scale below this stops training with an error.")

    def __post_init__(self) -> None:
        if self.init_scale <= 0:
            raise ConfigError("init_scale", f"must be > 0; got {self.init_scale}")
        at_least(self, 1, "growth_interval")
        if self.min_scale <= 0:
            raise ConfigError("min_scale", f"must be > 0; got {self.min_scale}")


@dataclass(kw_only=True, slots=True)
class AccumConfig:
    """Gradient accumulation: micro-batches per optimizer update."""

    steps: int = opt(1, "Micro-batches per optimizer update on each worker.")
    start_epoch: int = opt(
        0,
        "Accumulate only from this epoch on (epochs count from 0); before it one micro-batch per update. "
        "cvnets' accum_after_epoch=A accumulates in epochs after A: start_epoch=A+1.",
    )
    reduce: Literal["mean", "sum"] = opt(
        "mean",
        "How an update's micro-batches combine under loss.reduction=mean. mean: the gradient of their mean loss "
        "(the update does not depend on accum.steps); sum (cvnets): the sum of each micro-batch's mean-loss "
        "gradient, accum.steps times the mean's (the same sum of accum.steps micro-batches' worth when an "
        "elastic group runs more, smaller ones). Equal before accum.start_epoch; loss.reduction=sum takes mean.",
    )
    micro_batch: Literal["fixed", "auto"] = opt(
        "fixed",
        "fixed: every micro-batch is data.batch_size rows (an out-of-memory error goes to oom.policy). auto: "
        "data.batch_size is the largest micro-batch tried; an out-of-memory error on any worker halves every "
        "worker's micro-batch (each batch split in two) and doubles its micro-batches per update, and the same "
        "update is tried again on the same rows: the global batch and the update are unchanged. The size is kept "
        "for the rest of the run (checkpoints record it; a restarted group starts from it). Under "
        "loss.reduction=mean a batch is only split into equal halves. Before any worker starts, the run's first "
        "training batch is split in two (Task.split_batch): a task whose batches cannot be split along their rows "
        "(a value no row holds, such as a batch's token count, without a split_batch of the task's own) is refused.",
    )

    def __post_init__(self) -> None:
        at_least(self, 1, "steps")
        at_least(self, 0, "start_epoch")


@dataclass(kw_only=True, slots=True)
class LossConfig:
    """How micro-batch losses combine into one update."""

    reduction: Literal["mean", "sum"] = opt(
        "mean",
        "mean: the loss is a per-micro-batch mean, averaged over micro-batches and workers; "
        "sum (fairseq): the loss is a sum over units and gradients are divided by the total sample_size.",
    )


@dataclass(kw_only=True, slots=True)
class ClipConfig:
    """Gradient clipping, applied after unscaling and normalisation."""

    mode: Literal["none", "global", "per_param"] = opt(
        "none", "global: total-norm clipping; per_param: each tensor (DINO)."
    )
    max_norm: float = opt(1.0, "Largest allowed norm.")

    def __post_init__(self) -> None:
        if self.max_norm <= 0:
            raise ConfigError("max_norm", f"must be > 0; got {self.max_norm}")


@dataclass(kw_only=True, slots=True)
class FreezeConfig:
    """Cancel the gradients of the last layer during the first epochs (DINO)."""

    last_layer_epochs: int = opt(0, "Number of initial epochs during which matching parameters get no update.")
    last_layer_pattern: str = opt("last_layer", "Regular expression matched against parameter names.")

    def __post_init__(self) -> None:
        import re

        at_least(self, 0, "last_layer_epochs")
        try:
            re.compile(self.last_layer_pattern)
        except re.error as err:
            raise ConfigError("last_layer_pattern", f"is not a regular expression: {err}") from None


@dataclass(kw_only=True, slots=True)
class EMAConfig:
    """Exponential moving average of the weights (model EMA, or a DINO momentum teacher)."""

    # A key that was replaced: reading it raises a ConfigError naming its replacement.
    RETIRED: ClassVar[dict[str, str]] = {
        "copy_buffers": "was replaced by ema.buffers: copy_buffers=true is ema.buffers=copy, "
        "copy_buffers=false is ema.buffers=keep (ema.buffers=average also averages them, as cvnets)",
    }

    enabled: bool = opt(False, "Keep an EMA copy; its momentum is schedules.ema_momentum.")
    buffers: Literal["average", "copy", "keep"] = opt(
        "copy",
        "The model's buffers (BatchNorm running statistics) in the EMA. average: the same moving average as the "
        "parameters (cvnets), integer buffers (num_batches_tracked) copied, as they cannot be averaged; copy: "
        "the model's, copied at each EMA update; keep: the EMA's own, never touched by the update (DINO's "
        "teacher, which normalises with its own batch statistics).",
    )
    every: int = opt(1, "Update the EMA every this many optimizer steps.")
    arithmetic: Literal["lerp", "weighted_sum"] = opt(
        "lerp",
        "How ema = m * ema + (1 - m) * model is computed (m: schedules.ema_momentum). lerp: torch._foreach_lerp_, "
        "one pass over the weights; weighted_sum: ema * m + (1 - m) * model, each product rounded, then their sum, "
        "as DINO and cvnets write it (the same bits as theirs, which lerp differs from in the last bit; the dino "
        "and cvnets_cls recipes choose it).",
    )

    def __post_init__(self) -> None:
        at_least(self, 1, "every")


@dataclass(kw_only=True, slots=True)
class NonFiniteConfig:
    """What to do when a loss or gradient is NaN or infinite (the same decision on every worker)."""

    policy: Literal["skip", "stop"] = opt(
        "stop", "skip: drop the update and go on; stop: raise an error naming the first non-finite module."
    )
    max_consecutive: int = opt(5, "skip: this many skipped updates in a row stop the run.")

    def __post_init__(self) -> None:
        at_least(self, 1, "max_consecutive")


@dataclass(kw_only=True, slots=True)
class OOMConfig:
    """What to do on out-of-memory in forward or backward (the same decision on every worker)."""

    policy: Literal["skip", "raise"] = opt(
        "skip", "skip: drop the update on every worker and count it; raise: fail at once."
    )
    max_consecutive: int = opt(3, "skip: this many skipped updates in a row stop the run.")

    def __post_init__(self) -> None:
        at_least(self, 1, "max_consecutive")


@dataclass(kw_only=True, slots=True)
class GradSyncConfig:
    """Check that every worker holds the same gradients after DDP's all-reduce (fairseq)."""

    check: bool = opt(
        True,
        "Compare the workers' gradient norms every step (carried by the step's one all-reduce) and raise "
        "GradSyncError naming the workers when they differ; off for models whose parameters DDP does not sync.",
    )
    rtol: float = opt(1e-6, "Largest allowed difference between workers' gradient norms, relative to the largest.")

    def __post_init__(self) -> None:
        at_least(self, 0, "rtol")


@dataclass(kw_only=True, slots=True)
class SpikeConfig:
    """Stop the run when the loss jumps: an update that diverged is not worth retrying."""

    factor: float = opt(0.0, "Stop when a step's loss exceeds factor x the mean of the previous window; 0: off.")
    window: int = opt(50, "Steps in the running mean the loss is compared with.")
    min_steps: int = opt(20, "Steps of history needed before a spike can be called (at most window).")

    def __post_init__(self) -> None:
        if self.factor != 0 and self.factor <= 1:
            raise ConfigError("factor", f"must be 0 (off) or > 1; got {self.factor}")
        at_least(self, 1, "window", "min_steps")
        if self.factor and self.min_steps > self.window:
            # The history holds at most ``window`` losses, so it would never reach min_steps.
            raise ConfigError(
                "min_steps",
                f"must be <= window={self.window} (the history holds at most window losses, so no spike "
                f"could ever be called); got {self.min_steps}",
            )


@dataclass(kw_only=True, slots=True)
class SmoothingConfig:
    """How the progress line smooths the interval metrics (TensorBoard and the reports keep the
    interval means, ``metrics.jsonl`` each step's values)."""

    kind: Literal["momentum", "median"] = opt(
        "momentum",
        "momentum: sum(m^i * v[t-i]) / sum(m^i) over the steps so far, each step taking its interval's mean "
        "(seamseg); median: of the intervals covering the last `window` steps (DETR).",
    )
    momentum: float = opt(0.9, "m (per step) for kind=momentum, in [0, 1); 0 shows the latest interval as is.")
    window: int = opt(20, "Steps in the median's window for kind=median; at most one interval shows it as is.")

    def __post_init__(self) -> None:
        at_least(self, 1, "window")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError("momentum", f"must be in [0, 1); got {self.momentum}")


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    """Metric cadence, and the smoothing of the progress line."""

    every_steps: int = opt(10, "Aggregate metrics across workers (one collective) every this many steps.")
    system_series: bool = opt(
        False,
        "Also log the throughput, memory and step-time figures and each worker's own (<name>/rank<r>) as "
        "TensorBoard and MLflow series (the progress line shows them either way).",
    )
    smoothing: SmoothingConfig = opt(SmoothingConfig(), "Smoothing of the values the progress line shows.")
    verbose: bool = opt(
        False,
        "Print Ray's own output (its INFO lines, warnings, every report) on the console instead of in <run>/ray.log.",
    )
    # Their classes come at the end of this module, hence the factories.
    throughput: ThroughputConfig = field(
        default_factory=lambda: ThroughputConfig(),
        metadata={"help": "Samples/s, FLOPs, MFU and peak memory per logging interval."},
    )
    profile: ProfileConfig = field(
        default_factory=lambda: ProfileConfig(), metadata={"help": "A torch.profiler trace of a few steps."}
    )
    mlflow: MlflowConfig = opt(MlflowConfig(), "MLflow tracking (off unless tracking_uri is set).")

    def __post_init__(self) -> None:
        at_least(self, 1, "every_steps")


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """The sections :class:`raytrain_loops.engine.Engine` reads, and nothing else: the step does
    not see the data, the loop's cadence, the workers or the run's storage. ``Config.engine``
    gives this view of a whole run config (the same section objects); the keys and their help
    are those of the run config's sections."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    schedules: dict[str, Schedule] = field(default_factory=default_schedules)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    accum: AccumConfig = field(default_factory=AccumConfig)  # accum.reduce, and the update's micro-batches
    clip: ClipConfig = field(default_factory=ClipConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    nonfinite: NonFiniteConfig = field(default_factory=NonFiniteConfig)
    oom: OOMConfig = field(default_factory=OOMConfig)
    grad_sync: GradSyncConfig = field(default_factory=GradSyncConfig)


@dataclass(kw_only=True, slots=True)
class ThroughputConfig:
    """Throughput, FLOPs, MFU and peak memory in the interval metrics (``logging.throughput``)."""

    enabled: bool = opt(True, "Measure FLOPs per sample on the first step and report throughput every interval.")
    peak_tflops: float = opt(
        0.0,
        "The device's peak TFLOP/s for MFU; 0: from the table of GPU bf16/fp16 dense peaks (no MFU on a CPU "
        "or an unknown GPU).",
    )

    def __post_init__(self) -> None:
        at_least(self, 0, "peak_tflops")


@dataclass(kw_only=True, slots=True)
class ProfileConfig:
    """A ``torch.profiler`` trace per worker in ``<run>/profile/`` (``logging.profile``)."""

    enabled: bool = opt(False, "Record a trace of `steps` steps from step `start_step` on.")
    start_step: int = opt(10, "The update count at which recording starts (the step before it warms up).")
    steps: int = opt(3, "How many calls of the step to record.")

    def __post_init__(self) -> None:
        at_least(self, 0, "start_step")
        at_least(self, 1, "steps")


@dataclass(kw_only=True, slots=True)
class CompileConfig:
    """``torch.compile``, the one switch for it: each block the task names (``Task.blocks``; one
    block's graph serves them all) or the whole model, in place: parameter names and checkpoints
    stay those of the plain model."""

    enabled: bool = opt(False, "Compile the model, as compile.scope says.")
    scope: Literal["blocks", "model"] = opt(
        "blocks",
        "blocks: each of the task's blocks (regional, one graph for them all); model: the whole model in one graph.",
    )
    backend: str = opt("inductor", "torch.compile backend (eager: the graphs captured, not compiled).")
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = opt(
        "default", "torch.compile mode."
    )
    dynamic: bool | None = opt(
        None, "torch.compile dynamic: true for shapes that change (packed LM batches); null: automatic."
    )
