"""The step across real gloo process groups: invariance, one all-reduce per step, and decisions
every worker takes together (non-finite, OOM) without hanging."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from raytrain_loops.engine import Engine
from tests.support import fakes
from tests.support.gloo import run_gloo
from tests.support.oom import OOMInBackward

# A 24-sample global batch cut unevenly: (workers x micro-batches) -> sizes per worker.
UNEVEN = {
    (1, 4): [[3, 5, 7, 9]],
    (2, 2): [[3, 9], [7, 5]],
    (4, 1): [[3], [5], [7], [9]],
}
EVEN = {(1, 4): [[6, 6, 6, 6]], (2, 2): [[6, 6], [6, 6]], (4, 1): [[6], [6], [6], [6]]}


def _one_update(rank: int, world: int, sizes_per_rank, reduction: str):
    x, y = fakes.regression_data()
    offset = sum(sum(s) for s in sizes_per_rank[:rank])
    mine = fakes.split(x[offset:], y[offset:], sizes_per_rank[rank])
    model = fakes.make_model()
    if world > 1:
        model = DDP(model)
    loss = fakes.sum_loss if reduction == "sum" else fakes.mean_loss
    engine = Engine(model, loss, fakes.config(f"loss.reduction={reduction}").engine, total_steps=1)
    result = engine.train_step(mine)
    assert result.applied
    return fakes.params(engine.module)


def _full_batch(reduction: str):
    x, y = fakes.regression_data()
    loss = fakes.sum_loss if reduction == "sum" else fakes.mean_loss
    engine = Engine(fakes.make_model(), loss, fakes.config(f"loss.reduction={reduction}").engine, total_steps=1)
    engine.train_step([(x, y)])
    return fakes.params(engine.module)


@pytest.mark.parametrize("reduction,splits", [("sum", UNEVEN), ("mean", EVEN)])
def test_update_is_invariant_to_how_the_global_batch_is_split(reduction, splits):
    reference = _full_batch(reduction)
    start = fakes.params(fakes.make_model())
    assert any((reference[k] - start[k]).abs().max() > 1e-2 for k in start), "the update must move the weights"
    for (world, _k), sizes in splits.items():
        if world == 1:
            got = [_one_update(0, 1, sizes, reduction)]
        else:
            outcomes = run_gloo(world, _one_update, sizes, reduction)
            assert [o.error for o in outcomes] == [None] * world, outcomes[0].message
            got = [o.value for o in outcomes]
        for rank_params in got:
            for name, ref in reference.items():
                torch.testing.assert_close(rank_params[name], ref, atol=1e-6, rtol=0, msg=f"{world}x{_k} {name}")


def test_mean_mode_with_uneven_micro_batches_differs_from_full_batch():
    # The invariance above is not vacuous: averaging means of uneven micro-batches is a
    # different update, so the comparison can tell them apart.
    reference = _full_batch("mean")
    got = _one_update(0, 1, UNEVEN[(1, 4)], "mean")
    assert max((got[k] - reference[k]).abs().max().item() for k in got) > 1e-4


def _count_allreduces(rank: int, world: int, k: int, steps: int):
    x, y = fakes.regression_data(n=8 * k * steps, seed=rank)
    model = DDP(fakes.make_model(), bucket_cap_mb=100)
    calls = []

    def counting_hook(state, bucket):
        calls.append(1)
        fut = torch.distributed.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0] / world)

    model.register_comm_hook(None, counting_hook)
    engine = Engine(model, fakes.mean_loss, fakes.config().engine, total_steps=steps)
    batches = fakes.split(x, y, [8] * (k * steps))
    for s in range(steps):
        engine.train_step(batches[s * k : (s + 1) * k])
    return len(calls)


def test_ddp_allreduce_runs_once_per_step_not_per_micro_batch():
    outcomes = run_gloo(2, _count_allreduces, 4, 3)
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message
    assert [o.value for o in outcomes] == [3, 3]  # 3 steps x 1 bucket, not 12


def _nan_on_rank1(rank: int, world: int, policy: str):
    model = DDP(fakes.make_model())
    engine = Engine(model, fakes.mean_loss, fakes.config(f"nonfinite.policy={policy}").engine, total_steps=4)
    x, y = fakes.regression_data(n=32, seed=rank)
    snapshots = []
    for s in range(4):
        xs = x[s * 8 : (s + 1) * 8].clone()
        if rank == 1 and s == 2:
            xs[0, 0] = float("nan")
        before = fakes.params(engine.module)
        result = engine.train_step([(xs, y[s * 8 : (s + 1) * 8])])
        snapshots.append((before, fakes.params(engine.module), result.skipped))
    return {"snapshots": snapshots, "step": engine.step, "nonfinite": engine.counts["nonfinite"]}


def test_nonfinite_on_one_rank_skip_leaves_parameters_bit_identical_on_both():
    outcomes = run_gloo(2, _nan_on_rank1, "skip")
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message
    for o in outcomes:
        before, after, skipped = o.value["snapshots"][2]
        assert skipped == "nonfinite"
        for name in before:
            assert torch.equal(before[name], after[name]), name
        moved_before, moved_after, _ = o.value["snapshots"][3]
        assert any(not torch.equal(moved_before[n], moved_after[n]) for n in moved_before), "training goes on"
        assert o.value["step"] == 3 and o.value["nonfinite"] == 1
    final = [o.value["snapshots"][3][1] for o in outcomes]
    for name in final[0]:
        assert torch.equal(final[0][name], final[1][name]), name


def test_nonfinite_on_one_rank_stop_raises_naming_the_module_on_both():
    outcomes = run_gloo(2, _nan_on_rank1, "stop")
    assert [o.error for o in outcomes] == ["NonFiniteError", "NonFiniteError"]
    for o in outcomes:
        assert "module 'encoder'" in o.message and "worker 1" in o.message and "step 2" in o.message


def _oom_on_rank0(rank: int, world: int, when: str, oom_steps: tuple[int, ...], k: int, policy: str = "skip"):
    model = DDP(fakes.make_model())
    cfg = fakes.config("oom.max_consecutive=2", f"oom.policy={policy}")
    engine = Engine(model, fakes.mean_loss, cfg.engine, total_steps=6)
    x, y = fakes.regression_data(n=48, seed=rank)
    fired = set()

    def loss_fn(m, batch, ctx):
        # One transient OOM per listed step, on the last micro-batch (the synchronising one).
        call = engine.counts["micro_batches"] // k
        if rank == 0 and ctx.micro_index == k - 1 and call in oom_steps and call not in fired:
            fired.add(call)
            if when == "in_backward":
                out = fakes.mean_loss(m, batch, ctx)
                out.loss = OOMInBackward.apply(out.loss)
                return out
            if when == "after_forward":
                m(batch[0])
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected at call {call})")
        return fakes.mean_loss(m, batch, ctx)

    engine.loss_fn = loss_fn
    results = []
    for s in range(6):
        mbs = fakes.split(x[s * 8 :], y[s * 8 :], [8 // k] * k)
        results.append(engine.train_step(mbs).skipped)
    return {"skipped": results, "oom": engine.counts["oom"], "params": fakes.params(engine.module)}


@pytest.mark.parametrize("when", ["before_forward", "after_forward"])
def test_oom_on_one_rank_is_skipped_on_both(when):
    outcomes = run_gloo(2, _oom_on_rank0, when, (1,), 2)
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message
    for o in outcomes:
        assert o.value["skipped"] == [None, "oom", None, None, None, None]
        assert o.value["oom"] == 1
    for name, p in outcomes[0].value["params"].items():
        assert torch.equal(p, outcomes[1].value["params"][name]), name


def test_repeated_oom_is_a_clear_error_on_both_ranks():
    outcomes = run_gloo(2, _oom_on_rank0, "before_forward", (1, 2), 1)
    assert [o.error for o in outcomes] == ["OOMError", "OOMError"]
    assert all("out of memory on 2 updates in a row" in o.message for o in outcomes)


def _ended_together(*args) -> tuple[list, float]:
    """The outcomes, and the longest time a worker spent in the test function. A worker left
    waiting in a collective would spend the group's 30 s timeout there."""
    outcomes = run_gloo(2, _oom_on_rank0, *args)
    return outcomes, max(o.seconds for o in outcomes)


