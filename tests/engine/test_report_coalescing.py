"""Reports that would queue behind Ray's controller (one taken per poll) are skipped while one is
in flight, never the final one or a preemption's; without Ray: the decision, the loop with a
reporter whose reports stay in flight for a number of boundaries, and two gloo workers that see
different in-flight states and still skip alike."""

from __future__ import annotations

from dataclasses import dataclass, field

from raytrain_loops.engine.coalesce import Coalescing, skipping_note
from raytrain_loops.engine.loop import Callback, Position
from tests.support import fakes
from tests.support.gloo import run_gloo
from tests.support.loops import Counting, loop_of


def test_a_periodic_report_is_skipped_while_one_is_in_flight_the_final_and_a_forced_one_never():
    asked: list[int] = []

    def in_flight_at(*steps: int):
        def ask() -> bool:
            asked.append(step)
            return step in steps

        return ask

    c = Coalescing()
    decisions = []
    for step, final, forced in [
        (4, False, False),
        (8, False, False),
        (12, False, True),
        (16, False, False),
        (18, True, False),
    ]:
        decisions.append(c.goes_out(step, final=final, forced=forced, in_flight=in_flight_at(8, 12, 18)))
    assert decisions == [True, False, True, True, True]
    assert (c.last_sent, c.skipped) == (18, 1)
    assert asked == [4, 8, 16]  # a forced or final report asks nobody (the ask may be a collective)
    off = Coalescing(enabled=False)
    assert off.goes_out(8, final=False, forced=False, in_flight=lambda: True) and off.skipped == 0


@dataclass
class SlowlyTaken(fakes.RecordingReporter):
    """A reporter whose every report stays in flight for ``boundaries`` askings (a controller that
    takes one report per poll, polling slower than the steps come)."""

    boundaries: int = 2
    left: int = 0
    told: list[tuple] = field(default_factory=list)

    def report(self, metrics, checkpoint):
        super().report(metrics, checkpoint)
        self.left = self.boundaries

    def in_flight(self) -> bool:
        self.left -= 1
        return self.left >= 0

    def skipped(self, last_sent, step, checkpoint=False):
        self.told.append((last_sent, step, checkpoint))


class NoticeAt(Callback):
    """A preemption notice at ``step``: a checkpoint asked for there."""

    def __init__(self, step: int):
        self.step = step

    def checkpoint_now(self, step: int) -> bool:
        return step == self.step


CADENCE = ["loop.epochs=3", "accum.steps=1", "eval.every_steps=2", "checkpoint.every_steps=2"]
CADENCE += ["run.report_every_steps=100", "logging.every_steps=1"]


def _coalesced(*overrides, callbacks=()):
    loop, _, _ = loop_of(*CADENCE, *overrides, batches=4, callbacks=callbacks)
    reporter = SlowlyTaken(loop.engine)
    loop.reporter = reporter
    loop.run(Position())
    return loop, reporter


def test_the_loop_skips_periodic_reports_in_flight_still_evaluates_and_sends_the_final_and_a_preemptions():
    counting = Counting()
    loop, reporter = _coalesced(callbacks=[counting, NoticeAt(7)])
    # 3 epochs of 4 steps, a report due every 2 (evaluation and checkpoint), each report in flight
    # for the next 2 askings: 4 and 6 are skipped; the notice at 7 goes out in flight, and holds
    # 8 and 10; the final report goes out in flight too.
    sent = [(r["metrics"]["step"], r["checkpoint"]) for r in reporter.reports]
    assert sent == [(2, Position(0, 2)), (7, Position(1, 3)), (12, Position(3, 0))]
    assert reporter.reports[-1]["metrics"]["done"] == 1.0 and loop.coalescing.skipped == 4
    # Every evaluation the cadence asked for ran (2, 4, ..., 10 and the final one); a report
    # carries the latest.
    assert counting.calls["on_eval"] == 6 and counting.calls["before_checkpoint"] == 3
    assert [r["metrics"]["evaluated_step"] for r in reporter.reports] == [2, 6, 12]
    # Told once, at the first skip (a checkpoint's), of the last report sent.
    assert reporter.told == [(2, 4, True)]


def test_the_note_says_what_was_skipped_and_why_not_a_gap_between_two_cadences_as_a_frequency():
    # A checkpoint every 10 steps and an epoch's evaluation at 12: the evaluation's report skipped.
    note = skipping_note(10, 12, 0.5)
    assert note.startswith(
        "the report due at step 12 was skipped: the one of step 10 was still on its way to Ray's controller, "
        "which takes one report per 0.5 s. While one is in flight, a periodic report"
    ), note
    assert "every 2 steps" not in note and "come faster" not in note
    assert skipping_note(11, 12, 2.0, checkpoint=True).startswith("the checkpoint due at step 12 was skipped: ")
    assert note.endswith("this is said once (run.coalesce_reports=false keeps them all)")


def test_with_coalescing_off_every_report_goes_out_in_flight_or_not():
    _, reporter = _coalesced("run.coalesce_reports=false")
    assert [r["metrics"]["step"] for r in reporter.reports] == [2, 4, 6, 8, 10, 12]
    assert reporter.told == []


def _in_flight_on_rank_1(rank: int, world: int):
    from torch.nn.parallel import DistributedDataParallel as DDP

    loop, _, _ = loop_of(*CADENCE, batches=4, model=DDP(fakes.make_model()))
    reporter = SlowlyTaken(loop.engine, boundaries=2 if rank == 1 else 0)
    loop.reporter = reporter
    loop.run(Position())
    return [(r["metrics"]["step"], r["checkpoint"].epoch, r["checkpoint"].batches) for r in reporter.reports]


def test_workers_that_see_different_reports_in_flight_skip_the_same_ones():
    outcomes = run_gloo(2, _in_flight_on_rank_1)
    assert [o.error for o in outcomes] == [None, None], [o.message for o in outcomes]
    a, b = (o.value for o in outcomes)
    # Rank 0's reports are taken at once, rank 1's stay in flight for 2 askings: both skip 4, 6, 10.
    assert a == b == [(2, 0, 2), (8, 1, 4), (12, 3, 0)], (a, b)
