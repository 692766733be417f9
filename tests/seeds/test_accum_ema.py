"""ml-cvnets' accumulation on the sum and its EMA of the weights and BatchNorm statistics,
against plain-PyTorch transcriptions of the seed loop (``../shared/seeds/``, ml-cvnets
``train_epoch``) and of cvnets' ``EMA.update_parameters``; and the deliberate deviations that
touch them, each pinned by its own test. No Ray: the engine and the loop in this process."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.engine import Engine, LossOutput, schedule_value
from raytrain_loops.engine.optim import ema as ema_arithmetic
from tests.support import fakes
from tests.support.loops import run_loop

LR, MOMENTUM = 0.1, 0.9


def _sgd_config(*overrides: str):
    """SGD with momentum at a constant lr: an update's size follows its gradient's (AdamW's would
    hide a factor of K)."""
    base = ["optim.name=sgd", f"optim.momentum={MOMENTUM}", f"schedules.lr.value={LR}", "optim.param_groups=single"]
    return load_config(None, base + list(overrides))


def _micro_batches(n: int, size: int = 4, seed: int = 5):
    x, y = fakes.regression_data(n=n * size, seed=seed)
    return fakes.split(x, y, [size] * n)


def _cvnets_loop(model: nn.Module, micro: list, accum_freq_by_update: list[int], scale: float) -> None:
    """The seed's loop: backward on each micro-batch's loss times ``scale`` (1: cvnets; 1/K: our
    mean mode), one optimizer step and ``zero_grad`` every ``accum_freq`` micro-batches."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    optimizer.zero_grad()
    it = iter(micro)
    for accum_freq in accum_freq_by_update:
        for _ in range(accum_freq):
            x, y = next(it)
            loss = F.mse_loss(model(x), y)
            (loss * (scale if accum_freq > 1 else 1.0)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _engine_updates(reduce: str, micro: list, accum_freq_by_update: list[int]) -> nn.Module:
    """The engine over the same micro-batches: epoch 0 one per update, from epoch 1 on three
    (``accum.start_epoch=1``: cvnets' ``accum_after_epoch=0``)."""
    cfg = _sgd_config("accum.steps=3", "accum.start_epoch=1", f"accum.reduce={reduce}")
    engine = Engine(fakes.make_model(), fakes.mean_loss, cfg.engine, total_steps=len(accum_freq_by_update))
    at = 0
    for k in accum_freq_by_update:
        engine.epoch = 0 if k == 1 else 1
        assert engine.train_step(micro[at : at + k]).applied
        at += k
    return engine.module


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_accumulation_starting_mid_run_matches_the_seed_loop_on_the_sum_and_ours_on_the_mean(reduce):
    updates = [1, 1, 3, 3, 3]  # two single-batch updates (epoch 0), then three of 3 micro-batches
    micro = _micro_batches(sum(updates))
    reference = fakes.make_model()
    _cvnets_loop(reference, micro, updates, scale=1.0 if reduce == "sum" else 1 / 3)
    ours = _engine_updates(reduce, micro, updates)
    for name, p in reference.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], p, atol=1e-6, rtol=0, msg=name)


def test_sum_and_mean_agree_before_accumulation_starts_and_differ_after():
    micro = _micro_batches(5)
    before = [_engine_updates(r, micro, [1, 1]).state_dict() for r in ("sum", "mean")]
    assert all(torch.equal(before[0][n], before[1][n]) for n in before[0])
    after = [_engine_updates(r, micro, [1, 1, 3]).state_dict() for r in ("sum", "mean")]
    assert all(not torch.allclose(after[0][n], after[1][n], atol=1e-4) for n in after[0])


def test_an_elastic_group_running_twice_the_micro_batches_adds_up_accum_steps_worth():
    # Half the group: 6 micro-batches per worker where accum.steps=3; the full group's two workers
    # would each have summed 3 and DDP averaged them: (sum of the 6) / 2.
    micro = _micro_batches(6)
    cfg = _sgd_config("accum.steps=3", "accum.reduce=sum", "optim.momentum=0.0")
    engine = Engine(fakes.make_model(), fakes.mean_loss, cfg.engine, total_steps=1)
    start = fakes.params(engine.module)
    reference = fakes.make_model()
    for x, y in micro:
        F.mse_loss(reference(x), y).backward()
    assert engine.train_step(micro).applied
    for n, p in reference.named_parameters():
        torch.testing.assert_close(engine.module.state_dict()[n], start[n] - LR * p.grad / 2, atol=1e-6, rtol=0)


def test_accum_reduce_sum_under_a_summed_loss_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^accum\.reduce: .*set accum\.reduce=mean"):
        load_config(None, ["accum.reduce=sum", "loss.reduction=sum"])


# ---------------------------------------------------------------------- the EMA's buffers


class TinyBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8, momentum=0.3)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.fc(x))))