@pytest.mark.deadline
def test_oom_with_policy_raise_on_one_worker_raises_on_both():
    outcomes, seconds = _ended_together("before_forward", (1,), 2, "raise")
    assert [o.error for o in outcomes] == ["OOMError", "OOMError"], [o.message for o in outcomes]
    assert all("oom.policy=raise" in o.message and "at step 1" in o.message for o in outcomes)
    assert seconds < 20


@pytest.mark.deadline
def test_oom_on_the_first_step_with_one_micro_batch_is_skipped_on_both():
    # Step 0 after a (re)start, one micro-batch per update: the failed batch itself joins the
    # gradient all-reduce at zero weight.
    outcomes, seconds = _ended_together("before_forward", (0,), 1)
    assert [o.error for o in outcomes] == [None, None], [o.message for o in outcomes]
    for o in outcomes:
        assert o.value["skipped"] == ["oom", None, None, None, None, None]
    for name, p in outcomes[0].value["params"].items():
        assert torch.equal(p, outcomes[1].value["params"][name]), name
    assert seconds < 20


@pytest.mark.deadline
def test_oom_in_the_synchronising_backward_ends_every_worker_as_a_retryable_failure():
    outcomes, seconds = _ended_together("in_backward", (1,), 2)
    # Not a TrainingError (which would stop the run without a retry): Ray restarts the group.
    assert outcomes[0].error == "GroupBrokenError", outcomes[0].message
    assert "backward pass of the synchronising micro-batch on worker 0 at step 1" in outcomes[0].message
    assert outcomes[1].error is not None  # the other worker's all-reduce fails: it does not wait on
    assert seconds < 20


