"""DINO's ``train_one_epoch`` (``../shared/seeds/``, DINO ``main_dino.py``) transcribed into plain
PyTorch, beside the engine and the loop driven by ``recipes/dino.yaml``'s own config, with the
model and the data swapped for tiny ones. No Ray: both in this process.

The transcription follows DINO's helpers as facebookresearch/dino defines them: ``utils.py``
``cosine_scheduler`` (lr with a warm-up, weight decay, teacher momentum), ``clip_gradients``
(each parameter's gradient clipped on its own), ``cancel_gradients_last_layer`` (the last
layer's gradients dropped during the first epochs), ``get_params_groups`` (biases and 1-D
parameters undecayed), ``main_dino.py``'s ``DINOLoss`` (per-epoch teacher temperature, the
centre updated in the loss) and ``MultiCropWrapper`` (one backbone pass per run of crops of
one resolution). The student and teacher are the recipe's own ``DinoModel`` at toy size, the
crops the task's own augmentations drawn once; the engine side runs the task's criterion."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raytrain_loops.config import load_config
from raytrain_loops.engine.loop import Callback
from raytrain_loops.engine.optim.ema import EMA
from raytrain_loops.engine.update.precision import DTYPES
from raytrain_loops.recipes import resolve
from raytrain_loops.tasks.dino import TEACHER_TEMP, DinoTask, dino_loss
from tests.seeds.recipe_run import GroupValues, largest_difference, one_thread, run_loop, task_engine

EPOCHS, PER_EPOCH, IMAGES = 4, 5, 6
# The run is 20 updates: the warm-ups shrink with it (DINO asserts a warm-up shorter than the
# run): the lr's to one epoch of updates, the teacher temperature's to DINO's 3 epochs.
OVERRIDES = [f"loop.epochs={EPOCHS}", f"schedules.lr.warmup_steps={PER_EPOCH}", "schedules.teacher_temp.warmup_steps=2"]
# No BatchNorm in the head: the bias of a layer before a BatchNorm gets a gradient of rounding
# noise only, which AdamW scales up to full steps (its value would follow the rounding, not the
# loop). The backbone's BatchNorm layers remain, with the teacher's own running statistics.
TINY = {"width": 4, "out_dim": 32, "hidden_dim": 16, "bottleneck_dim": 8, "local_crops": 2, "head_bn": False}


class GivenCrops(DinoTask):
    """The recipe's task over crops drawn beforehand: a batch holds DINO's list of crops
    (2 global views, then the local ones), which ``views`` groups by resolution as the task's own
    views are (the global views in one tensor, the local crops in another)."""

    def __init__(self, **params):
        super().__init__(**params)
        self.temperatures: list[float] = []

    def views(self, x):
        return [torch.cat(x[:2]), torch.cat(x[2:])]

    def criterion(self, model, batch, ctx):
        self.temperatures.append(ctx.values[TEACHER_TEMP])
        return super().criterion(model, batch, ctx)


def _setup(precision: list[str] = ()):
    cfg = load_config(resolve("dino"), OVERRIDES + list(precision))
    task = GivenCrops(**{**cfg.task.params, **TINY})
    torch.manual_seed(0)
    model = task.build_model()
    g = torch.Generator().manual_seed(1)
    epochs = []
    for _ in range(EPOCHS):
        batches = []
        for _ in range(PER_EPOCH):
            x = torch.rand(IMAGES, 1, 8, 8, generator=g)
            torch.manual_seed(int(torch.randint(2**31, (), generator=g)))
            global_views, local_crops = DinoTask.views(task, x)
            batches.append(([*global_views.chunk(2), *local_crops.chunk(task.local_crops)], torch.zeros(IMAGES)))
        epochs.append(batches)
    return cfg, task, model, epochs


# ---------------------------------------------------------------------- DINO's helpers, transcribed


def cosine_scheduler(base, final, epochs, niter_per_ep, warmup_epochs=0, start_warmup_value=0.0) -> list[float]:
    """utils.cosine_scheduler: a linspace warm-up of ``warmup_epochs * niter_per_ep`` points
    ending at ``base``, then half a cosine over the remaining iterations, indexed from 0 of their
    count (so it never reaches ``final``)."""
    w = warmup_epochs * niter_per_ep
    rest = epochs * niter_per_ep - w
    assert rest > 0
    warm = [
        start_warmup_value + (base - start_warmup_value) * i / (w - 1) if w > 1 else start_warmup_value
        for i in range(w)
    ]
    decay = [final + 0.5 * (base - final) * (1 + math.cos(math.pi * i / rest)) for i in range(rest)]
    return warm + decay


def clip_gradients(model: nn.Module, clip: float) -> None:
    """utils.clip_gradients: each gradient scaled by clip / (its norm + 1e-6) when that is < 1."""
    for _, p in model.named_parameters():
        if p.grad is not None:
            coef = clip / (p.grad.data.norm(2) + 1e-6)
            if coef < 1:
                p.grad.data.mul_(coef)


def cancel_gradients_last_layer(epoch: int, model: nn.Module, freeze_last_layer: int) -> None:
    """utils.cancel_gradients_last_layer: the last layer's gradients become None (no AdamW step
    at all, decay included) while ``epoch < freeze_last_layer``."""
    if epoch < freeze_last_layer:
        for n, p in model.named_parameters():
            if "last_layer" in n:
                p.grad = None


def get_params_groups(model: nn.Module) -> list[dict]:
    """utils.get_params_groups: biases and 1-D parameters in a second group without decay."""
    decayed = [p for n, p in model.named_parameters() if p.requires_grad and not (n.endswith(".bias") or p.ndim == 1)]
    undecayed = [p for n, p in model.named_parameters() if p.requires_grad and (n.endswith(".bias") or p.ndim == 1)]
    return [{"params": decayed}, {"params": undecayed, "weight_decay": 0.0}]


def multi_crop(model: nn.Module, crops: list[torch.Tensor]) -> torch.Tensor:
    """MultiCropWrapper: one backbone pass per run of consecutive crops of one resolution, the
    head over all their features."""
    sizes = torch.tensor([c.shape[-1] for c in crops])
    ends = torch.cumsum(torch.unique_consecutive(sizes, return_counts=True)[1], 0).tolist()
    features, start = [], 0
    for end in ends:
        features.append(model.backbone(torch.cat(crops[start:end])))
        start = end
    return model.head(torch.cat(features))


class DINOLoss(nn.Module):
    """main_dino.DINOLoss on one process: the teacher temperature a linspace over the warm-up
    epochs, then constant, read at the epoch; the centre moved after the loss is computed."""

    def __init__(
        self, out_dim, ncrops, warmup_teacher_temp, teacher_temp, warmup_epochs, nepochs, student_temp, center_momentum
    ):
        super().__init__()
        self.student_temp, self.center_momentum, self.ncrops = student_temp, center_momentum, ncrops
        self.in_fp32 = True
        self.register_buffer("center", torch.zeros(1, out_dim))
        step = (teacher_temp - warmup_teacher_temp) / (warmup_epochs - 1)
        self.teacher_temp_schedule = [warmup_teacher_temp + step * e for e in range(warmup_epochs)]
        self.teacher_temp_schedule += [teacher_temp] * (nepochs - warmup_epochs)

    def forward(self, student_output, teacher_output, epoch):
        if self.in_fp32:  # the deviation: the half-precision outputs taken to fp32 first
            student_output, teacher_output = student_output.float(), teacher_output.float()
        student_out = (student_output / self.student_temp).chunk(self.ncrops)
        temp = self.teacher_temp_schedule[epoch]
        teacher_out = F.softmax((teacher_output - self.center) / temp, dim=-1).detach().chunk(2)
        total, terms = 0.0, 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v != iq:
                    total += torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1).mean()
                    terms += 1
        with torch.no_grad():
            batch_center = teacher_output.sum(0, keepdim=True) / len(teacher_output)
            self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)
        return total / terms


def dino_reference(cfg, task, model: nn.Module, epochs, loss_in_fp32: bool = True) -> dict:
    """main_dino's set-up and ``train_one_epoch`` per epoch, with DINO's arguments read from the
    recipe (its lr taken as already scaled by the batch size). Under ``precision.dtype=fp16`` as
    DINO's ``use_fp16``: the forward passes and the loss under autocast, a ``GradScaler`` that
    unscales before clipping; bf16: autocast alone. ``loss_in_fp32``: DINOLoss takes the outputs to
    fp32 first, as the task does (a deliberate deviation in half precision); False: as DINO writes it."""
    s = cfg.schedules
    student = copy.deepcopy(model)
    teacher = copy.deepcopy(model)
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False
    assert s["lr"].warmup_steps % PER_EPOCH == 0 and s["weight_decay"].warmup_steps == 0
    lr_schedule = cosine_scheduler(
        s["lr"].value, s["lr"].end, EPOCHS, PER_EPOCH, s["lr"].warmup_steps // PER_EPOCH, s["lr"].warmup_start
    )
    wd_schedule = cosine_scheduler(s["weight_decay"].value, s["weight_decay"].end, EPOCHS, PER_EPOCH)
    momentum_schedule = cosine_scheduler(s["ema_momentum"].value, s["ema_momentum"].end, EPOCHS, PER_EPOCH)
    temp = s[TEACHER_TEMP]  # DINO's warmup_teacher_temp_epochs W: per=epoch, warmup_steps W - 1
    loss_fn = DINOLoss(
        task.out_dim,
        2 + task.local_crops,
        temp.warmup_start,
        temp.value,
        temp.warmup_steps + 1,
        EPOCHS,
        task.student_temp,
        task.center_momentum,
    )
    loss_fn.in_fp32 = loss_in_fp32
    optimizer = torch.optim.AdamW(get_params_groups(student))
    precision = cfg.precision
    fp16_scaler = torch.amp.GradScaler("cpu", init_scale=precision.init_scale, enabled=precision.dtype == "fp16")
    assert cfg.clip.mode == "per_param"  # DINO clips each gradient on its own (clip_grad, 3.0 by default)
    clip_grad = cfg.clip.max_norm
    seen = {"lr": [], "wd": [], "temp": []}
    for epoch, batches in enumerate(epochs):
        for i, (images, _) in enumerate(batches):
            it = len(batches) * epoch + i
            for j, group in enumerate(optimizer.param_groups):
                group["lr"] = lr_schedule[it]
                if j == 0:
                    group["weight_decay"] = wd_schedule[it]
            with torch.autocast("cpu", dtype=DTYPES.get(precision.dtype), enabled=precision.dtype in DTYPES):
                teacher_output = multi_crop(teacher, images[:2])
                student_output = multi_crop(student, images)
                loss = loss_fn(student_output, teacher_output, epoch)
            assert math.isfinite(loss.item())
            optimizer.zero_grad()
            fp16_scaler.scale(loss).backward()
            fp16_scaler.unscale_(optimizer)
            if clip_grad:
                clip_gradients(student, clip_grad)
            cancel_gradients_last_layer(epoch, student, cfg.freeze.last_layer_epochs)
            fp16_scaler.step(optimizer)
            fp16_scaler.update()
            with torch.no_grad():
                m = momentum_schedule[it]
                for param_q, param_k in zip(student.parameters(), teacher.parameters(), strict=True):
                    param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)
            seen["lr"].append([g["lr"] for g in optimizer.param_groups])
            seen["wd"].append([g["weight_decay"] for g in optimizer.param_groups])
            seen["temp"].append(loss_fn.teacher_temp_schedule[epoch])
    scale = fp16_scaler.get_scale() if fp16_scaler.is_enabled() else None
    return {"student": student, "teacher": teacher, "center": loss_fn.center.flatten(), "scale": scale, **seen}


# ---------------------------------------------------------------------- the engine


class LastLayerMoves(Callback):
    """After each update, whether the last layer differs from its initial weights."""

    def __init__(self, module: nn.Module):
        self.weight = module.head.last_layer.weight
        self.initial = self.weight.detach().clone()
        self.moved: list[bool] = []

    def on_step(self, result, step, epoch):
        self.moved.append(not torch.equal(self.weight, self.initial))


def test_the_recipes_teacher_update_is_dinos_arithmetic_to_the_bit_where_lerp_is_not():
    """The recipe's ``ema.arithmetic`` moves the teacher as DINO's ``param_k.mul_(m).add_((1 - m) *
    param_q)`` does, bit for bit over 20 updates of the momentum schedule (fp32); the engine's
    ``lerp`` differs in the last bit."""
    cfg = load_config(resolve("dino"), OVERRIDES)
    torch.manual_seed(0)
    model = GivenCrops(**{**cfg.task.params, **TINY}).build_model()
    s = cfg.schedules["ema_momentum"]
    momentum_schedule = cosine_scheduler(s.value, s.end, EPOCHS, PER_EPOCH)
    teacher = copy.deepcopy(model)
    emas = {a: EMA(model, cfg.ema.buffers, arithmetic=a) for a in (cfg.ema.arithmetic, "lerp")}
    g = torch.Generator().manual_seed(2)
    for m in momentum_schedule:
        with torch.no_grad():
            for p in model.parameters():  # a student update
                p.add_(torch.randn(p.shape, generator=g), alpha=1e-2)
            for param_q, param_k in zip(model.parameters(), teacher.parameters(), strict=True):
                param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)
        for ema in emas.values():
            ema.update(m)
    assert cfg.ema.arithmetic == "weighted_sum" and len(momentum_schedule) == 20
    theirs = dict(teacher.named_parameters())
    ours, lerp = (dict(emas[a].module.named_parameters()) for a in ("weighted_sum", "lerp"))
    assert all(torch.equal(ours[n], p) for n, p in theirs.items())
    assert not all(torch.equal(lerp[n], p) for n, p in theirs.items())


def test_the_dino_recipe_reproduces_dinos_train_one_epoch_update_for_update():
    with one_thread():
        _dino_against_the_engine([])


# Half precision as DINO trains (fp16 autocast with its GradScaler), and bf16 autocast without
# one. The initial loss scale is low enough that no update overflows (an overflow step is a
# deliberate deviation): DINO's, torch's 2^16, falls to 8 within this toy run; from 8 the
# reference's scale stays at it, so none did.
HALF = {"fp16": ["precision.dtype=fp16", "precision.init_scale=8"], "bf16": ["precision.dtype=bf16"]}


@pytest.mark.parametrize("dtype", sorted(HALF))
def test_the_dino_recipe_reproduces_dinos_train_one_epoch_under_autocast(dtype):
    with one_thread():
        _dino_against_the_engine(HALF[dtype])


def _dino_against_the_engine(precision: list[str]):
    cfg, task, model, epochs = _setup(precision)
    reference = dino_reference(cfg, task, model, epochs)
    engine = task_engine(task, model, cfg, PER_EPOCH)
    groups, last_layer = GroupValues(engine), LastLayerMoves(model)
    start = {n: v.clone() for n, v in model.state_dict().items()}
    run_loop(engine, cfg, epochs, [groups, last_layer])
    assert engine.step == engine.total_steps == 20
    if cfg.precision.dtype == "fp16":
        assert reference["scale"] == cfg.precision.init_scale == engine.scaler.get_scale()

    # The schedules: lr on both groups, weight decay on the first only, the teacher temperature.
    torch.testing.assert_close(groups.lr, reference["lr"], rtol=1e-12, atol=0)
    torch.testing.assert_close(groups.wd, reference["wd"], rtol=1e-12, atol=0)
    assert all(wd[1] == 0.0 for wd in groups.wd) and len({wd[0] for wd in groups.wd}) == 20
    torch.testing.assert_close(task.temperatures, reference["temp"], rtol=1e-12, atol=0)
    assert len(set(task.temperatures)) == 3  # the warm-up runs over epochs 0-2
    # The last layer does not move in epoch 0 (5 updates), and moves from the first update after.
    assert last_layer.moved == [False] * PER_EPOCH + [True] * (20 - PER_EPOCH)

    # Every parameter and buffer of the student (its centre is DINOLoss's) and of the teacher.
    ours = dict(engine.module.state_dict())
    theirs = dict(reference["student"].state_dict())
    theirs["center"] = reference["center"]
    worst = largest_difference(ours, theirs)
    worst = max(worst, largest_difference(engine.ema.module.state_dict(), reference["teacher"].state_dict()))
    print(f"DINO {cfg.precision.dtype}: largest difference over student, teacher and centre after 20 updates: {worst:.3g}")
    assert all(not torch.equal(v, start[n]) for n, v in ours.items() if v.is_floating_point())


def test_deviation_the_loss_and_centre_are_computed_in_fp32_from_half_precision_outputs():
    """DINO divides the student's half-precision outputs by the temperature in half precision, and
    CPU autocast keeps its log_softmax and the batch centre's sum in half too (CUDA autocast runs
    both in fp32). The task takes the outputs to fp32 first: its loss from half outputs is its loss
    from their fp32 values, bit for bit. Over 20 fp16 updates DINO's arithmetic as written moves the
    weights by more than 1e-4 from the same loop with the loss in fp32, the loop the engine matches
    within 1e-6 (test_the_dino_recipe_reproduces_dinos_train_one_epoch_under_autocast)."""
    g = torch.Generator().manual_seed(3)
    student, teacher, center = torch.randn(12, 32, generator=g), torch.randn(6, 32, generator=g), torch.zeros(1, 32)
    half = dino_loss(student.half(), teacher.half(), center, 4, 0.1, 0.04)[0]
    assert torch.equal(half, dino_loss(student.half().float(), teacher.half().float(), center, 4, 0.1, 0.04)[0])
    with one_thread():
        cfg, task, model, epochs = _setup(HALF["fp16"])
        as_written = dino_reference(cfg, task, model, epochs, loss_in_fp32=False)
        in_fp32 = dino_reference(cfg, task, model, epochs)
    difference = max(
        (a - b).abs().max().item()
        for key in ("student", "teacher")
        for a, b in zip(as_written[key].parameters(), in_fp32[key].parameters(), strict=True)
    )
    print(f"DINO fp16: its loss as written against the loss in fp32: {difference:.3g}")
    assert difference > 1e-4, difference
