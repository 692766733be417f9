"""The task API a DETR-style criterion needs, on real process groups: weighted loss terms logged
scaled and unscaled over all workers, global counts (``ctx.totals``) summed in one all-reduce
before the forward passes, step statistics carried by the step's own all-reduce, and the DINO
centre on that path."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raytrain_loops.engine import Engine, LossOutput, NonFiniteError
from raytrain_loops.engine.distributed import collectives
from raytrain_loops.tasks import build_task
from raytrain_loops.tasks.dino import update_center
from tests.support import fakes
from tests.support.gloo import run_gloo

WEIGHTS = {"l1": 2.0, "sq": 0.5}


def _boxes(seed: int = 3) -> list[torch.Tensor]:
    """Per-box features: worker 0 gets 3 and 1 boxes, worker 1 gets 2 boxes and a None."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 3, generator=g) for n in (3, 1, 2)]


def _box_criterion(seen: list):
    def criterion(model, batch, ctx) -> LossOutput:
        seen.append(dict(ctx.totals))
        y = model(batch["x"]).squeeze(-1)
        norm = ctx.per_slot("boxes")
        terms = {"l1": y.sum() / norm, "sq": (y**2).sum() / norm}
        return LossOutput(terms=terms, weights=WEIGHTS, sample_size=len(y), stats={"x": batch["x"].sum(0)})

    return criterion


def _counting_all_reduces(fn):
    calls = []

    def counted(t):
        calls.append(t.numel())
        return fn(t)

    return calls, counted


def _two_workers_with_uneven_boxes(rank: int, world: int, boxes: list[torch.Tensor], w0: torch.Tensor):
    torch.manual_seed(0)
    module = nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        module.weight.copy_(w0)
    model = DDP(module)
    seen, stats = [], []
    engine = Engine(
        model,
        _box_criterion(seen),
        fakes.config().engine,
        total_steps=1,
        counts=lambda b: {"boxes": len(b["x"])},
        count_keys=("boxes",),
        after_step=lambda m, s: stats.append(s),
    )
    batches = [{"x": boxes[0]}, {"x": boxes[1]}] if rank == 0 else [{"x": boxes[2]}, None]
    original = collectives.all_reduce_sum
    calls, counted = _counting_all_reduces(original)
    collectives.all_reduce_sum = counted
    try:
        result = engine.train_step(batches)
    finally:
        collectives.all_reduce_sum = original
    metrics = engine.reduce_metrics()
    return {
        "applied": result.applied,
        "weight": module.weight.detach().clone(),
        "totals": seen,
        "stats": stats[0]["x"].float(),
        "metrics": metrics,
        "all_reduces": len(calls),
    }


def test_counts_terms_and_stats_over_two_workers_with_uneven_boxes_and_a_none_micro_batch():
    boxes = _boxes()
    w0 = torch.tensor([[0.3, -0.2, 0.5]])
    outcomes = run_gloo(2, _two_workers_with_uneven_boxes, boxes, w0)
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message + outcomes[1].message
    every = torch.cat(boxes)
    n = len(every)  # 6 boxes over both workers
    y = every @ w0[0]
    # The loss over the whole update: sum over all boxes of 2 y + 0.5 y^2, divided by all boxes.
    grad = ((2.0 + y)[:, None] * every).sum(0) / n
    for o in outcomes:
        v = o.value
        assert v["applied"]
        # Every criterion call (worker 1's zero-weight dummy included) saw the global count.
        assert v["totals"] and all(t == {"boxes": float(n)} for t in v["totals"]), v["totals"]
        torch.testing.assert_close(v["weight"][0], w0[0] - grad)
        torch.testing.assert_close(v["stats"], every.sum(0))
        # The counts' all-reduce and the step's: nothing else in a step.
        assert v["all_reduces"] == 2
        m = v["metrics"]
        for name, weight in WEIGHTS.items():
            per_box = {"l1": y, "sq": y**2}[name]
            # Each micro-batch's term is its sum over boxes / (6 / 4 slots), averaged weighted by boxes.
            sums = [per_box[:3].sum(), per_box[3:4].sum(), per_box[4:].sum()]
            expected = sum(s / (n / 4) * k for s, k in zip(sums, (3, 1, 2), strict=True)) / n
            assert m[f"{name}_unscaled"] == pytest.approx(float(expected), rel=1e-5)
            assert m[name] == pytest.approx(float(expected) * weight, rel=1e-5)


