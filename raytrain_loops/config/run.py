"""The run config: every section composed, loadable from a recipe YAML with dotted overrides."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from raytrain_loops.config.base import ConfigError, apply_overrides, at_least, from_dict, opt, read_yaml, to_dict
from raytrain_loops.config.data import DataConfig, PreprocessConfig
from raytrain_loops.config.engine import (
    AccumConfig,
    ClipConfig,
    CompileConfig,
    EMAConfig,
    EngineConfig,
    FreezeConfig,
    GradSyncConfig,
    LoggingConfig,
    LossConfig,
    NonFiniteConfig,
    OOMConfig,
    OptimConfig,
    PrecisionConfig,
    Schedule,
    SpikeConfig,
    default_schedules,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EvalConfig",
    "LoopConfig",
    "PreprocessConfig",
    "RunConfig",
    "ScalingConfig",
    "TaskConfig",
    "load_config",
]


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """What is trained: a built-in task name or ``package.module:factory``, and its parameters."""

    name: str = opt(
        "digits", "Built-in task name, or 'package.module:X': a Task subclass or a function annotated '-> Task'."
    )
    params: dict[str, Any] = opt({}, "Keyword arguments for the task.")


@dataclass(kw_only=True, slots=True)
class LoopConfig:
    """Length of training. Counted in optimizer steps; epochs are derived from the data."""

    max_steps: int = opt(0, "Optimizer steps to run; 0 means epochs x steps per epoch.")
    epochs: int = opt(1, "Passes over the training data when max_steps is 0.")
    seed: int = opt(0, "Seed for initialisation, data order and dropout (each worker offsets it by its rank).")

    def __post_init__(self) -> None:
        at_least(self, 0, "max_steps")
        at_least(self, 1, "epochs")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Evaluation cadence."""

    every_steps: int = opt(0, "Evaluate every this many steps; 0: at the end of every epoch. Always at the end.")
    ema: bool = opt(True, "Also evaluate the EMA weights (metrics prefixed ema_) when ema.enabled.")
    bn_buffers: Literal["broadcast", "average"] = opt(
        "broadcast",
        "Before every evaluation the workers' buffers (BatchNorm statistics), the model's and the EMA's, are made "
        "the same: rank 0's (broadcast, what a checkpoint saves), or average: the mean of the running statistics "
        "over workers (timm's distribute_bn), a deviation from the seeds that changes the trajectory.",
    )

    def __post_init__(self) -> None:
        at_least(self, 0, "every_steps")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Checkpoint cadence and retention."""

    every_steps: int = opt(0, "Checkpoint every this many steps; 0: at the end of every epoch. Always at the end.")
    keep: int = opt(2, "The newest checkpoints kept (and as many best ones with score_metric); 0: all.")
    score_metric: str = opt(
        "", "Also keep the best `keep` checkpoints by this reported metric, in best/ (best.json ranks them)."
    )
    score_mode: Literal["max", "min"] = opt("max", "Whether a higher or lower score_metric is better.")

    def __post_init__(self) -> None:
        at_least(self, 0, "every_steps")
        at_least(self, 0, "keep")
        if self.keep == 1:
            raise ConfigError(
                "keep",
                "must be 0 (keep all) or >= 2: when the newest checkpoint is found damaged, the one before it is "
                "where the run resumes",
            )


@dataclass(kw_only=True, slots=True)
class ScalingConfig:
    """Workers and their resources."""

    num_workers: int = opt(
        2,
        "Training workers (one DDP process each); the most, when elastic. 0: local mode, the loop in the calling "
        "process without Ray (one worker's batches; `train --local`).",
    )
    min_workers: int = opt(
        0,
        "Elastic when 1 <= min_workers < num_workers: the run goes on with as few as min_workers as nodes go "
        "and grows back as they return, with more micro-batches per update so the global batch stays the same.",
    )
    resize_interval_s: float = opt(60.0, "Elastic: seconds between checks for room to grow the group.")
    use_gpu: bool = opt(False, "One GPU per worker, NCCL; otherwise CPU workers with gloo.")
    cpus_per_worker: float = opt(1.0, "CPUs reserved per worker; what is left is for preprocessing.")
    threads_per_worker: int = opt(0, "torch threads per worker; 0: the worker's CPUs (at least 1).")
    object_store_gb: float = opt(
        0.0,
        "Object store of the local Ray instance a run starts, in GB; 0: Ray's default. Not used when joining a cluster.",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = opt(
        "PACK", "How workers are placed on nodes (Ray placement-group strategy); STRICT_SPREAD: one per node."
    )
    strategy: Literal["ddp", "fsdp"] = opt(
        "ddp",
        "ddp: every worker holds the whole model, gradients all-reduced; fsdp: FSDP2 fully_shard on the task's "
        "blocks (Task.blocks) and then the root, parameters, gradients and optimizer state sharded over the workers "
        "(checkpoints through torch.distributed.checkpoint).",
    )
    reshard_after_forward: bool = opt(
        True, "fsdp: free the gathered parameters after each block's forward (gathered again for backward)."
    )

    def __post_init__(self) -> None:
        at_least(self, 0, "num_workers")
        if self.num_workers == 0 and self.min_workers:
            raise ConfigError("min_workers", f"local mode (num_workers=0) has no elastic group; got {self.min_workers}")
        if self.min_workers > self.num_workers:
            raise ConfigError("min_workers", f"must be <= num_workers={self.num_workers}; got {self.min_workers}")
        if self.resize_interval_s <= 0:
            raise ConfigError("resize_interval_s", f"must be > 0; got {self.resize_interval_s}")
        at_least(self, 0, "cpus_per_worker")
        at_least(self, 0, "threads_per_worker", "object_store_gb")

    @property
    def local(self) -> bool:
        """Local mode: the loop in the calling process, without Ray."""
        return self.num_workers == 0

    @property
    def workers(self) -> int:
        """The training processes the run's length is planned for: one in local mode."""
        return max(1, self.num_workers)


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """Where results go and how the run talks to Ray."""

    name: str = opt("", "Run name; empty: derived from the task and a hash of the config (deterministic).")
    storage_path: str = opt("./runs", "A local directory or a URI pyarrow understands (s3://, gs://).")
    max_failures: int = opt(0, "Worker-group restarts Ray may make after failures.")
    max_preemptions: int = opt(
        -1,
        "Worker-group restarts Ray may make after preemptions (a node drained with notice), counted apart "
        "from max_failures; -1: unlimited (Ray's default).",
    )
    report_every_steps: int = opt(50, "Report metrics to Ray every this many steps (a report costs up to ~2 s).")
    coalesce_reports: bool = opt(
        True,
        "Skip a periodic report to Ray (metrics, an evaluation, a checkpoint) while its controller has not yet taken "
        "the one before (it takes one per poll, every 0.5 s on a local Ray): a cadence faster than that neither "
        "slows the run nor queues checkpoints an interruption would lose. Never the final report, nor a "
        "preemption's checkpoint; false: every report the cadences ask for.",
    )
    progress: bool = opt(True, "Print a progress line from rank 0 every logging.every_steps steps.")
    allow_config_change: bool = opt(
        False,
        "Resume a run directory whose config.yaml differs in more than scaling, run, logging, compile, checkpointing, accum.micro_batch and the run's "
        "length, or whose task's model differs from model.json (its checkpoints hold the state of the old config or model); "
        "refused when false.",
    )

    def __post_init__(self) -> None:
        import re

        if self.name and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", self.name):
            raise ConfigError("name", f"must be letters, digits, '_', '.', '-'; got {self.name!r}")
        if self.max_failures < -1:
            raise ConfigError("max_failures", f"must be >= -1 (-1: unlimited); got {self.max_failures}")
        if self.max_preemptions < -1:
            raise ConfigError("max_preemptions", f"must be >= -1 (-1: unlimited); got {self.max_preemptions}")
        at_least(self, 1, "report_every_steps")