def _rank_dependent_metric(rank: int, world: int):
    engine = Engine(DDP(fakes.make_model()), fakes.mean_loss, fakes.config().engine, total_steps=2)
    x, y = fakes.regression_data(n=16, seed=rank)

    def loss(m, batch, ctx):
        out = fakes.mean_loss(m, batch, ctx)
        out.logs["rank"] = torch.tensor(float(rank))
        out.sample_size = 1 + 2 * rank  # rank 1 weighs 3x rank 0
        return out

    engine.loss_fn = loss
    engine.train_step([(x[:8], y[:8])])
    engine.train_step([(x[8:], y[8:])])
    return engine.reduce_metrics()


def test_metrics_are_aggregated_over_all_workers_not_rank0():
    outcomes = run_gloo(2, _rank_dependent_metric)
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message
    for o in outcomes:
        assert o.value["rank"] == 0.75  # (0 * 1 + 1 * 3) / 4 on both ranks
        assert o.value["step"] == 2


def _infinite_gradient(rank: int, world: int):
    engine = Engine(
        DDP(fakes.RootOfZero()), fakes.mean_loss, fakes.config("nonfinite.policy=stop").engine, total_steps=2
    )
    x, y = fakes.regression_data(n=8, seed=rank)
    engine.train_step([(x, y)])


def test_an_infinite_gradient_is_traced_to_its_parameter_on_every_worker():
    outcomes = run_gloo(2, _infinite_gradient)
    assert [o.error for o in outcomes] == ["NonFiniteError", "NonFiniteError"]
    for o in outcomes:
        assert "first seen in the gradient of parameter 'p'" in o.message
