"""The per-worker training loop, without Ray: epochs of steps until the run's length, evaluation,
reports and checkpoints on schedule, and once more at the end through the same path.

The loop talks to the outside through three small interfaces (see docs/architecture.md):

- a :class:`BatchSource`: this worker's batches of a split for an epoch, from a position;
- a :class:`Reporter`: metrics, and a checkpoint of the engine with its data position;
- :class:`Callback` objects, with no-op defaults, for what varies between runs: the run log and
  progress line, the loss-spike guard, injected faults. At each epoch's end they get the epoch's
  averages over all workers (``on_epoch``); every report carries the latest ones.

Every decision in the loop comes from values that are identical on every worker (the step's
all-reduced result, counters), so every worker makes the same calls to collectives, to the
reporter and to the callbacks, in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from raytrain_loops.config.engine import AccumConfig
from raytrain_loops.config.run import Config
from raytrain_loops.engine.api import StepResult
from raytrain_loops.engine.coalesce import Coalescing
from raytrain_loops.engine.devices import copied_ahead, to_device
from raytrain_loops.engine.distributed import collectives, sharding
from raytrain_loops.engine.length import accum_steps, steps_in_epoch
from raytrain_loops.engine.meters import Meters
from raytrain_loops.engine.update.precision import autocast
from raytrain_loops.engine.update.step import Engine
from raytrain_loops.streams import close as _close  # a split's stream, when its epoch or evaluation ends

__all__ = [
    "BatchSource",
    "Callback",
    "Loop",
    "LoopSettings",
    "Position",
    "Reporter",
    "accum_steps",
    "evaluate",
    "sync_buffers",
    "timed_groups",
]

EvaluateFn = Callable[..., dict[str, tuple[Any, float]]]
MetricsFn = Callable[[], dict[str, Any]]


@dataclass(frozen=True)
class Position:
    """Where this worker's data stands: the epoch, and how many of its batches were consumed."""

    epoch: int = 0
    batches: int = 0


class BatchSource(Protocol):
    """This worker's data. ``batches_per_epoch`` counts its training batches in one epoch;
    ``batches(split, epoch, start)`` yields the batches of ``split`` ("train" or "eval") for
    ``epoch``, leaving out the first ``start`` (a resumed run continues where it stopped). The
    source may keep the data positions a checkpoint records itself (``record``/``resume``, read
    by the reporter: an epoch re-cut for a group of another size); the loop never calls them."""

    batches_per_epoch: int
    has_eval: bool

    def batches(self, split: str, epoch: int, start: int = 0) -> Iterable[Any]: ...


class Reporter(Protocol):
    """Where the loop's results go. ``report`` is called on every worker at the same points;
    with ``checkpoint`` (the data position after this step) it also saves the engine's state.
    A reporter whose reports are taken one at a time may also have ``in_flight()`` (whether one
    of its reports is not taken yet: the loop then skips periodic ones,
    :mod:`raytrain_loops.engine.coalesce`) and ``skipped(last_sent, step, checkpoint=...)``, told of
    the first report skipped (whether it was to carry a checkpoint)."""

    def report(self, metrics: dict[str, float], checkpoint: Position | None) -> None: ...


