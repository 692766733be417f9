"""``PreemptionCheck``: a checkpoint at the step boundary where a preemption notice arrives.

A cloud reclaims a spot node after a notice (Ray drains the node with a deadline). Whoever can
tell this worker of a notice (on Ray, ``ray.train.get_preemption_info``, through the worker
adapter) is asked at step boundaries; on a new notice the loop writes a checkpoint at once, with
the exact data position, and rank 0 tells the console in one line: the node, the deadline, the
step saved. The group trains on until Ray restarts it after the deadline, from that checkpoint.

The ask is a barrier across workers (the answer is rank 0's, broadcast), so every worker asks at
the same boundaries: the cadence is a count of boundaries, set from values identical on every
worker (the interval's all-reduced step time and every worker's measured cost of an ask, in the
interval's one all-reduce), so that asking costs about 1% of the step time, and never leaves
more than ``MAX_GAP_S`` of steps between two asks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from raytrain_loops.console.feed import Sender
from raytrain_loops.engine.loop import Callback

SHARE = 0.01  # the asks' share of the step time
MAX_GAP_S = 2.0  # the most step time between two asks, whatever an ask costs
COST = "preemption_check_s"  # each worker's mean seconds per ask, ``<COST>/rank<r>`` in the metrics


@dataclass(frozen=True)
class Notice:
    """A preemption on its way: each drained node's id with the ranks on it, and the deadline
    (epoch seconds; None: none given)."""

    nodes: tuple[tuple[str, tuple[int, ...]], ...]
    deadline: float | None

    @classmethod
    def of(cls, node_to_ranks: dict[str, list[int]], deadline: float | None) -> Notice:
        return cls(tuple(sorted((n, tuple(sorted(r))) for n, r in node_to_ranks.items())), deadline)

    @property
    def ranks(self) -> list[int]:
        return sorted({r for _, ranks in self.nodes for r in ranks})


def cadence(cost_s: float, step_s: float) -> int:
    """The step boundaries between asks: an ask's cost about ``SHARE`` of the steps between
    them, and no more than ``MAX_GAP_S`` of steps."""
    if step_s <= 0:
        return 1
    by_share = math.ceil(cost_s / (SHARE * step_s))
    return max(1, min(by_share, int(MAX_GAP_S / step_s)))


def notice_line(notice: Notice, step: int, limit: int) -> str:
    """The console's line, in the shape of a worker failure's: who, what, then what happens."""
    nodes = ", ".join(node for node, _ in notice.nodes)
    ranks = ", ".join(map(str, notice.ranks))
    if notice.deadline is None:
        deadline = "no deadline given"
    else:
        at = datetime.fromtimestamp(notice.deadline, UTC).strftime("%H:%M:%S UTC")
        deadline = f"deadline {at} (in {max(0, round(notice.deadline - time.time()))} s)"
    preemptions = "unlimited" if limit < 0 else str(limit)
    return (
        f"worker {ranks} preempted: node {nodes} is being drained, {deadline}; checkpoint at step {step} "
        f"saved, the group restarts from it when the node goes (run.max_preemptions={preemptions})"
    )


class PreemptionCheck(Callback):
    """Asks ``ask`` (the same on every worker: a barrier) for a notice at step boundaries, on the
    cadence above, and asks the loop for a checkpoint at the boundary where a new one arrives."""

    def __init__(self, ask: Callable[[], Notice | None], rank: int, sender: Sender, max_preemptions: int = -1):
        self.ask, self.rank, self.sender, self.limit = ask, rank, sender, max_preemptions
        self.every = 1  # until the first interval's reduction measured an ask against a step
        self.boundaries = 0
        self.cost_s, self.asks = 0.0, 0  # this interval's
        self.seen: Notice | None = None
        self.saved: int | None = None  # the step of a notice's checkpoint, announced after its report

    def checkpoint_now(self, step: int) -> bool:
        self.boundaries += 1
        if self.boundaries % self.every:
            return False
        start = time.perf_counter()
        notice = self.ask()
        self.cost_s += time.perf_counter() - start
        self.asks += 1
        if notice is None or notice == self.seen:
            return False
        self.seen, self.saved = notice, step
        return True

    def interval_meters(self) -> dict[str, tuple[Any, float]]:
        if not self.asks:
            return {}
        return {f"{COST}/rank{self.rank}": (self.cost_s / self.asks, 1.0)}

    def interval_metrics(self, reduced: dict[str, float]) -> dict[str, float]:
        costs = [v for k, v in reduced.items() if k.startswith(f"{COST}/rank")]
        if costs and reduced.get("batch_time"):
            self.every = cadence(max(costs), reduced["batch_time"])
        self.cost_s, self.asks = 0.0, 0
        return {}

    def before_step(self, step: int, micro_batches) -> None:
        self._announce()

    def close(self) -> None:
        self._announce()

    def _announce(self) -> None:
        """Rank 0's line for a notice's checkpoint, once its report returned (it is saved)."""
        if self.saved is not None and self.seen is not None:
            if self.rank == 0:
                self.sender.send("preemption", notice_line(self.seen, self.saved, self.limit))
            self.saved = None
