"""How long a run is: batches per epoch, micro-batches per update, steps per epoch and in all.

Pure functions of the config and the row count, used by the driver (``fit`` and ``tune`` check
the run's length before Ray starts) and by the loop on every worker, so both count alike.
"""

from __future__ import annotations

from raytrain_loops.config.base import ConfigError
from raytrain_loops.config.engine import AccumConfig
from raytrain_loops.config.run import LoopConfig


def batches_per_epoch(rows: int, workers: int, batch_size: int, *, padded: bool = False) -> int:
    """One worker's training batches per epoch; the last partial batch is dropped.

    A Parquet split's plan deals its rows equally over the workers and drops the remainder
    (``padded=False``); a ``DistributedSampler`` (map-style splits) pads every worker up to
    ``ceil(rows / workers)`` rows (``padded=True``).
    """
    per_worker = -(-rows // workers) if padded else rows // workers
    return per_worker // batch_size


def accum_steps(accum: AccumConfig, epoch: int, scale: float = 1.0) -> int:
    """Micro-batches per update in ``epoch``: 1 before ``accum.start_epoch`` (cvnets), then
    ``accum.steps``; times ``scale`` (full group size / current size) when an elastic group
    runs short of workers, so the global batch stays the same (to the nearest micro-batch)."""
    return max(1, round((accum.steps if epoch >= accum.start_epoch else 1) * scale))


def steps_in_epoch(accum: AccumConfig, batches: int, epoch: int, scale: float = 1.0) -> int:
    """Optimizer steps in ``epoch`` for ``batches`` batches per worker (leftover batches drop)."""
    return batches // accum_steps(accum, epoch, scale)


def total_steps(loop: LoopConfig, accum: AccumConfig, batches: int, scale: float = 1.0) -> int:
    """The run's length: ``loop.max_steps``, or the steps of ``loop.epochs`` epochs. Raises
    :class:`ConfigError` (``accum.steps``) when an epoch holds fewer batches than one update needs."""
    per_epoch = [steps_in_epoch(accum, batches, e, scale) for e in range(loop.epochs)]
    if 0 in per_epoch:
        raise ConfigError(
            "accum.steps",
            f"an epoch holds {batches} batches per worker, fewer than the {accum_steps(accum, per_epoch.index(0), scale)} "
            "micro-batches of one update: lower accum.steps, data.batch_size or scaling.num_workers",
        )
    return loop.max_steps or sum(per_epoch)


def epochs_in_run(loop: LoopConfig, accum: AccumConfig, batches: int, scale: float = 1.0) -> int:
    """The epochs the run spans, for ``per: epoch`` schedules: ``loop.epochs``, or with
    ``loop.max_steps`` the epochs up to the one holding the last update (inside it or past
    ``loop.epochs``)."""
    total = total_steps(loop, accum, batches, scale)
    epochs, done = 0, 0
    while done < total:
        steps = steps_in_epoch(accum, batches, epochs, scale)
        if steps == 0:  # past loop.epochs, where total_steps did not look
            raise ConfigError(
                "accum.steps",
                f"epoch {epochs} holds {batches} batches per worker, fewer than one update needs",
            )
        done, epochs = done + steps, epochs + 1
    return epochs