class Callback:
    """Hooks the loop calls on every worker at the same points; each does nothing by default.

    A callback whose decisions depend on what it saw earlier (the spike guard's recent losses)
    returns that from :meth:`state_dict`; the loop saves it with the engine's state under
    ``callbacks[name]`` (``name``: the class name unless set) and gives it back to
    :meth:`load_state_dict` when a run resumes. Only rank 0's engine state is saved, so that
    state must be the same on every worker, as the callback's decisions must be.
    """

    name: str | None = None

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint."""
        return self.name or type(self).__name__

    def state_dict(self) -> dict[str, Any] | None:
        """What a resumed run needs to continue as this one would; None: nothing."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` returned when the checkpoint was written."""

    def on_step(self, result: StepResult, step: int, epoch: int) -> None:
        """After every call of the step, applied or skipped; ``step`` counts applied updates."""

    def before_step(self, step: int, micro_batches: Sequence[Any]) -> None:
        """Right before each call of the step (``step``: the updates done before it), with its
        micro-batches (``None``: this worker has run out of data); they must stay as they are."""

    def interval_meters(self) -> dict[str, tuple[Any, float]]:
        """``(value, weight)`` per name, added to the engine's meters right before the interval's
        all-reduce (so no collective of its own): the metric is ``sum(value * weight) /
        sum(weight)`` over the workers that give the name, so a name one worker alone gives
        (``x/rank<r>``) comes back as that worker's value."""
        return {}

    def interval_metrics(self, reduced: dict[str, float]) -> dict[str, float]:
        """Metrics derived from the interval's reduced ones (identical on every worker), added to
        them before :meth:`on_interval`."""
        return {}

    def on_interval(self, metrics: dict[str, float], step: int) -> None:
        """Every ``logging.every_steps`` calls, with the metrics averaged over all workers, and at
        the run's end for the calls since the last (an interval cut short)."""

    def on_eval(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        """After an evaluation, with its metrics averaged over all workers."""

    def on_epoch(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        """At the end of training epoch ``epoch`` (before its evaluation), with the epoch's
        averages over all workers and all its applied updates (``train_<name>``), the same on
        every worker."""

    def checkpoint_now(self, step: int) -> bool:
        """After applied update ``step`` (not the run's last), at the step boundary: True asks
        for a checkpoint here, whatever the cadence (a preemption notice). Called on every
        worker at every such boundary, so the answer may come from a collective; it must be the
        same on every worker."""
        return False

    def before_checkpoint(self) -> None:
        """Right before a checkpoint is reported (flush what must be in the run directory)."""

    def close(self) -> None:
        """When the loop ends, normally or on an error."""


@dataclass(frozen=True)
class LoopSettings:
    """The config sections the loop reads: accumulation and cadences (the run's length is the
    engine's ``total_steps``, from :mod:`raytrain_loops.engine.length`)."""

    accum: AccumConfig
    eval_every: int = 0  # 0: at the end of every epoch
    eval_ema: bool = True
    checkpoint_every: int = 0  # 0: at the end of every epoch
    report_every: int = 50
    log_every: int = 10
    bn_buffers: str = "broadcast"  # how evaluations make the workers' buffers the same (eval.bn_buffers)
    coalesce: bool = True  # skip a periodic report while the reporter has one in flight (run.coalesce_reports)

    @classmethod
    def of(cls, config: Config) -> LoopSettings:
        return cls(
            accum=config.accum,
            eval_every=config.eval.every_steps,
            eval_ema=config.eval.ema,
            checkpoint_every=config.checkpoint.every_steps,
            report_every=config.run.report_every_steps,
            log_every=config.logging.every_steps,
            bn_buffers=config.eval.bn_buffers,
            coalesce=config.run.coalesce_reports,
        )


def timed_groups(batches: Iterable[Any], k: int) -> Iterator[tuple[list[Any], float]]:
    """Yield lists of ``k`` consecutive batches with the seconds spent waiting for them.

    A short final group is yielded as is; an empty stream yields nothing.
    """
    it = iter(batches)
    while True:
        start = time.perf_counter()
        group = []
        for _ in range(k):
            try:
                group.append(next(it))
            except StopIteration:
                break
        if not group:
            return
        yield group, time.perf_counter() - start
        if len(group) < k:
            return


def sync_buffers(engine: Engine, mode: str = "broadcast") -> None:
    """Every worker's buffers of the model and the EMA made the same (rank 0's, or ``average``:
    the running statistics' mean): each worker's BatchNorm statistics follow its own batches,
    while a checkpoint saves rank 0's and a group resumed from it starts from them. Done before
    every evaluation and every checkpoint, an evaluation at step N uses, on every worker, the
    buffers a checkpoint at N holds. Training steps are unchanged: DDP broadcasts rank 0's
    buffers at each step's first forward."""
    modules = [engine.module] + ([engine.ema.module] if engine.ema is not None else [])
    collectives.sync_buffers(modules, mode)


def evaluate(
    engine: Engine,
    batches: Iterable[Any],
    evaluate_fn: EvaluateFn,
    with_ema: bool,
    metrics_fn: MetricsFn | None = None,
) -> dict[str, float]:
    """Evaluate the model (and its EMA, metrics prefixed ``eval_ema_``) on ``batches``; the
    means over all workers' batches, weighted by their counts.

    ``metrics_fn`` gives fresh split-level metric objects (``torchmetrics.Metric``: ``update``
    by the task, ``compute`` synchronised over the process group) per model; when it gives any,
    ``evaluate_fn`` receives them as ``metrics=`` and each is computed after the last batch, on
    every worker in the same order (a dict result adds its keys, a scalar the metric's name)."""
    models = [("", engine.module)]
    if engine.ema is not None and with_ema:
        models.append(("ema_", engine.ema.module))
    split_metrics = {prefix: _fresh_metrics(metrics_fn, engine.device) for prefix, _ in models}
    meters = Meters()
    for _, m in models:
        m.eval()
    batches_and_real: Iterable[tuple[Any, bool]] = ((b, True) for b in batches)
    padding: dict[str, dict[str, Any]] = {}  # the metrics zero-weight batches update, never computed
    if engine.strategy.shards_across_workers:
        batches_and_real = sharding.lockstep(batches)
        padding = {prefix: _fresh_metrics(metrics_fn, engine.device) for prefix, _ in models}
    with torch.no_grad(), autocast(engine.config.precision, engine.device):
        for batch, real in batches_and_real:
            batch = to_device(batch, engine.device)
            for prefix, m in models:
                updated = split_metrics[prefix] if real else padding[prefix]
                out = evaluate_fn(m, batch, metrics=updated) if updated else evaluate_fn(m, batch)
                for name, (value, count) in out.items() if real else ():
                    meters.add(f"eval_{prefix}{name}", value, count)
    engine.model.train()
    results = meters.reduce()
    for prefix, metrics_of_split in split_metrics.items():
        for name in sorted(metrics_of_split):
            value = metrics_of_split[name].compute()
            items = value.items() if isinstance(value, dict) else [(name, value)]
            results.update({f"eval_{prefix}{k}": float(v) for k, v in items})
    return results


def _fresh_metrics(metrics_fn: MetricsFn | None, device: torch.device) -> dict[str, Any]:
    if metrics_fn is None:
        return {}
    return {name: metric.to(device) for name, metric in metrics_fn().items()}


def _on_cadence(every: int, step: int) -> bool:
    """Whether ``step`` falls on a cadence of ``every`` steps (0: never)."""
    return every > 0 and step % every == 0


class Loop:
    """Runs ``engine`` over ``source`` until ``engine.total_steps``.

    ``scale`` (full group size / current size) is above 1 when an elastic group runs short of
    workers: each update then takes more micro-batches, so the global batch stays the same.
    """

    def __init__(
        self,
        engine: Engine,
        source: BatchSource,
        reporter: Reporter,
        settings: LoopSettings,
        evaluate_fn: EvaluateFn,
        callbacks: Sequence[Callback] = (),
        scale: float = 1.0,
        metrics_fn: MetricsFn | None = None,
    ):
        self.engine, self.source, self.reporter, self.settings = engine, source, reporter, settings
        self.metrics_fn = metrics_fn
        self.evaluate_fn, self.callbacks, self.scale = evaluate_fn, list(callbacks), scale
        keys = [cb.state_key for cb in self.callbacks if type(cb).state_dict is not Callback.state_dict]
        if len(set(keys)) < len(keys):
            raise ValueError(f"two callbacks share a state key (set Callback.name to tell them apart): {keys}")
        self.metrics: dict[str, float] = {}  # the latest interval's, carried by every report
        self.last_eval: dict[str, float] = {}  # the latest evaluation's, carried by every report
        self.eval_step: int | None = None  # the step of that evaluation
        self.last_epoch: dict[str, float] = {}  # the latest finished epoch's averages, carried by every report
        self.calls = 0
        self.coalescing = Coalescing(settings.coalesce)

    @property
    def total(self) -> int:
        return self.engine.total_steps

    def run(self, position: Position = Position()) -> None:
        """Train from ``position`` (where a restored checkpoint left the data) to the end; the
        final evaluation, checkpoint and report take the same path as the periodic ones."""
        for cb in self.callbacks:
            saved = self.engine.callback_state.get(cb.state_key)
            if saved is not None:  # the engine's state was restored from a checkpoint
                cb.load_state_dict(saved)
        try:
            finished = False
            while self.engine.step < self.total:
                position, finished = self._epoch(position)
                if not finished:
                    break
            last = self._reduce_metrics()
            self.metrics.update(last)
            if self.calls % self.settings.log_every:  # the last interval, cut short by the run's end
                last["epoch"] = float(self.engine.epoch - finished)  # its steps' epoch, not the next one
                for cb in self.callbacks:
                    cb.on_interval(last, self.engine.step)
            self._report(position, evaluate_now=True, checkpoint_now=True, done=True)
        finally:
            for cb in self.callbacks:
                cb.close()

    def _epoch(self, position: Position) -> tuple[Position, bool]:
        """One epoch's steps, from ``position`` when it is in this epoch; the position after
        it, and whether the epoch ran to its end (not stopped at the run's length inside it)."""
        engine = self.engine
        epoch = engine.epoch
        k = accum_steps(self.settings.accum, epoch, self.scale)
        steps = steps_in_epoch(self.settings.accum, self.source.batches_per_epoch, epoch, self.scale)
        start = position.batches if position.epoch == epoch else 0
        stream = iter(self.source.batches("train", epoch, start))
        try:
            done = start // k
            groups = copied_ahead(timed_groups(stream, k), engine.device)  # the next group's copy beside this step
            while done < steps and engine.step < self.total:
                group, wait = next(groups, ([], 0.0))
                done += 1
                # A worker that ran out of data joins the step with placeholders (zero contribution).
                self._step(list(group) + [None] * (k - len(group)), wait, Position(epoch, done * k))
            if done < steps:
                return Position(epoch, done * k), False  # a resumed run continues right here
            for _ in stream:  # drain the dropped remainder, so every shard's epoch ends together
                pass
        finally:
            _close(stream)
        self.last_epoch = {f"train_{k}": v for k, v in engine.end_epoch_metrics().items()}
        for cb in self.callbacks:
            cb.on_epoch(self.last_epoch, engine.step, epoch)
        engine.epoch += 1
        position = Position(engine.epoch, 0)
        s = self.settings
        if engine.step < self.total and (s.eval_every == 0 or s.checkpoint_every == 0):
            self._report(position, evaluate_now=s.eval_every == 0, checkpoint_now=s.checkpoint_every == 0)
        return position, True

    def _step(self, group: list[Any], wait: float, after: Position) -> None:
        engine, s = self.engine, self.settings
        for cb in self.callbacks:
            cb.before_step(engine.step, group)
        result = engine.train_step(group, data_time=wait)
        self.calls += 1
        for cb in self.callbacks:
            cb.on_step(result, engine.step, after.epoch)
        if self.calls % s.log_every == 0:
            self.metrics = self._reduce_metrics()
            for cb in self.callbacks:
                cb.on_interval(self.metrics, engine.step)
        if not result.applied or engine.step >= self.total:
            return  # the final report comes after the loop
        evaluate_now = _on_cadence(s.eval_every, engine.step)
        # Every callback is asked (a list, not a short-circuit): each may be a collective.
        asked = [cb.checkpoint_now(engine.step) for cb in self.callbacks]
        checkpoint_now = _on_cadence(s.checkpoint_every, engine.step) or any(asked)
        if evaluate_now or checkpoint_now or _on_cadence(s.report_every, engine.step):
            self._report(after, evaluate_now=evaluate_now, checkpoint_now=checkpoint_now, forced=any(asked))

    def _reduce_metrics(self) -> dict[str, float]:
        """The interval's metrics over all workers: the engine's meters with what the callbacks
        put in them, in the meters' one all-reduce, then what the callbacks derive from them."""
        for cb in self.callbacks:
            for name, (value, weight) in cb.interval_meters().items():
                self.engine.meters.add(name, value, weight)
        metrics = self.engine.reduce_metrics()
        for cb in self.callbacks:
            metrics.update(cb.interval_metrics(metrics))
        return metrics

    def _in_flight(self) -> bool:
        """Whether any worker's reporter has a report in flight: the same answer on every worker."""
        ask = getattr(self.reporter, "in_flight", None)
        if ask is None:  # the same reporter on every worker: none of them asks
            return False
        votes = torch.tensor([float(ask())], device=collectives.collective_device())
        return collectives.all_reduce_sum(votes).item() > 0

    def _report(
        self, position: Position, *, evaluate_now: bool, checkpoint_now: bool, done: bool = False, forced: bool = False
    ) -> None:
        engine = self.engine
        sent = self.coalescing.goes_out(engine.step, final=done, forced=forced, in_flight=self._in_flight)
        skipped_checkpoint, checkpoint_now = checkpoint_now and not sent, checkpoint_now and sent
        evaluating = evaluate_now and self.source.has_eval
        if evaluating or checkpoint_now:  # a checkpoint without an evaluation holds rank 0's
            sync_buffers(engine, self.settings.bn_buffers if evaluating else "broadcast")
        if evaluating:
            eval_batches = self.source.batches("eval", engine.epoch)
            try:
                self.last_eval.update(
                    evaluate(engine, eval_batches, self.evaluate_fn, self.settings.eval_ema, self.metrics_fn)
                )
            finally:
                _close(eval_batches)
            self.eval_step = engine.step
            for cb in self.callbacks:
                cb.on_eval(self.last_eval, engine.step, engine.epoch)
        if not sent:
            on_skipped = getattr(self.reporter, "skipped", None)
            if self.coalescing.skipped == 1 and on_skipped is not None:
                on_skipped(self.coalescing.last_sent, engine.step, checkpoint=skipped_checkpoint)
            return
        # Every report carries the latest evaluation, so a sweep's metric is in each of them.
        metrics = {**self.metrics, **self.last_epoch, **({"done": 1.0} if done else {}), **self.last_eval}
        metrics.update(step=engine.step, epoch=engine.epoch)
        if self.eval_step is not None:  # the evaluation carried may be older than this step
            metrics["evaluated_step"] = self.eval_step
        if checkpoint_now:
            # The epoch's sums so far, over all workers, go into the checkpoint: a run resumed
            # from it ends the epoch with the same averages as this one.
            engine.flush_epoch_metrics()
            for cb in self.callbacks:
                cb.before_checkpoint()
            states = {cb.state_key: cb.state_dict() for cb in self.callbacks}
            engine.callback_state = {k: v for k, v in states.items() if v is not None}
        self.reporter.report(metrics, position if checkpoint_now else None)
