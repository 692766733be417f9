"""The step's decision: what every worker does with its gradients, as a pure function of the
values the step's one all-reduce gave all of them alike."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = ["Decision", "Reduced", "decide"]


class Decision(enum.Enum):
    """What a step does with its gradients; the value is the name logged for a skip."""

    APPLY = "applied"
    SKIP_OOM = "oom"  # out of memory on some worker
    SKIP_EMPTY = "empty"  # no worker had data
    SKIP_OVERFLOW = "overflow"  # fp16: non-finite at this loss scale
    SKIP_NONFINITE = "nonfinite"


@dataclass(frozen=True)
class Reduced:
    """The step's one all-reduce, read back on the host: identical on every worker.

    ``loss`` is the mean loss (per micro-batch in ``mean`` mode, per unit in ``sum`` mode; NaN
    when no worker had data), ``grad_norm`` the norm of the update's gradient, ``grad_factor``
    what the averaged gradients are multiplied by (``sum`` mode: ``world / sample_size``),
    ``weight`` what the loss is averaged over, ``norms`` each worker's own gradient norm (empty
    unless ``grad_sync.check``)."""

    sample_size: float
    terms: float
    ooms: float
    loss: float
    grad_norm: float
    grad_factor: float
    weight: float
    norms: tuple[float, ...] = ()

    @classmethod
    def from_sums(cls, sums: list[float], *, mean: bool, world: int, sharded: bool = False) -> Reduced:
        """From ``[sample_size, loss_sum, terms, ooms, grad_norm^2, per-worker norm^2...]`` summed
        over workers (DDP or FSDP having averaged the gradients). ``sharded``: each worker's
        ``grad_norm^2`` is that of its own shard, so their sum is the whole gradient's; under DDP
        every worker holds the whole gradient, and the sum is ``world`` times it."""
        sample_size, loss_sum, terms, ooms, norm_sq = sums[:5]
        # sum mode wants the gradients summed over workers and divided by the total sample size.
        factor = 1.0 if mean else (world / sample_size if sample_size > 0 else 0.0)
        grad_norm = math.sqrt(norm_sq / (1 if sharded else world)) * factor if math.isfinite(norm_sq) else math.inf
        weight = terms if mean else sample_size
        loss = loss_sum / weight if weight > 0 else math.nan
        norms = tuple(math.sqrt(v) for v in sums[5:])
        return cls(sample_size, terms, ooms, loss, grad_norm, factor, weight, norms)


def decide(reduced: Reduced, *, fp16: bool) -> Decision:
    """The step's decision, from values every worker holds alike: an OOM anywhere first, then no
    data anywhere (whose loss is NaN for want of data, not for a numerical fault), then a
    non-finite loss or gradient (an overflow under fp16 loss scaling)."""
    if reduced.ooms > 0:
        return Decision.SKIP_OOM
    if reduced.weight <= 0:
        return Decision.SKIP_EMPTY
    if not (math.isfinite(reduced.loss) and math.isfinite(reduced.grad_norm)):
        return Decision.SKIP_OVERFLOW if fp16 else Decision.SKIP_NONFINITE
    return Decision.APPLY
