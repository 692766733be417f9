"""The step's decision as a pure function of the reduced values, over every case."""

from __future__ import annotations

import math

import pytest

from raytrain_loops.engine import Decision, Reduced, decide


def reduced(sample_size=32.0, loss_sum=6.4, terms=2.0, ooms=0.0, norm_sq=4.0, *, mean=True, world=1, slots=()):
    return Reduced.from_sums([sample_size, loss_sum, terms, ooms, norm_sq, *slots], mean=mean, world=world)


@pytest.mark.parametrize("fp16", [False, True])
@pytest.mark.parametrize(
    "case,expected,expected_fp16",
    [
        (dict(), Decision.APPLY, Decision.APPLY),
        (dict(loss_sum=math.nan), Decision.SKIP_NONFINITE, Decision.SKIP_OVERFLOW),
        (dict(loss_sum=math.inf), Decision.SKIP_NONFINITE, Decision.SKIP_OVERFLOW),
        (dict(norm_sq=math.inf), Decision.SKIP_NONFINITE, Decision.SKIP_OVERFLOW),  # a finite loss, infinite gradients
        (dict(ooms=1.0), Decision.SKIP_OOM, Decision.SKIP_OOM),
        (dict(ooms=1.0, loss_sum=math.nan), Decision.SKIP_OOM, Decision.SKIP_OOM),  # OOM first
        (dict(ooms=1.0, terms=0.0, loss_sum=0.0), Decision.SKIP_OOM, Decision.SKIP_OOM),
        (dict(terms=0.0, loss_sum=0.0, sample_size=0.0), Decision.SKIP_EMPTY, Decision.SKIP_EMPTY),  # mean mode
        (dict(terms=0.0, loss_sum=0.0, norm_sq=math.nan), Decision.SKIP_EMPTY, Decision.SKIP_EMPTY),  # empty first
        (dict(sample_size=0.0, mean=False), Decision.SKIP_EMPTY, Decision.SKIP_EMPTY),  # sum mode: no units
        (dict(sample_size=0.0, loss_sum=math.nan, mean=False), Decision.SKIP_EMPTY, Decision.SKIP_EMPTY),
        (dict(loss_sum=math.nan, mean=False), Decision.SKIP_NONFINITE, Decision.SKIP_OVERFLOW),
    ],
    ids=[
        "clean",
        "nan-loss",
        "inf-loss",
        "inf-grad",
        "oom",
        "oom+nan",
        "oom+empty",
        "empty-mean",
        "empty+nan-grad",
        "empty-sum",
        "empty-sum+nan",
        "nan-sum",
    ],
)
def test_decide_over_every_case(case, expected, expected_fp16, fp16):
    assert decide(reduced(**case), fp16=fp16) is (expected_fp16 if fp16 else expected)


def test_the_reduced_values_follow_the_loss_reduction():
    mean = reduced(sample_size=32.0, loss_sum=6.4, terms=2.0, norm_sq=8.0, world=2, slots=(4.0, 4.0))
    assert mean.loss == pytest.approx(3.2) and mean.grad_factor == 1.0
    assert mean.grad_norm == pytest.approx(2.0) and mean.norms == (2.0, 2.0)
    # sum mode: DDP averaged the gradients over 2 workers; the update divides their sum by 32 units.
    total = reduced(sample_size=32.0, loss_sum=64.0, terms=2.0, norm_sq=8.0, world=2, mean=False)
    assert total.loss == pytest.approx(2.0) and total.grad_factor == pytest.approx(2 / 32)
    assert total.grad_norm == pytest.approx(2.0 * 2 / 32)
    assert (
        math.isnan(reduced(sample_size=0.0, mean=False).loss) and reduced(sample_size=0.0, mean=False).grad_factor == 0
    )