def _bn_engine(buffers: str, momentum: float = 0.9, arithmetic: str = "lerp"):
    torch.manual_seed(0)
    cfg = _sgd_config(
        "ema.enabled=true",
        f"ema.buffers={buffers}",
        f"schedules.ema_momentum.value={momentum}",
        f"ema.arithmetic={arithmetic}",
    )
    return Engine(TinyBN(), fakes.mean_loss, cfg.engine, total_steps=10)


def _cvnets_ema_update(ema_model: nn.Module, model: nn.Module, ema_momentum: float) -> None:
    """cvnets' ``EMA.update_parameters``, transcribed: every state-dict entry becomes
    ``ema * (1 - momentum) + momentum * model``, written back into the EMA's own tensor (an integer
    one truncates). cvnets' momentum is the model's weight: 1 - ours."""
    with torch.no_grad():
        msd = model.state_dict()
        for k, ema_v in ema_model.state_dict().items():
            model_v = msd[k].detach()
            ema_v.copy_((ema_v * (1.0 - ema_momentum)) + (ema_momentum * model_v))


def test_ema_buffers_average_follows_cvnets_ema_and_copies_the_batch_count():
    engine = _bn_engine("average", momentum=0.9)
    reference = copy.deepcopy(engine.ema.module)
    for batch in _micro_batches(4, size=8):
        assert engine.train_step([batch]).applied
        _cvnets_ema_update(reference, engine.module, 1 - 0.9)
    ours, theirs, model = engine.ema.module.state_dict(), reference.state_dict(), engine.module.state_dict()
    for name, v in theirs.items():
        if v.is_floating_point():
            torch.testing.assert_close(ours[name], v, atol=1e-6, rtol=0, msg=name)
    # The running statistics moved with the momentum: neither the model's nor the initial ones.
    assert not torch.allclose(ours["bn.running_mean"], model["bn.running_mean"])
    assert not torch.allclose(ours["bn.running_mean"], torch.zeros(8))
    # Deviation: num_batches_tracked is copied (4), where cvnets' truncated average stays at 0.
    assert int(ours["bn.num_batches_tracked"]) == int(model["bn.num_batches_tracked"]) == 4
    assert int(theirs["bn.num_batches_tracked"]) == 0


@pytest.mark.parametrize("group", [ema_arithmetic.GROUP, 5])
def test_ema_weighted_sum_is_cvnets_update_to_the_bit_where_lerp_is_not(monkeypatch, group):
    """``ema.arithmetic=weighted_sum`` (the cvnets_cls recipe's) gives cvnets' EMA bit for bit, the
    running statistics too; with groups of 5 elements the weights are split across groups."""
    monkeypatch.setattr(ema_arithmetic, "GROUP", group)
    engines = {a: _bn_engine("average", 0.9, arithmetic=a) for a in ("weighted_sum", "lerp")}
    reference = copy.deepcopy(engines["lerp"].ema.module)
    for batch in _micro_batches(4, size=8):
        assert all(e.train_step([batch]).applied for e in engines.values())
        _cvnets_ema_update(reference, engines["weighted_sum"].module, 1 - 0.9)
    theirs = {k: v for k, v in reference.state_dict().items() if v.is_floating_point()}
    ours, lerp = (engines[a].ema.module.state_dict() for a in ("weighted_sum", "lerp"))
    assert len(theirs) == 8 and all(torch.equal(ours[k], v) for k, v in theirs.items())
    assert not all(torch.equal(lerp[k], v) for k, v in theirs.items())


def test_ema_buffers_copy_takes_the_models_and_keep_leaves_the_emas_own():
    batches = _micro_batches(3, size=8)
    copying, keeping = _bn_engine("copy"), _bn_engine("keep")
    initial = fakes.params(keeping.ema.module)
    for batch in batches:
        assert copying.train_step([batch]).applied and keeping.train_step([batch]).applied
    model, ema = copying.module.state_dict(), copying.ema.module.state_dict()
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert torch.equal(ema[name], model[name]), name
        assert torch.equal(keeping.ema.module.state_dict()[name], initial[name]), name
    assert not torch.equal(keeping.module.state_dict()["bn.running_mean"], initial["bn.running_mean"])
    # The parameters are averaged in every mode.
    assert not torch.equal(ema["fc.weight"], model["fc.weight"])
    assert torch.equal(keeping.ema.module.state_dict()["fc.weight"], ema["fc.weight"])


def test_the_old_ema_copy_buffers_key_is_refused_naming_ema_buffers():
    for overrides in (["ema.copy_buffers=false"], ["ema.copy_buffers=true", "ema.enabled=true"]):
        with pytest.raises(ConfigError, match=r"^ema\.copy_buffers: was replaced by ema\.buffers"):
            load_config(None, overrides)
    with pytest.raises(ConfigError, match="ema.buffers: must be one of 'average', 'copy', 'keep'"):
        load_config(None, ["ema.buffers=mean"])
    with pytest.raises(ConfigError, match="ema.arithmetic: must be one of 'lerp', 'weighted_sum'"):
        load_config(None, ["ema.arithmetic=lerp_"])