FAULT_KINDS = ("raise", "kill", "nan", "spike", "oom")


@dataclass(kw_only=True, slots=True)
class FaultSpec:
    """One fault of ``fault.plan``."""

    step: int = field(
        metadata={"help": "The step after which (raise, kill), at which (nan, spike) or from which on (oom) it fires."}
    )
    rank: int = opt(0, "The worker it fires on.")
    kind: str = opt("raise", "raise, kill, nan, spike or oom.")
    micro_batch: int = opt(
        0, "oom: the largest micro-batch (rows) that fits; a forward over more raises an out-of-memory error."
    )

    def __post_init__(self) -> None:
        if self.step < 1:
            raise ConfigError("step", f"must be a step >= 1; got {self.step}")
        if self.rank < 0:
            raise ConfigError("rank", f"must be a worker rank >= 0; got {self.rank}")
        if self.kind not in FAULT_KINDS:
            raise ConfigError("kind", f"must be one of {', '.join(FAULT_KINDS)}; got {self.kind!r}")
        if self.micro_batch < 0 or (self.micro_batch and self.kind != "oom"):
            raise ConfigError("micro_batch", f"a size >= 0 for kind oom only; got {self.micro_batch} for {self.kind}")


@dataclass(kw_only=True, slots=True)
class FaultConfig:
    """Faults injected on purpose, to test recovery. Each fires once: on the first attempt of the
    run that reaches its step (a marker in the run directory records that it fired)."""

    plan: list[FaultSpec] = opt(
        [],
        "Each {step: N, rank: R, kind: K}: raise (an exception in worker R after step N), kill (SIGKILL of "
        "worker R after step N), nan or spike (worker R's loss at step N is NaN, or 1000x), oom (from step N on, "
        "worker R runs out of memory in the forward of every micro-batch of more than micro_batch rows).",
    )


