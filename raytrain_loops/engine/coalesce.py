"""Which of the loop's periodic reports go out, when its reporter hands them to something that
takes them one at a time.

Ray Train's controller takes one report per poll of its workers (every 0.5 s on a local Ray, 2 s
by Ray's default). A cadence of reports faster than that (a checkpoint at every epoch of 31 steps
at 230 steps/s) queues them: the checkpoints come tens of seconds late, the run's end waits for
the queue, and an interruption loses every step after the last checkpoint the controller took,
however many were written since. So a periodic report (metrics, an evaluation, a checkpoint) is
skipped while the reporter still has an earlier one in flight; the next one the cadences ask for
after that goes out. The run's final report and a checkpoint a callback asks for (a preemption
notice) always go out. An evaluation due at a skipped report still runs: only its report waits,
and every later report carries it.

Ray-free: what "in flight" means is the reporter's; the loop asks every worker and decides alike
on all of them (any worker's report in flight holds every worker's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Coalescing:
    """The loop's record of the reports it sent and skipped. ``enabled``: ``run.coalesce_reports``."""

    enabled: bool = True
    last_sent: int | None = None  # the step of the last report that went out
    skipped: int = 0  # periodic reports skipped so far

    def goes_out(self, step: int, *, final: bool, forced: bool, in_flight: Callable[[], bool]) -> bool:
        """Whether the report due at ``step`` goes out: always the ``final`` one and a ``forced``
        checkpoint; a periodic one unless an earlier report is ``in_flight`` (asked only when it
        decides: the answer may cost a collective)."""
        if final or forced or not self.enabled or not in_flight():
            self.last_sent = step
            return True
        self.skipped += 1
        return False


def skipping_note(last_sent: int | None, step: int, poll_s: float, checkpoint: bool = False) -> str:
    """The console's one line on the first periodic report skipped while one was in flight: what
    was skipped (``checkpoint``: the report was to carry one) and why."""
    what = "the checkpoint" if checkpoint else "the report"
    before = "an earlier one" if last_sent is None else f"the one of step {last_sent}"
    return (
        f"{what} due at step {step} was skipped: {before} was still on its way to Ray's controller, which "
        f"takes one report per {poll_s:g} s. While one is in flight, a periodic report, evaluation's or "
        "checkpoint's, is skipped (the next one due goes out; the final one and a preemption's never are); "
        "this is said once (run.coalesce_reports=false keeps them all)"
    )