def test_an_averaged_ema_resumes_exactly_from_its_checkpoint_in_the_same_format():
    batches = _micro_batches(4, size=8)
    straight = _bn_engine("average")
    for batch in batches[:2]:
        straight.train_step([batch])
    state = straight.state_dict()
    assert list(state["ema"]) == list(straight.module.state_dict())  # the module's own state dict, as before
    buf = io.BytesIO()
    torch.save(state, buf)
    resumed = _bn_engine("average")
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    for batch in batches[2:]:
        straight.train_step([batch])
        resumed.train_step([batch])
    for name, v in straight.ema.module.state_dict().items():
        assert torch.equal(resumed.ema.module.state_dict()[name], v), name


# ---------------------------------------------------------------------- deliberate deviations


def test_deviation_an_fp16_overflow_step_moves_neither_the_ema_nor_the_schedule():
    """DINO and cvnets update the teacher/EMA and advance the lr index on a step the loss scaler
    skipped; we count no update, so the EMA stays and the next update takes the skipped one's lr."""
    cfg = fakes.config(
        "precision.dtype=fp16",
        "precision.init_scale=1024",
        "ema.enabled=true",
        "schedules.ema_momentum.value=0.5",
        "schedules.lr.kind=cosine",
        "schedules.lr.end=0.0",
    )
    engine = Engine(fakes.make_model(), fakes.mean_loss, cfg.engine, total_steps=4)
    batches = _micro_batches(3, size=8)
    assert engine.train_step([batches[0]]).applied
    ema = fakes.params(engine.ema.module)

    def overflowing(model, batch, ctx):
        return LossOutput(fakes.mean_loss(model, batch, ctx).loss * 1e38)

    engine.loss_fn = overflowing
    skipped = engine.train_step([batches[1]])
    assert skipped.skipped == "overflow" and engine.step == 1
    assert all(torch.equal(v, ema[n]) for n, v in fakes.params(engine.ema.module).items())
    engine.loss_fn = fakes.mean_loss
    after = engine.train_step([batches[2]])
    lr_at = [schedule_value(cfg.schedules["lr"], s, 4) for s in range(3)]
    assert skipped.lr == after.lr == lr_at[1] != lr_at[2]
    assert not all(torch.equal(v, ema[n]) for n, v in fakes.params(engine.ema.module).items())


def test_deviation_the_epochs_leftover_micro_batch_is_read_and_dropped_without_a_forward():
    """cvnets runs forward and backward on an epoch's last ``batches % accum_freq`` batches and
    throws their gradients away at the next epoch's ``zero_grad``; we read them (the data stays
    in step on every worker) and run nothing on them."""
    calls = []

    def counting(model, batch, ctx):
        calls.append((ctx.step, ctx.epoch))
        return fakes.mean_loss(model, batch, ctx)

    # 7 batches an epoch, 2 micro-batches an update: 3 updates, batch 6 left over, in both epochs.
    engine, source, _ = run_loop("loop.epochs=2", "accum.steps=2", "accum.reduce=sum", loss_fn=counting)
    assert engine.step == 6 and engine.counts["micro_batches"] == 12
    assert len(calls) == 12  # no forward on the two leftovers
    assert source.yielded == [(e, i) for e in range(2) for i in range(7)]  # read to the end


def _cvnets_micro_batches_run(max_iterations: int, batches_per_epoch: int) -> int:
    """cvnets' stop, transcribed: before each micro-batch, ``if train_iterations > max_iterations:
    stop``; ``train_iterations`` counts micro-batches from 0 and grows after each."""
    train_iterations = 0
    while True:
        for _ in range(batches_per_epoch):
            if train_iterations > max_iterations:
                return train_iterations
            train_iterations += 1


@pytest.mark.parametrize("accum", [1, 2])
def test_deviation_the_run_stops_after_loop_max_steps_updates_not_one_micro_batch_more(accum):
    """cvnets' ``train_iterations > max_iterations`` stop runs ``max_iterations + 1`` micro-batches
    (and with accumulation, the last may be a leftover whose gradient is never applied). The
    engine stops after ``loop.max_steps`` updates, ``loop.max_steps x accum.steps``
    micro-batches: the run's length is a count of updates, as the schedules' ``n`` and the
    checkpoints' step are."""
    calls = []

    def counting(model, batch, ctx):
        calls.append(ctx.step)
        return fakes.mean_loss(model, batch, ctx)

    # 7 batches an epoch; 5 updates cross into the second epoch when accumulating.
    engine, _, reporter = run_loop("loop.max_steps=5", f"accum.steps={accum}", loss_fn=counting)
    assert engine.step == 5 and reporter.reports[-1]["metrics"]["step"] == 5
    assert len(calls) == engine.counts["micro_batches"] == 5 * accum
    assert _cvnets_micro_batches_run(5 * accum, 7) == 5 * accum + 1
