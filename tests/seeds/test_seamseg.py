"""seamseg's ``train`` (``../shared/seeds/``, mapillary/seamseg ``scripts/train_detection.py``)
transcribed into plain PyTorch, beside the engine driven by ``recipes/seamseg.yaml``'s own
``schedules``, ``optim.param_groups``, ``loss`` and ``task.params.loss_weights``, with seamseg's
optimizer (``optim.name=sgd``, ``optim.momentum``, ``optim.nesterov``) in place of the recipe's
AdamW, which the recipe keeps as a deliberate deviation (docs/seeds.md: measured). No Ray.

The transcription follows seamseg's helpers as its repository defines them: ``make_optimizer``
(SGD with momentum and Nesterov over two groups, the norm layers' parameters and the others; the
norm group decayed as ``weight_decay_norm=yes`` has it, and trained as ``bn_frozen=no`` has it),
``scheduler_from_config`` (a ``LambdaLR`` of ``(1 - it / count) ** gamma`` per batch, ``count`` the
run's updates, wrapped in ``BurnInLR(steps, start)`` from ``seamseg/utils/scheduler.py``), and
``train`` (``global_step += 1`` then ``scheduler.step(global_step)`` before each batch; each named
loss a mean, their sum weighted by ``loss_weights``; ``zero_grad``, ``backward``, ``step``). The
model is tiny: a convolution, a BatchNorm with seamseg's leaky ReLU (``InPlaceABN``'s default
activation), and the ``obj``, ``bbx`` and ``sem`` heads on dict batches."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.engine import Engine, LossOutput
from raytrain_loops.recipes import resolve

UPDATES, BURN_IN = 20, 5  # the recipe's run and 30 updates of burn-in, shortened alike on both sides
TERMS = ("obj", "bbx", "sem")  # the order of the recipe's loss_weights
NORM_LAYERS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm)  # seamseg's NORM_LAYERS, less inplace_abn's ABN


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread for these tiny tensors: on a shared machine several threads wait on each
    other for longer than the work takes (seconds instead of a tenth of one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TinySeg(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.obj = nn.Conv2d(6, 1, 1)
        self.bbx = nn.Conv2d(6, 4, 1)
        self.sem = nn.Conv2d(6, 3, 1)

    def forward(self, img):
        x = F.leaky_relu(self.bn(self.body(img)), 0.01)
        return self.obj(x), self.bbx(x), self.sem(x)


def _model() -> TinySeg:
    torch.manual_seed(0)
    return TinySeg()


def _batch(update: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(update)
    n = 2 + update % 3
    return {
        "img": torch.randn(n, 3, 8, 8, generator=g),
        "obj": (torch.rand(n, 1, 8, 8, generator=g) > 0.8).float(),
        "bbx": torch.rand(n, 4, 8, 8, generator=g),
        "sem": torch.randint(0, 3, (n, 8, 8), generator=g),
    }


def _losses(model: nn.Module, batch: dict[str, torch.Tensor]) -> OrderedDict[str, torch.Tensor]:
    """The named losses, each a mean over the batch, in the order of ``loss_weights``."""
    obj, bbx, sem = model(batch["img"])
    return OrderedDict(
        obj=F.binary_cross_entropy_with_logits(obj, batch["obj"]),
        bbx=F.l1_loss(bbx, batch["bbx"]),
        sem=F.cross_entropy(sem, batch["sem"]),
    )


# ---------------------------------------------------------------------- the transcription


class PolyBurnIn:
    """seamseg's poly ``LambdaLR`` wrapped in ``BurnInLR``, with its scheduler's own ``step(epoch)``:
    the wrapper takes ``last_epoch = epoch``, sets each group's lr from ``get_lr`` (the burn-in's
    ``base_lr * (epoch * (1 - start) / steps + start)`` up to ``steps``, then the poly read at the
    wrapped scheduler's ``last_epoch``, which is advanced only afterwards), then advances it."""

    def __init__(self, optimizer: torch.optim.Optimizer, count: int, gamma: float, steps: int, start: float):
        self.optimizer, self.count, self.gamma, self.steps, self.start = optimizer, count, gamma, steps, start
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.poly_last_epoch = -1  # LambdaLR's __init__ leaves last_epoch at -1
        self.step(0)  # BurnInLR's __init__: step(last_epoch + 1), the wrapped scheduler's last_epoch = 0

    def _lr(self, base_lr: float, epoch: int) -> float:
        if epoch <= self.steps:
            return base_lr * (epoch * (1.0 - self.start) / self.steps + self.start)
        return base_lr * (1 - float(self.poly_last_epoch) / self.count) ** self.gamma

    def step(self, epoch: int) -> None:
        for group, base_lr in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = self._lr(base_lr, epoch)
        self.poly_last_epoch = epoch


def _seamseg_optimizer(model: nn.Module, optim, lr: float, weight_decay: float) -> torch.optim.SGD:
    """``make_optimizer`` with ``weight_decay_norm=yes`` and ``bn_frozen=no``."""
    norm = [p for m in model.modules() if isinstance(m, NORM_LAYERS) for p in m.parameters()]
    other = [p for m in model.modules() if isinstance(m, nn.Conv2d) for p in m.parameters()]
    assert len(norm) + len(other) == len(list(model.parameters()))
    groups = [
        {"params": norm, "lr": lr, "weight_decay": weight_decay},
        {"params": other, "lr": lr, "weight_decay": weight_decay},
    ]
    return torch.optim.SGD(groups, momentum=optim.momentum, nesterov=optim.nesterov)


