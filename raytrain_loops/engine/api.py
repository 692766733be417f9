"""What tasks program against: :class:`LossOutput`, what a criterion returns; :class:`StepContext`,
what it may read; ``LossFn``, its signature; and :class:`StepResult`, the outcome of one update
(the loop's callbacks get it). ``raytrain_loops.engine`` exports them all."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from raytrain_loops.engine.update.decision import Decision
from raytrain_loops.errors import TaskReturnError

__all__ = [
    "LossFn",
    "LossOutput",
    "StepContext",
    "StepResult",
    "TaskReturnError",
    "checked_criterion",
    "checked_evaluate",
]


@dataclass
class LossOutput:
    """What a criterion returns for one micro-batch.

    ``loss``: a mean over the micro-batch (``loss.reduction=mean``) or a sum over its units
    (``sum``). ``sample_size``: the number of units (samples or tokens); in ``sum`` mode gradients
    are divided by its total, in both modes it weights the logged values. ``logs``: named values
    (means over the micro-batch) to log, or ``(value, weight)`` pairs that carry their own weight
    (bits per byte, weighted by the bytes: the interval's value is then the ratio of the sums).

    Instead of ``loss``, a criterion may give named ``terms`` and their ``weights`` (DETR's loss
    dict and weight dict): the loss is then ``sum(weights[k] * terms[k])``, and each term is
    logged weighted under its name and as is under ``<name>_unscaled``. ``stats``: tensors summed
    over this update's micro-batches and all workers inside the step's all-reduce, handed to the
    engine's ``after_step`` hook when the update is applied (DINO's centre).
    """

    loss: torch.Tensor | None = None
    sample_size: int | float | torch.Tensor = 1
    logs: dict[str, torch.Tensor | float | tuple[torch.Tensor | float, torch.Tensor | float]] = field(
        default_factory=dict
    )
    terms: dict[str, torch.Tensor] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    stats: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.terms:
            if self.loss is None:
                raise ValueError("a LossOutput needs a loss, or loss terms and their weights")
            return
        if self.loss is not None:
            raise ValueError("a LossOutput takes a loss or weighted terms, not both: the terms make the loss")
        missing = sorted(set(self.terms) - set(self.weights))
        if missing:
            raise ValueError(f"loss terms {missing} have no weight; the weights name {sorted(self.weights)}")
        self.loss = sum(t * self.weights[k] for k, t in self.terms.items())

    def term_logs(self) -> dict[str, torch.Tensor]:
        """Each term weighted under its name and as is under ``<name>_unscaled`` (detached)."""
        out = {}
        for k, t in self.terms.items():
            t = t.detach()
            out[k] = t * self.weights[k]
            out[f"{k}_unscaled"] = t
        return out


@dataclass
class StepContext:
    """What a criterion may read: counters, this step's schedule values, the EMA/teacher model,
    and ``totals``: the counts the task declared (``Engine(counts=...)``), summed over this
    update's micro-batches on all workers before any forward pass. ``slots`` is the number of
    micro-batch places the update averages over (workers x micro-batches, ``None`` ones
    included). ``measuring`` is true when the criterion runs outside training, on copies of the
    models (the throughput callback's one FLOP count): a criterion with effects outside the model
    (files, counters of its own) skips them then."""

    step: int
    epoch: int
    values: dict[str, float]
    ema: nn.Module | None
    micro_index: int = 0
    totals: dict[str, float] = field(default_factory=dict)
    slots: int = 1
    measuring: bool = False

    def per_slot(self, name: str) -> float:
        """``totals[name]`` over ``slots``: with ``loss.reduction=mean``, a micro-batch's sum
        divided by it becomes, after the engine's and DDP's averaging, the sum over the whole
        update divided by the global count (DETR's ``num_boxes``)."""
        if name not in self.totals:
            raise KeyError(
                f"ctx.totals has no {name!r} (it has {sorted(self.totals)}): declare it in the task's count_keys"
            )
        return self.totals[name] / self.slots


LossFn = Callable[[nn.Module, Any, StepContext], LossOutput]


def _where(fn: Callable, name: str) -> str:
    """``name`` and where its code is, ``MyTask.criterion (mytask.py:31)``, for a user to find it."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return f"{name} ({inspect.getsourcefile(code) or code.co_filename}:{code.co_firstlineno})" if code else name


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):  # its values may be on a copy (the FLOP count's, on meta)
        return f"a Tensor of shape {tuple(value.shape)} ({str(value.dtype).removeprefix('torch.')})"
    text = repr(value)
    return f"a {type(value).__name__} ({text[:80]}{'...' if len(text) > 80 else ''})"


def _first_checked(fn: Callable, problem: Callable[[Any], str | None], where: str) -> Callable:
    """``fn`` whose first return is checked: ``problem(out)`` says what is wrong, and a
    :class:`TaskReturnError` names ``where`` with it. Later calls run ``fn`` as is."""
    checked = False

    def call(*args, **kwargs):
        nonlocal checked
        out = fn(*args, **kwargs)
        if not checked:
            wrong = problem(out)
            if wrong:
                raise TaskReturnError(f"{where} returned {wrong}")
            checked = True
        return out

    return call


def checked_criterion(fn: LossFn, name: str) -> LossFn:
    """The task's criterion ``fn`` (``name``: ``MyTask.criterion``), its first return checked to
    be a :class:`LossOutput`: anything else stops the run there, naming the criterion, what it
    returned and what it must return."""

    def problem(out: Any) -> str | None:
        if isinstance(out, LossOutput):
            return None
        return (
            f"{_shown(out)}; a criterion must return raytrain_loops.LossOutput(loss=..., sample_size=...), "
            "e.g. LossOutput(loss=loss, sample_size=len(targets)) (loss: the micro-batch's mean under "
            "loss.reduction=mean, its sum under sum; sample_size: the samples or tokens it covers)"
        )

    return _first_checked(fn, problem, _where(fn, name))


def checked_evaluate(fn: Callable, name: str) -> Callable:
    """The task's ``evaluate`` ``fn``, its first return checked to be a mapping of metric name to
    ``(value, count)``."""

    def problem(out: Any) -> str | None:
        must = "; evaluate must return a mapping of metric name to (value, count), e.g. {'accuracy': (correct / n, n)}"
        if not isinstance(out, Mapping):
            return _shown(out) + must
        for key, pair in out.items():
            if not isinstance(key, str) or not isinstance(pair, tuple | list) or len(pair) != 2:
                return f"{_shown(dict(out))}, whose {key!r} is {_shown(pair)}, not a (value, count) pair{must}"
        return None

    return _first_checked(fn, problem, _where(fn, name))


@dataclass
class StepResult:
    """The outcome of one call to :meth:`Engine.train_step`, identical on every worker."""

    decision: Decision
    loss: float
    sample_size: float
    grad_norm: float
    lr: float
    compute_time: float
    data_time: float = 0.0  # waiting for this step's batches, before the call
    # This worker's own units (a device tensor when the criterion returns one: no host sync).
    local_sample_size: torch.Tensor | float = 0.0

    @property
    def applied(self) -> bool:
        return self.decision is Decision.APPLY

    @property
    def skipped(self) -> str | None:
        """Why the update was skipped (``oom``, ``empty``, ``overflow``, ``nonfinite``), or None."""
        return None if self.applied else self.decision.value