@dataclass(kw_only=True, slots=True)
class Config:
    """Everything a run needs. Sections are addressed by dotted keys: ``precision.dtype=bf16``."""

    task: TaskConfig = opt(TaskConfig(), "The task: model, criterion and data.")
    loop: LoopConfig = opt(LoopConfig(), "Length of training.")
    optim: OptimConfig = opt(OptimConfig(), "Optimizer and parameter groups.")
    schedules: dict[str, Schedule] = opt(
        default_schedules(),
        "Values as functions of the step (or epoch): lr, weight_decay, ema_momentum, and any named value for the criterion.",
    )
    precision: PrecisionConfig = opt(PrecisionConfig(), "Autocast and loss scaling.")
    accum: AccumConfig = opt(AccumConfig(), "Gradient accumulation.")
    loss: LossConfig = opt(LossConfig(), "Loss reduction across micro-batches and workers.")
    clip: ClipConfig = opt(ClipConfig(), "Gradient clipping.")
    freeze: FreezeConfig = opt(FreezeConfig(), "Last-layer freezing.")
    ema: EMAConfig = opt(EMAConfig(), "Weight EMA / momentum teacher.")
    nonfinite: NonFiniteConfig = opt(NonFiniteConfig(), "Non-finite loss or gradient policy.")
    oom: OOMConfig = opt(OOMConfig(), "Out-of-memory policy.")
    grad_sync: GradSyncConfig = opt(GradSyncConfig(), "Check that workers hold the same gradients.")
    spike: SpikeConfig = opt(SpikeConfig(), "Stop on a loss spike.")
    logging: LoggingConfig = opt(LoggingConfig(), "Metric cadence.")
    data: DataConfig = opt(DataConfig(), "Batching and ingestion.")
    eval: EvalConfig = opt(EvalConfig(), "Evaluation cadence.")
    checkpoint: CheckpointConfig = opt(CheckpointConfig(), "Checkpoint cadence and retention.")
    scaling: ScalingConfig = opt(ScalingConfig(), "Workers and resources.")
    run: RunConfig = opt(RunConfig(), "Storage, name and Ray reporting.")
    fault: FaultConfig = opt(FaultConfig(), "Faults injected on purpose, to test recovery.")
    compile: CompileConfig = opt(CompileConfig(), "torch.compile of the task's blocks (regional) or of its whole model.")
    checkpointing: Literal["none", "full", "selective"] = opt(
        "none",
        "Activation checkpointing of each of the task's blocks: full recomputes a block's forward in backward; "
        "selective keeps the matmul and attention outputs and recomputes the rest.",
    )

    def __post_init__(self) -> None:
        if self.scaling.local and self.run.max_failures != 0:
            raise ConfigError(
                "run.max_failures",
                f"local mode (scaling.num_workers=0) restarts nothing, a failure raises in this process; got "
                f"{self.run.max_failures}, set 0",
            )
        if self.scaling.local:
            for i, f in enumerate(self.fault.plan):
                if f.kind == "kill" or f.rank > 0:
                    raise ConfigError(
                        f"fault.plan[{i}]",
                        f"local mode runs one worker in this process: no kill (it would kill the caller) and no rank "
                        f"above 0; got kind={f.kind}, rank={f.rank}",
                    )
        if self.accum.micro_batch == "auto":
            _check_micro_batch(self)
        if self.accum.reduce == "sum" and self.loss.reduction == "sum":
            raise ConfigError(
                "accum.reduce",
                "sum adds the micro-batches' mean-loss gradients (loss.reduction=mean); under loss.reduction=sum "
                "the gradients are already summed and divided by the total sample_size: set accum.reduce=mean",
            )
        for name in ("lr", "weight_decay", "ema_momentum"):
            if name not in self.schedules:
                raise ConfigError(f"schedules.{name}", "is required")
        lr = self.schedules["lr"]
        if lr.value < 0 or lr.end < 0:
            raise ConfigError("schedules.lr", f"learning rates must be >= 0; got value={lr.value}, end={lr.end}")
        m = self.schedules["ema_momentum"]
        for what, v in (("value", m.value), ("end", m.end if m.kind in ("cosine", "linear", "poly") else m.value)):
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"schedules.ema_momentum.{what}", f"must be in [0, 1]; got {v}")
        for name, sch in self.schedules.items():
            if sch.per == "epoch":
                _check_epoch_schedule(name, sch, self.loop)

    @property
    def engine(self) -> EngineConfig:
        """The sections the engine's step reads (the same objects, not copies)."""
        return EngineConfig(**{f.name: getattr(self, f.name) for f in fields(EngineConfig)})

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (YAML/JSON-safe) of the whole config."""
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Config:
        """Build and validate a config from a plain dict."""
        return from_dict(cls, data)


def _check_micro_batch(config: Config) -> None:
    """``accum.micro_batch=auto`` halves a batch where the halves make the same update."""
    size = config.data.batch_size
    if size < 2:
        raise ConfigError(
            "accum.micro_batch",
            "auto splits each batch along its rows, and data.batch_size=1 holds one row (a packed row of lm is "
            "the smallest unit): set data.batch_size >= 2 (and lower the rows per batch) or accum.micro_batch=fixed",
        )
    if config.loss.reduction == "mean" and size % 2:
        raise ConfigError(
            "accum.micro_batch",
            f"auto under loss.reduction=mean splits a batch into equal halves only (the mean of unequal halves' "
            f"means is another update), and data.batch_size={size} is odd: set an even data.batch_size (a power of "
            "two halves furthest), loss.reduction=sum, or accum.micro_batch=fixed",
        )


def _check_epoch_schedule(name: str, s: Schedule, loop: LoopConfig) -> None:
    """A per=epoch schedule counts its warm-up and milestones in epochs: one that reaches past the
    run's epochs was most likely written in steps. With ``loop.max_steps`` the run's epochs
    depend on the data, and are not checked here."""
    if loop.max_steps:
        return
    if s.warmup_steps and s.warmup_steps >= loop.epochs:
        raise ConfigError(
            f"schedules.{name}.warmup_steps",
            f"per=epoch counts epochs: must be < loop.epochs={loop.epochs}; got {s.warmup_steps}",
        )
    late = [m for m in s.milestones if m >= loop.epochs]
    if late:
        raise ConfigError(
            f"schedules.{name}.milestones",
            f"per=epoch counts epochs: {late} would never be reached in loop.epochs={loop.epochs}",
        )


def load_config(source: str | Path | dict[str, Any] | None = None, overrides: list[str] | None = None) -> Config:
    """Load a config from a YAML path or a dict, then apply dotted ``key=value`` overrides.

    Overrides are applied to the fully resolved config (defaults included), so they can address
    any key, and are validated with the same rules as the file.
    """
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, dict):
        data = source
    else:
        data = read_yaml(source)
    base = Config.from_dict(data)
    if not overrides:
        return base
    return Config.from_dict(apply_overrides(base.to_dict(), overrides))