def _seamseg_train(cfg) -> tuple[nn.Module, list[list[tuple[float, float]]]]:
    model = _model()
    sched = cfg.schedules["lr"]
    optimizer = _seamseg_optimizer(model, cfg.optim, sched.value, cfg.schedules["weight_decay"].value)
    scheduler = PolyBurnIn(optimizer, UPDATES, sched.power, sched.warmup_steps, sched.warmup_start / sched.value)
    weights = cfg.task.params["loss_weights"]
    model.train()
    optimizer.zero_grad()
    groups = []
    for update in range(UPDATES):
        global_step = update + 1  # seamseg's global_step += 1 (from 0), before the scheduler's step
        scheduler.step(global_step)
        losses = _losses(model, _batch(update))
        losses["loss"] = sum(w * loss for w, loss in zip(weights, losses.values(), strict=False))
        optimizer.zero_grad()
        losses["loss"].backward()
        optimizer.step()
        groups.append([(g["lr"], g["weight_decay"]) for g in optimizer.param_groups])
    return model, groups


# ---------------------------------------------------------------------- the engine beside it


SEAMSEG_SGD = ["optim.name=sgd", "optim.momentum=0.9", "optim.nesterov=true"]  # seamseg's [optimizer]


def _recipe():
    return load_config(resolve("seamseg"), [f"schedules.lr.warmup_steps={BURN_IN}", *SEAMSEG_SGD])


def _engine_train(cfg) -> tuple[Engine, list[list[tuple[float, float]]]]:
    weights = dict(zip(TERMS, cfg.task.params["loss_weights"], strict=True))

    def criterion(model, batch, ctx):
        return LossOutput(terms=dict(_losses(model, batch)), weights=weights, sample_size=len(batch["img"]))

    engine = Engine(_model(), criterion, cfg.engine, total_steps=UPDATES)
    groups = []
    for update in range(UPDATES):
        assert engine.train_step([_batch(update)]).applied
        groups.append([(g["lr"], g["weight_decay"]) for g in engine.optimizer.param_groups])
    return engine, groups


def test_the_seamseg_recipe_with_seamsegs_sgd_reproduces_seamsegs_train_update_for_update():
    cfg = _recipe()
    reference, theirs = _seamseg_train(cfg)
    engine, ours = _engine_train(cfg)
    start = _model().state_dict()
    largest = 0.0
    for name, v in reference.state_dict().items():  # parameters and BatchNorm's buffers
        assert not torch.equal(v, start[name]), f"{name} did not move"
        largest = max(largest, (engine.module.state_dict()[name] - v).abs().max().item())
    assert largest <= 1e-6
    # Each of seamseg's two groups has the lr and weight decay of the engine's one group.
    for u, (t, o) in enumerate(zip(theirs, ours, strict=True)):
        ((lr, wd),) = o
        for their_lr, their_wd in t:
            assert lr == pytest.approx(their_lr, rel=1e-12) and wd == their_wd == 1e-4, u
    lrs = [o[0][0] for o in ours]  # burn-in from lr * burn_in_start, one step in at update 0; then the poly
    peak = cfg.schedules["lr"].value
    assert lrs[BURN_IN - 1] == pytest.approx(peak) and lrs[0] < peak / 4 and 0 < lrs[-1] < peak / 10


def test_optim_nesterov_needs_sgd_with_momentum_and_says_so_naming_the_key():
    for overrides, got in (
        (["optim.nesterov=true"], "name=adamw"),
        (["optim.name=sgd", "optim.momentum=0", "optim.nesterov=true"], "momentum=0.0"),
    ):
        with pytest.raises(ConfigError, match=rf"^optim\.nesterov: .*needs name=sgd and momentum > 0; got {got}$"):
            load_config(None, overrides)
    sgd = load_config(None, ["optim.name=sgd", "optim.nesterov=true"]).engine
    engine = Engine(_model(), lambda m, b, c: LossOutput(m(b)[0].sum()), sgd, total_steps=1)
    assert all(g["nesterov"] and g["momentum"] == 0.9 for g in engine.optimizer.param_groups)


def test_deviation_the_seamseg_recipe_keeps_adamw_over_seamsegs_sgd():
    """seamseg's optimizer is SGD with momentum 0.9 and Nesterov; the recipe keeps AdamW, which
    reached a higher mean IoU on this recipe's data in the same number of updates than SGD with
    Nesterov at any of the learning rates tried, seamseg's default 0.01 included (docs/seeds.md).
    Everything else the recipe sets as seamseg does: one group decaying every parameter, the poly
    under BurnInLR."""
    cfg = load_config(resolve("seamseg"), [])
    assert (cfg.optim.name, cfg.optim.nesterov) == ("adamw", False)
    assert cfg.optim.param_groups == "single" and cfg.schedules["lr"].convention == "seamseg"
    seamseg = load_config(resolve("seamseg"), SEAMSEG_SGD)
    assert (seamseg.optim.name, seamseg.optim.momentum, seamseg.optim.nesterov) == ("sgd", 0.9, True)
