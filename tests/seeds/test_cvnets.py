"""ml-cvnets' ``train_epoch`` (``../shared/seeds/``, ml-cvnets ``engine/training_engine.py``)
transcribed into plain PyTorch, beside the engine and the loop driven by
``recipes/cvnets_cls.yaml``'s own config, with the data swapped for a tiny one and the model for
the recipe's own at toy width. No Ray: both in this process.

The transcription uses cvnets' helpers as apple/ml-cvnets defines them: ``CosineScheduler``
(warm-up from ``warmup_init_lr``, then a cosine of period ``max_iterations - warmup + 1``),
``AdjustBatchNormMomentum`` (the layers' momentum held through the warm-up, then a cosine over
``max_iterations - warmup``, rounded to 6 places), ``AdamWOptimizer`` (beta2 0.98 by default) over
``parameter_list`` with ``optim.no_decay_bn_filter_bias`` (1-D parameters undecayed), accumulation
from the epoch after ``accum_after_epoch`` on the sum of the micro-batches' gradients,
``clip_grad_norm_`` before each step, and ``EMA.update_parameters`` over the whole state dict after
it. Every per-iteration value is indexed by the optimizer update, not cvnets' micro-batch counter:
a deliberate deviation (docs/seeds.md), the same on both sides."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from raytrain_loops.config import load_config
from raytrain_loops.engine.update.precision import DTYPES
from raytrain_loops.recipes import resolve
from raytrain_loops.tasks.cvnets import CvnetsTask, set_bn_momentum
from tests.seeds.recipe_run import GroupValues, largest_difference, one_thread, run_loop, task_engine

PER_EPOCH, BATCH, UPDATES, WARMUP = 4, 8, 20, 5
ACCUM_AFTER_EPOCH = 1  # cvnets' accum_after_epoch: accumulation from epoch 2 on
# 20 updates: epochs 0-1 one micro-batch an update (8), epochs 2-7 two (12); the warm-ups shortened alike.
SHORT = [
    f"loop.max_steps={UPDATES}",
    f"accum.start_epoch={ACCUM_AFTER_EPOCH + 1}",
    f"schedules.lr.warmup_steps={WARMUP}",
    f"schedules.bn_momentum.warmup_steps={WARMUP}",
]
TINY = {"width": 4, "dropout": 0.0, "shift": 0}  # no random draws: the two sides see the same arithmetic


def _cosine_lr(t: int, s) -> float:
    """cvnets' ``CosineScheduler.get_lr`` at iteration ``t`` (``max_iterations`` = the run's updates)."""
    if t < s.warmup_steps:
        return s.warmup_start + t * (s.value - s.warmup_start) / s.warmup_steps
    period = UPDATES - s.warmup_steps + 1
    return s.end + 0.5 * (s.value - s.end) * (1 + math.cos(math.pi * (t - s.warmup_steps) / period))


def _bn_momentum(t: int, s) -> float | None:
    """cvnets' ``AdjustBatchNormMomentum.adjust_momentum`` at iteration ``t``: None (the layers keep
    their momentum) during the warm-up."""
    if t < s.warmup_steps:
        return None
    steps = UPDATES - s.warmup_steps
    return max(0.0, round(s.end + 0.5 * (s.value - s.end) * (1 + math.cos(math.pi * (t - s.warmup_steps) / steps)), 6))


def cvnets_reference(cfg, model, epochs) -> dict:
    """The seed's loop over ``epochs`` (lists of ``(x, y)`` micro-batches) until ``UPDATES`` updates:
    the forward and the loss under autocast in ``precision.dtype`` (cvnets' mixed precision), its
    ``GradScaler`` (fp16 only) unscaling before the clip."""
    model = copy.deepcopy(model)
    ema = copy.deepcopy(model)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim == 1]  # no_decay_bn_filter_bias
    wd = cfg.schedules["weight_decay"].value
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=0.0, betas=(0.9, 0.98), eps=1e-8)
    ema_weight = 1 - cfg.schedules["ema_momentum"].value  # cvnets' ema.momentum: the model's weight
    lr_s, bn_s = cfg.schedules["lr"], cfg.schedules["bn_momentum"]
    label_smoothing = cfg.task.params["label_smoothing"]
    update, lrs, wds = 0, [], []
    dtype = DTYPES.get(cfg.precision.dtype)
    scaler = torch.amp.GradScaler("cpu", init_scale=cfg.precision.init_scale, enabled=cfg.precision.dtype == "fp16")
    optimizer.zero_grad()
    for epoch, batches in enumerate(epochs):
        accum_freq = cfg.accum.steps if epoch > ACCUM_AFTER_EPOCH else 1
        for i, (x, y) in enumerate(batches):
            if update == UPDATES:
                break
            for g in optimizer.param_groups:
                g["lr"] = _cosine_lr(update, lr_s)
            momentum = _bn_momentum(update, bn_s)
            if momentum is not None:
                set_bn_momentum(model, momentum)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y, label_smoothing=label_smoothing)
            scaler.scale(loss).backward()  # summed over micro-batches
            if (i + 1) % accum_freq == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip.max_norm)
                lrs.append([g["lr"] for g in optimizer.param_groups])
                wds.append([g["weight_decay"] for g in optimizer.param_groups])
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                with torch.no_grad():
                    msd = model.state_dict()
                    for k, v in ema.state_dict().items():
                        v.copy_(v * (1.0 - ema_weight) + ema_weight * msd[k])
                update += 1
    return {"model": model, "ema": ema, "lr": lrs, "wd": wds, "scale": scaler.get_scale() if dtype else None}


# fp32; fp16 autocast with cvnets' GradScaler at its initial scale (torch's default, 2^16), at
# which no update overflows (an overflow step is a deliberate deviation); bf16 autocast without one.
PRECISIONS = {
    "fp32": ["precision.dtype=fp32"],
    "fp16": ["precision.dtype=fp16", "precision.init_scale=65536"],
    "bf16": ["precision.dtype=bf16"],
}


@pytest.mark.parametrize("dtype", list(PRECISIONS))
def test_the_cvnets_recipe_reproduces_cvnets_train_epoch_update_for_update(dtype):
    cfg = load_config(resolve("cvnets_cls"), SHORT + PRECISIONS[dtype])
    task = CvnetsTask(**{**cfg.task.params, **TINY})
    g = torch.Generator().manual_seed(1)
    epochs = [
        [(torch.randn(BATCH, 1, 8, 8, generator=g), torch.randint(10, (BATCH,), generator=g)) for _ in range(PER_EPOCH)]
        for _ in range(8)
    ]
    with one_thread():
        torch.manual_seed(0)
        model = task.build_model()
        reference = cvnets_reference(cfg, model, epochs)
        engine = task_engine(task, model, cfg, PER_EPOCH)
        groups = GroupValues(engine)
        run_loop(engine, cfg, epochs, [groups])
    assert engine.step == UPDATES
    if dtype == "fp16":
        assert reference["scale"] == cfg.precision.init_scale == engine.scaler.get_scale()
    torch.testing.assert_close(groups.lr, reference["lr"], rtol=1e-12, atol=0)
    torch.testing.assert_close(groups.wd, reference["wd"], rtol=0, atol=0)
    worst = largest_difference(engine.module.state_dict(), reference["model"].state_dict())
    # The EMA's num_batches_tracked: copied here, truncated by cvnets (a deviation, pinned in
    # test_accum_ema.py); every other entry compared.
    ours_ema, their_ema = engine.ema.module.state_dict(), reference["ema"].state_dict()
    counts = [k for k in their_ema if k.endswith("num_batches_tracked")]
    model_state = engine.module.state_dict()
    assert counts and all(int(their_ema[k]) < int(ours_ema[k]) == int(model_state[k]) for k in counts)
    worst_ema = largest_difference(*({k: v for k, v in s.items() if k not in counts} for s in (ours_ema, their_ema)))
    print(f"cvnets {dtype}: largest difference after {UPDATES} updates: model {worst:.3g}, EMA {worst_ema:.3g}")
