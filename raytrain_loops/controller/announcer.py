"""``Announcer``, a Ray Train controller callback; runs in the Train controller's process. It sends the
console one line for each checkpoint Ray registered and for each worker failure, saying whether the
run restarts. A worker's death (killed, crashed, out of memory, its node gone) is one short line
(:mod:`raytrain_loops.console.deaths`), with Ray's text of it sent along for ``ray.log``.

A worker lost to a preemption (its node reclaimed after a drain) is retried by Ray apart from
``run.max_failures`` (``run.max_preemptions``), and said so.
"""

from __future__ import annotations

from typing import Any

from ray.train.v2.api.callback import UserCallback

from raytrain_loops.console.deaths import Death, deaths
from raytrain_loops.console.feed import Sender
from raytrain_loops.errors import root_cause


def preempted(err: BaseException) -> bool:
    """Whether a worker's error is its death by a node preemption, as Ray's failure policy tells
    it (a ``RayActorError`` flagged ``preempted``, possibly inside a failed health check): Ray
    then counts the failure against ``FailureConfig.max_preemption_failures``."""
    err = getattr(err, "health_check_failure", None) or err
    return bool(getattr(err, "preempted", False))


def _limit(value: int) -> str:
    return "unlimited" if value < 0 else str(value)


class Announcer(UserCallback):
    """In the Train controller: one line for each checkpoint Ray registered and for each worker
    failure, saying whether the run restarts."""

    def __init__(self, sender: Sender, max_failures: int, max_preemptions: int = -1):
        self.sender, self.max_failures, self.failures = sender, max_failures, 0
        self.max_preemptions, self.preemptions = max_preemptions, 0
        self._last_preempted: frozenset | None = None

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if checkpoint is not None:
            self.sender.checkpoint(metrics[0].get("step"), checkpoint.path)

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        # As Ray's policy: one preempted worker makes the whole failure a preemption (the others'
        # errors are what losing it caused).
        if any(preempted(err) for err in worker_exceptions.values()):
            self._preempted(worker_exceptions)
            return
        self.failures += 1
        if self.max_failures < 0 or self.failures <= self.max_failures:
            then = f"restarting from the newest checkpoint (retry {self.failures} of {_limit(self.max_failures)})"
        else:
            then = "no retries left (run.max_failures)"
        died = deaths(worker_exceptions)
        if died:
            self._deaths(died, worker_exceptions, then)
            return
        for rank, err in sorted(worker_exceptions.items()):
            self.sender.send("failure", f"worker {rank} failed: {root_cause(err)}; {then}")

    def _deaths(self, died: dict[int, Death], worker_exceptions: dict[int, Exception], then: str) -> None:
        """One line a death; Ray's whole text of the failure (with the other workers' errors,
        which losing a worker caused: a broken collective) goes with the first, for ``ray.log``."""
        errors = sorted(worker_exceptions.items())
        raw = "\n".join(f"worker {rank}: {type(err).__name__}: {err}" for rank, err in errors)
        for rank, d in died.items():
            self.sender.send("failure", f"{d.line(rank)}; {then}", detail=raw, see_log=not d.known)
            raw = ""

    def _preempted(self, worker_exceptions: dict[int, Exception]) -> None:
        # Ray polls a preempted group until its other workers end or the deadline passes, and
        # hands over the same errors at each poll: one line for them.
        seen = frozenset((r, type(e).__name__, str(e)) for r, e in worker_exceptions.items())
        if seen == self._last_preempted:
            return
        self._last_preempted = seen
        self.preemptions += 1
        if self.max_preemptions < 0 or self.preemptions <= self.max_preemptions:
            then = (
                "restarting from the newest checkpoint "
                f"(preemption {self.preemptions} of {_limit(self.max_preemptions)}, not counted in run.max_failures)"
            )
        else:
            then = "no retries left (run.max_preemptions)"
        ranks = ", ".join(str(r) for r, err in sorted(worker_exceptions.items()) if preempted(err))
        self.sender.send("failure", f"worker {ranks} preempted: its node was reclaimed; {then}")
