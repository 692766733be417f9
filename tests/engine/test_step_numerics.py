"""Single-process checks of the step's numerics against the seed loops' formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from raytrain_loops.config import load_config
from raytrain_loops.engine import Engine, LossOutput, LossScaleError, NonFiniteError, schedule_value
from raytrain_loops.engine.length import epochs_in_run
from raytrain_loops.engine.loop import accum_steps, timed_groups
from tests.support import fakes


def _batches(n_steps: int, size: int = 8, seed: int = 1):
    x, y = fakes.regression_data(n=n_steps * size, seed=seed)
    return fakes.split(x, y, [size] * n_steps)


def _grads(model, batch):
    model.zero_grad()
    fakes.mean_loss(model, batch, None).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_fp16_overflow_skips_update_and_leaves_parameters_and_ema_unchanged():
    cfg = fakes.config(
        "precision.dtype=fp16", "precision.init_scale=1024", "ema.enabled=true", "schedules.ema_momentum.value=0.5"
    )
    engine = Engine(fakes.make_model(), fakes.mean_loss, cfg.engine, total_steps=10)
    b = _batches(3)
    assert engine.train_step([b[0]]).applied
    params, ema = fakes.params(engine.module), fakes.params(engine.ema.module)
    scale = engine.scaler.get_scale()

    def overflowing(model, batch, ctx):
        out = fakes.mean_loss(model, batch, ctx)
        return LossOutput(out.loss * 1e38)  # x 65536 scale overflows fp32 in backward

    engine.loss_fn = overflowing
    result = engine.train_step([b[1]])
    assert (result.applied, result.skipped) == (False, "overflow")
    assert engine.step == 1 and engine.counts["overflow"] == 1
    assert engine.scaler.get_scale() == scale / 2
    for name, p in fakes.params(engine.module).items():
        assert torch.equal(p, params[name]), name
    for name, p in fakes.params(engine.ema.module).items():
        assert torch.equal(p, ema[name]), name
    engine.loss_fn = fakes.mean_loss
    assert engine.train_step([b[2]]).applied and engine.step == 2


def test_fp16_scale_below_floor_stops_with_clear_error():
    cfg = fakes.config("precision.dtype=fp16", "precision.init_scale=1024", "precision.min_scale=100")
    engine = Engine(
        fakes.make_model(),
        lambda m, b, c: LossOutput(fakes.mean_loss(m, b, c).loss * math.inf),
        cfg.engine,
        total_steps=10,
    )
    b = _batches(1)[0]
    for _ in range(3):  # 1024 -> 512 -> 256 -> 128: still above the floor
        assert engine.train_step([b]).skipped == "overflow"
    with pytest.raises(LossScaleError, match=r"fell to 64, below precision.min_scale=100"):
        engine.train_step([b])


def test_global_clipping_matches_clip_grad_norm():
    b = _batches(1)[0]
    ref = fakes.make_model()
    ref.zero_grad()
    fakes.mean_loss(ref, b, None).loss.backward()
    total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    assert total > 0.05, "the test must actually clip"
    expected = {n: p.detach() - p.grad for n, p in ref.named_parameters()}
    engine = Engine(
        fakes.make_model(),
        fakes.mean_loss,
        fakes.config("clip.mode=global", "clip.max_norm=0.05").engine,
        total_steps=1,
    )
    result = engine.train_step([b])
    assert result.grad_norm == pytest.approx(total.item(), rel=1e-5)
    for n, p in engine.module.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n], atol=1e-7, rtol=0)


def test_per_parameter_clipping_behaves_as_in_dino():
    b = _batches(1)[0]
    grads = _grads(fakes.make_model(), b)
    max_norm = 0.5
    start = fakes.params(fakes.make_model())
    clipped = []
    expected = {}
    for n, g in grads.items():
        coef = max_norm / (g.norm() + 1e-6)  # DINO's utils.clip_gradients
        if coef < 1:
            g = g * coef
            clipped.append(n)
        expected[n] = start[n] - g
    assert clipped and len(clipped) < len(grads), "some tensors must be clipped and some not"
    engine = Engine(
        fakes.make_model(),
        fakes.mean_loss,
        fakes.config("clip.mode=per_param", f"clip.max_norm={max_norm}").engine,
        total_steps=1,
    )
    engine.train_step([b])
    for n, p in engine.module.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n], atol=1e-7, rtol=0, msg=n)


def test_last_layer_is_frozen_during_its_epochs_only():
    cfg = load_config(
        None,
        [
            "freeze.last_layer_epochs=1",
            "freeze.last_layer_pattern=^head\\.",
            "optim.name=adamw",
            "schedules.weight_decay.value=0.1",
        ],
    )
    engine = Engine(fakes.make_model(), fakes.mean_loss, cfg.engine, total_steps=6)
    b = _batches(6)
    head = fakes.params(engine.module.head)
    enc = fakes.params(engine.module.encoder)
    for i in range(3):
        assert engine.train_step([b[i]]).applied
    for n, p in fakes.params(engine.module.head).items():
        assert torch.equal(p, head[n]), f"head.{n} moved in epoch 0"
    assert not torch.equal(engine.module.encoder.weight, enc["weight"])
    engine.epoch = 1
    engine.train_step([b[3]])
    assert not torch.equal(engine.module.head.weight, head["weight"]), "head must train from epoch 1"


def test_frozen_pattern_matching_nothing_is_rejected():
    with pytest.raises(ValueError, match="matches no parameter"):
        Engine(
            fakes.make_model(),
            fakes.mean_loss,
            load_config(None, ["freeze.last_layer_epochs=1", "freeze.last_layer_pattern=nope"]).engine,
            total_steps=1,
        )


def test_weight_decay_schedule_applies_to_first_group_only():
    cfg = fakes.config(
        "optim.param_groups=decay_split",
        "schedules.lr.value=0.5",
        "schedules.weight_decay.kind=cosine",
        "schedules.weight_decay.value=0.04",
        "schedules.weight_decay.end=0.4",
    )
    zero_grad_loss = lambda m, b, c: LossOutput(m(b[0]).sum() * 0.0)  # noqa: E731 - only weight decay acts
    engine = Engine(fakes.make_model(), zero_grad_loss, cfg.engine, total_steps=5)
    groups = engine.optimizer.param_groups
    assert groups[0]["param_names"] == ["encoder.weight", "head.weight"]
    assert set(groups[1]["param_names"]) == {"encoder.bias", "norm.weight", "norm.bias", "head.bias"}
    b = _batches(5)
    for step in range(5):
        before = fakes.params(engine.module)
        engine.train_step([b[step]])
        wd = schedule_value(cfg.schedules["weight_decay"], step, 5)
        assert groups[0]["weight_decay"] == wd and groups[1]["weight_decay"] == 0.0
        after = fakes.params(engine.module)
        torch.testing.assert_close(after["encoder.weight"], before["encoder.weight"] * (1 - 0.5 * wd))
        for n in groups[1]["param_names"]:
            assert torch.equal(after[n], before[n]), n
    assert wd == pytest.approx(0.4)


def test_ema_follows_its_momentum_schedule():
    cfg = fakes.config(
        "ema.enabled=true",
        "schedules.ema_momentum.kind=cosine",
        "schedules.ema_momentum.value=0.9",
        "schedules.ema_momentum.end=1.0",
    )
    engine = Engine(fakes.make_model(), fakes.mean_loss, cfg.engine, total_steps=3)
    b = _batches(3)
    for step in range(3):
        ema_before = fakes.params(engine.ema.module)
        engine.train_step([b[step]])
        m = schedule_value(cfg.schedules["ema_momentum"], step, 3)
        model = fakes.params(engine.module)
        for n, v in fakes.params(engine.ema.module).items():
            torch.testing.assert_close(v, m * ema_before[n] + (1 - m) * model[n])
    assert m == 1.0 and all(torch.equal(v, ema_before[n]) for n, v in fakes.params(engine.ema.module).items())


@pytest.mark.parametrize("where,name", [("input", "encoder"), ("head", "head")])
def test_nonfinite_stop_names_the_first_module(where, name):
    engine = Engine(fakes.make_model(), fakes.mean_loss, fakes.config().engine, total_steps=2)
    x, y = _batches(1)[0]
    if where == "input":
        x = x.clone()
        x[0, 0] = math.nan
    else:
        with torch.no_grad():
            engine.module.head.weight[0, 0] = math.nan
    with pytest.raises(NonFiniteError, match=f"module '{name}'"):
        engine.train_step([(x, y)])


def test_nonfinite_skip_stops_after_max_consecutive():
    engine = Engine(
        fakes.make_model(),
        lambda m, b, c: LossOutput(m(b[0]).sum() * math.nan),
        fakes.config("nonfinite.policy=skip", "nonfinite.max_consecutive=3").engine,
        total_steps=5,
    )
    b = _batches(1)[0]
    assert [engine.train_step([b]).skipped for _ in range(2)] == ["nonfinite", "nonfinite"]
    with pytest.raises(NonFiniteError, match="3 updates in a row"):
        engine.train_step([b])


def test_bf16_autocast_runs_forward_in_bf16_and_learns():
    seen = []
    model = fakes.make_model()
    model.encoder.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    engine = Engine(
        model,
        fakes.mean_loss,
        load_config(None, ["precision.dtype=bf16", "schedules.lr.value=0.01"]).engine,
        total_steps=60,
    )
    x, y = fakes.regression_data(n=64)
    losses = [engine.train_step([(x, y)]).loss for _ in range(60)]
    assert seen[0] == torch.bfloat16
    assert losses[-1] < 0.8 * losses[0]


def test_metrics_are_weighted_means_over_the_interval():
    engine = Engine(
        fakes.make_model(),
        fakes.sum_loss,
        fakes.config("loss.reduction=sum", "schedules.lr.value=0.0").engine,
        total_steps=2,
    )
    x, y = fakes.regression_data(n=12)
    r1 = engine.train_step(fakes.split(x, y, [2, 4]))
    r2 = engine.train_step(fakes.split(x[6:], y[6:], [6]))
    m = engine.reduce_metrics()
    assert m["loss"] == pytest.approx((r1.loss * 6 + r2.loss * 6) / 12)
    assert m["mse"] == pytest.approx(m["loss"])  # logs weighted by sample size too
    assert m["sample_size"] == 6 and m["step"] == 2
    assert engine.reduce_metrics().keys() == {"step", "epoch", "overflow", "nonfinite", "oom"}  # reset after reading


def test_timed_groups_and_accumulation_start_epoch():
    import time

    def slow():
        for i in range(5):
            time.sleep(0.01)
            yield i

    groups = list(timed_groups(slow(), 2))
    assert [g for g, _ in groups] == [[0, 1], [2, 3], [4]]
    assert all(wait >= 0.01 for _, wait in groups)
    cfg = load_config(None, ["accum.steps=4", "accum.start_epoch=2"]).accum
    assert [accum_steps(cfg, e) for e in range(4)] == [1, 1, 4, 4]


def test_schedules_are_pure_functions_of_the_step():
    cfg = load_config(
        None,
        [
            "schedules.lr.kind=cosine",
            "schedules.lr.value=1.0",
            "schedules.lr.end=0.1",
            "schedules.lr.warmup_steps=10",
            "schedules.lr.warmup_start=0.0",
        ],
    )
    s = cfg.schedules["lr"]
    assert [schedule_value(s, i, 110) for i in (0, 5, 10)] == [0.0, 0.5, 1.0]
    assert schedule_value(s, 60, 110) == pytest.approx(0.55, abs=0.01)
    assert schedule_value(s, 109, 110) == pytest.approx(0.1)
    lin = load_config(None, ["schedules.lr.kind=linear", "schedules.lr.value=1.0", "schedules.lr.end=0.0"]).schedules[
        "lr"
    ]
    assert schedule_value(lin, 0, 11) == 1.0 and schedule_value(lin, 5, 11) == pytest.approx(0.5)
    step = load_config(
        None,
        ["schedules.lr.kind=step", "schedules.lr.value=1.0", "schedules.lr.milestones=[3,6]", "schedules.lr.gamma=0.5"],
    ).schedules["lr"]
    assert [schedule_value(step, i, 10) for i in (2, 3, 6)] == [1.0, 0.5, 0.25]


def test_poly_schedule_follows_seamseg_and_ends_at_its_end():
    poly = load_config(None, ["schedules.lr.kind=poly", "schedules.lr.value=1.0"]).schedules["lr"]
    assert poly.power == 0.9  # seamseg's default
    # 1 - progress over the 10 steps after warm-up: 1, 8/9, ..., 0
    assert [schedule_value(poly, i, 10) for i in (0, 3, 9)] == pytest.approx([1.0, (6 / 9) ** 0.9, 0.0])
    warm = load_config(
        None,
        [
            "schedules.lr.kind=poly",
            "schedules.lr.value=1.0",
            "schedules.lr.end=0.1",
            "schedules.lr.power=2.0",
            "schedules.lr.warmup_steps=4",
        ],
    ).schedules["lr"]
    assert [schedule_value(warm, i, 14) for i in (0, 2, 4)] == [0.0, 0.5, 1.0]
    assert schedule_value(warm, 4 + 3, 14) == pytest.approx(0.1 + 0.9 * (1 - 3 / 9) ** 2)
    assert schedule_value(warm, 13, 14) == pytest.approx(0.1)


def test_per_epoch_schedules_follow_the_epoch_and_count_warmup_and_milestones_in_epochs():
    def sched(*overrides):
        return load_config(None, ["loop.epochs=10", "schedules.lr.per=epoch", *overrides]).schedules["lr"]

    poly = sched("schedules.lr.kind=poly", "schedules.lr.value=1.0", "schedules.lr.warmup_steps=2")
    # The step does not matter, the epoch does: warm-up over epochs 0-1, then 1 - (e - 2) / 7.
    assert schedule_value(poly, 0, 1000, 1, 10) == schedule_value(poly, 999, 1000, 1, 10) == 0.5
    assert schedule_value(poly, 5, 1000, 2, 10) == 1.0
    assert schedule_value(poly, 5, 1000, 5, 10) == pytest.approx((4 / 7) ** 0.9)
    assert schedule_value(poly, 5, 1000, 9, 10) == 0.0
    step = sched("schedules.lr.kind=step", "schedules.lr.value=1.0", "schedules.lr.milestones=[3,6]")
    assert [schedule_value(step, 1, 1000, e, 10) for e in (2, 3, 6)] == [1.0, 0.1, pytest.approx(0.01)]
    # The engine evaluates them at its epoch (which the loop sets and a checkpoint restores).
    cfg = load_config(
        None, ["loop.epochs=10", "schedules.lr.per=epoch", "schedules.lr.kind=poly", "schedules.lr.value=1"]
    )
    engine = Engine(fakes.make_model(), fakes.mean_loss, cfg.engine, total_steps=100, total_epochs=10)
    engine.epoch = 5
    assert engine.schedule_values()["lr"] == pytest.approx((4 / 9) ** 0.9)
    with pytest.raises(ValueError, match="total_epochs"):
        Engine(fakes.make_model(), fakes.mean_loss, cfg.engine, total_steps=100)


def test_the_runs_epochs_for_per_epoch_schedules_follow_loop_epochs_or_max_steps():
    # 10 batches per worker: 10 updates per epoch before accum.start_epoch=2, then 2 (5 micro-batches each).
    cfg = load_config(None, ["loop.epochs=4", "accum.steps=5", "accum.start_epoch=2"])
    assert epochs_in_run(cfg.loop, cfg.accum, 10) == 4
    cfg.loop.max_steps = 21  # epochs 0-1 hold 20 updates: the 21st falls in epoch 2
    assert epochs_in_run(cfg.loop, cfg.accum, 10) == 3
    cfg.loop.max_steps = 30  # past loop.epochs: 20 + 2 * 5 updates end in epoch 6
    assert epochs_in_run(cfg.loop, cfg.accum, 10) == 7


def test_criterion_sees_named_schedule_values():
    seen = []

    def loss(m, b, ctx):
        seen.append(ctx.values["teacher_temp"])
        return fakes.mean_loss(m, b, ctx)

    cfg = load_config({"schedules": {"teacher_temp": {"value": 0.07, "warmup_steps": 2, "warmup_start": 0.04}}})
    engine = Engine(fakes.make_model(), loss, cfg.engine, total_steps=3)
    for b in _batches(3):
        engine.train_step([b])
    assert seen == pytest.approx([0.04, 0.055, 0.07])


def test_sum_mode_divides_by_sample_size_not_batch_count():
    # sample_size from the criterion (e.g. tokens), not len(batch): gradient = sum / total size.
    def token_loss(m, b, ctx):
        x, y = b
        return LossOutput(F.mse_loss(m(x), y, reduction="sum"), sample_size=3 * len(x))

    x, y = fakes.regression_data(n=8)
    ref = fakes.make_model()
    ref.zero_grad()
    (F.mse_loss(ref(x), y, reduction="sum") / 24).backward()
    engine = Engine(fakes.make_model(), token_loss, fakes.config("loss.reduction=sum").engine, total_steps=1)
    engine.train_step(fakes.split(x, y, [5, 3]))
    for n, p in engine.module.named_parameters():
        torch.testing.assert_close(
            p.detach(),
            dict(ref.named_parameters())[n].detach() - dict(ref.named_parameters())[n].grad,
            atol=1e-6,
            rtol=0,
        )


def test_an_infinite_gradient_under_a_finite_loss_is_traced_to_its_parameter():
    torch.manual_seed(0)
    engine = Engine(fakes.RootOfZero(), fakes.mean_loss, fakes.config("nonfinite.policy=stop").engine, total_steps=2)
    (batch,) = _batches(1)
    assert math.isfinite(float(fakes.mean_loss(engine.module, batch, None).loss))
    with pytest.raises(NonFiniteError, match=r"first seen in the gradient of parameter 'p'$"):
        engine.train_step([batch])
    assert engine.step == 0 and all(p.grad is None for p in engine.module.parameters())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_step_without_data_is_skipped_as_empty_not_as_non_finite(reduction):
    cfg = fakes.config(f"loss.reduction={reduction}", "nonfinite.policy=stop")
    engine = Engine(
        fakes.make_model(), fakes.sum_loss if reduction == "sum" else fakes.mean_loss, cfg.engine, total_steps=3
    )
    before = fakes.params(engine.module)
    assert engine.train_step([None, None]).skipped == "empty"  # no worker had a batch: no error under stop
    assert engine.counts["nonfinite"] == 0 and engine.step == 0
    assert all(torch.equal(v, engine.module.state_dict()[k]) for k, v in before.items())
    assert engine.train_step(_batches(1)).applied and engine.step == 1


def test_a_batch_of_zero_units_in_sum_mode_is_an_empty_step():
    def no_units(model, batch, ctx):
        return LossOutput(fakes.sum_loss(model, batch, ctx).loss * 0.0, sample_size=0)

    engine = Engine(fakes.make_model(), no_units, fakes.config("loss.reduction=sum").engine, total_steps=2)
    assert engine.train_step(_batches(1)).skipped == "empty" and engine.counts["nonfinite"] == 0


def test_fp16_an_empty_step_keeps_the_loss_scale_and_the_next_step_runs():
    cfg = fakes.config("loss.reduction=sum", "precision.dtype=fp16", "precision.init_scale=256")
    engine = Engine(fakes.make_model(), fakes.sum_loss, cfg.engine, total_steps=4)
    batches = _batches(2)
    for i, batch in enumerate([None, batches[0], None, batches[1]]):  # the first step may be empty too
        scaler = engine.scaler.state_dict()
        result = engine.train_step([batch])
        assert result.skipped == (None if batch else "empty"), i
        if batch is None:
            assert engine.scaler.state_dict() == scaler  # neither an overflow nor a step without one
    assert engine.step == 2 and engine.counts["overflow"] == 0