def _without_counts(rank: int, world: int):
    model = DDP(fakes.make_model())
    engine = Engine(model, fakes.mean_loss, fakes.config().engine, total_steps=1)
    original = collectives.all_reduce_sum
    calls, counted = _counting_all_reduces(original)
    collectives.all_reduce_sum = counted
    try:
        x, y = fakes.regression_data(n=8, seed=rank)
        engine.train_step([(x, y)])
    finally:
        collectives.all_reduce_sum = original
    return len(calls)


def test_a_task_without_counts_adds_no_all_reduce_to_the_step():
    outcomes = run_gloo(2, _without_counts)
    assert [o.value for o in outcomes] == [1, 1], outcomes[0].message


def test_terms_need_weights_and_exclude_a_loss():
    t = torch.tensor(1.0)
    with pytest.raises(ValueError, match=r"loss terms \['giou'\] have no weight; the weights name \['l1'\]"):
        LossOutput(terms={"l1": t, "giou": t}, weights={"l1": 1.0})
    with pytest.raises(ValueError, match="not both"):
        LossOutput(t, terms={"l1": t}, weights={"l1": 1.0})
    with pytest.raises(ValueError, match="needs a loss"):
        LossOutput()
    assert float(LossOutput(terms={"a": t, "b": 2 * t}, weights={"a": 3.0, "b": 0.5}).loss) == 4.0


def test_a_nonfinite_stop_names_the_reduced_terms():
    def criterion(model, batch, ctx):
        x, y = batch
        err = (model(x) - y).abs().mean()
        return LossOutput(terms={"l1": err, "bad": err * float("nan")}, weights={"l1": 1.0, "bad": 1.0})

    engine = Engine(fakes.make_model(), criterion, fakes.config("nonfinite.policy=stop").engine, total_steps=2)
    with pytest.raises(NonFiniteError, match=r"loss terms over all workers \(unscaled means\): bad=nan, l1=\d"):
        engine.train_step([fakes.regression_data(n=4)])


def test_per_slot_names_a_count_the_task_did_not_declare():
    engine = Engine(
        nn.Linear(3, 1),
        _box_criterion([]),
        fakes.config().engine,
        total_steps=1,
        counts=lambda b: {"objects": 1},
        count_keys=("objects",),
        after_step=lambda m, s: None,
    )
    with pytest.raises(KeyError, match=r"ctx.totals has no 'boxes' \(it has \['objects'\]\)"):
        engine.train_step([{"x": torch.ones(2, 3)}])


# ---------------------------------------------------------------------- the DINO centre


def _dino_centre(rank: int, world: int):
    task = build_task("dino", {"out_dim": 16, "local_crops": 1})
    from raytrain_loops.config import load_config
    from raytrain_loops.recipes import resolve

    cfg = load_config(resolve("dino"), ["task.params.out_dim=16", "loop.max_steps=2"])
    torch.manual_seed(0)
    module = task.build_model()
    model = DDP(module)
    recorded = []

    def criterion(m, batch, ctx):
        out = task.criterion(m, batch, ctx)
        recorded.append((ctx.micro_index, out.stats["center"].clone()))
        return out

    engine = Engine(model, criterion, cfg.engine, total_steps=2, total_epochs=1, after_step=task.after_step)
    g = torch.Generator().manual_seed(rank)
    images = [(torch.rand(n, 1, 8, 8, generator=g), torch.zeros(n, dtype=torch.long)) for n in (4, 6)]
    batches = images if rank == 0 else [images[0], None]
    centre_before = module.center.clone()
    engine.train_step(batches)
    # Worker 1's second call is its zero-weight dummy: its outputs are not part of the mean.
    real = [s for i, s in recorded if rank == 0 or i == 0]
    return centre_before, module.center.clone(), torch.stack(real).sum(0)


def test_the_dino_centre_is_the_mean_over_every_workers_micro_batches():
    outcomes = run_gloo(2, _dino_centre)
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message + outcomes[1].message
    sums = outcomes[0].value[2] + outcomes[1].value[2]
    assert sums[-1] == 2 * (4 + 6 + 4)  # two global views per image of the three real micro-batches
    for o in outcomes:
        before, after, _ = o.value
        expected = before.clone()
        update_center(expected, sums, 0.9)
        torch.testing.assert_close(after, expected)
        assert not torch.equal(after, before)
