"""fairseq's ``Trainer.train_step`` (``../shared/seeds/``, fairseq ``trainer.py``) transcribed into
plain PyTorch on 2 gloo workers, beside the engine driven by ``recipes/lm.yaml``'s own
``schedules``, ``optim``, ``accum``, ``clip`` and ``loss`` sections; and the deliberate deviation
on a worker whose last micro-batch is a dummy. No Ray.

The transcription follows fairseq's helpers as its repository defines them: ``train_step`` (a
dummy batch at zero weight where a worker has no data, ``no_sync`` on all but the last
micro-batch, the sample sizes all-reduced, gradients multiplied by ``world / sample_size``),
``utils.clip_grad_norm_`` (the norm of the already normalised gradients, ``max_norm / (norm +
1e-6)`` clamped at 1), ``optim/adam.py`` ``Adam`` (decoupled weight decay; ``eps`` added to
``sqrt(v)`` before the bias correction, which goes into the step size) and
``optim/lr_scheduler/cosine_lr_scheduler.py`` (``step_update(num_updates)`` after each update).
The model and data are tiny: a byte-level LM of an embedding, a LayerNorm and a head, on padded
token batches of uneven shapes; the loss is summed over target tokens, ``sample_size`` their
count, as fairseq's ``cross_entropy`` criterion."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raytrain_loops.config import load_config
from raytrain_loops.engine import Engine, LossOutput
from raytrain_loops.engine.length import accum_steps
from raytrain_loops.engine.update.precision import DTYPES
from raytrain_loops.recipes import resolve
from tests.support.gloo import run_gloo

UPDATES, WARMUP = 20, 5  # the recipe's 800 updates and 40 of warm-up, shortened alike on both sides
VOCAB, PAD = 13, 0
# The recipe's sections; fp32 (its `auto` is fp32 on a CPU without native bf16), accum.steps=3 as
# fairseq's --update-freq 3, and the run shortened to UPDATES with WARMUP updates of warm-up.
OVERRIDES = ["precision.dtype=fp32", "accum.steps=3", f"schedules.lr.warmup_steps={WARMUP}"]
# Updates at which worker 1 has no data at all (every micro-batch a dummy).
EMPTY_ON_WORKER_1 = (6, 13)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8, padding_idx=PAD)
        self.norm = nn.LayerNorm(8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.norm(self.embed(tokens)))))


def _model() -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM()
    with torch.no_grad():  # fairseq's Embedding: normal(0, dim ** -0.5), the padding row 0
        model.embed.weight.normal_(0, 8**-0.5)
        model.embed.weight[PAD].zero_()
    return model


def _criterion(model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """fairseq's ``cross_entropy``: the loss summed over target tokens, ``sample_size`` their count."""
    tokens, target = batch
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=PAD, reduction="sum")
    return loss, (target != PAD).sum()


def _engine_loss(model, batch, ctx) -> LossOutput:
    loss, sample_size = _criterion(model, batch)
    return LossOutput(loss, sample_size=sample_size)


def _batch(rank: int, update: int, index: int):
    """A padded token batch whose shape and padding vary with (rank, update, micro-batch)."""
    g = torch.Generator().manual_seed(1000 * rank + 10 * update + index)
    rows, length = 1 + (rank + update + 2 * index) % 4, 3 + (update + index) % 5
    tokens = torch.randint(1, VOCAB, (rows, length + 1), generator=g)
    for r in range(rows):  # each row shorter than the batch by 0-2 tokens of padding
        tokens[r, length + 1 - (r + update) % 3 :] = PAD
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


def _samples(rank: int, update: int, k: int, dummy_last: tuple[int, ...] = ()) -> list:
    """A worker's micro-batches of one update; ``None`` where it has no data."""
    if rank == 1 and update in EMPTY_ON_WORKER_1:
        return [None] * k
    batches = [_batch(rank, update, i) for i in range(k)]
    if rank == 1 and update in dummy_last:
        batches[-1] = None
    return batches


# ---------------------------------------------------------------------- the transcription


class FairseqAdam(torch.optim.Optimizer):
    """fairseq's ``optim/adam.py`` ``Adam`` step: weight decay ``p -= lr * wd * p`` first, then
    ``p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)``."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = state["exp_avg_sq"].sqrt().add_(group["eps"])
                step_size = group["lr"] * math.sqrt(1 - beta2 ** state["step"]) / (1 - beta1 ** state["step"])
                if group["weight_decay"] != 0:
                    p.add_(p, alpha=-group["weight_decay"] * group["lr"])
                p.addcdiv_(state["exp_avg"], denom, value=-step_size)


def _fairseq_cosine_lr(num_updates: int, lr, cfg) -> float:
    """``CosineLRSchedule.step_update`` with ``t_mult`` 1 and ``max_update`` = the run's updates."""
    if num_updates < cfg.warmup_steps:
        return cfg.warmup_start + num_updates * (lr - cfg.warmup_start) / cfg.warmup_steps
    period = UPDATES - cfg.warmup_steps
    shrink = 0.1 ** math.floor((num_updates - cfg.warmup_steps) / period)  # lr_shrink ** i (0 within the run)
    t_curr = (num_updates - cfg.warmup_steps) % period
    low, high = cfg.end * shrink, lr * shrink
    return low + 0.5 * (high - low) * (1 + math.cos(math.pi * t_curr / period))


class FairseqTrainer:
    """fairseq's ``train_step`` on a DDP model, as the seed writes it (``zero_sample_size_on_last_dummy``
    off gives our deviation: the worker's real micro-batches keep their sample sizes). ``adam``:
    ``fairseq``'s, or ``torch``'s ``AdamW`` (the recipe's), to tell the loop's mechanics from the
    optimizer's arithmetic."""

    def __init__(self, cfg, zero_sample_size_on_last_dummy: bool = True, adam: str = "fairseq"):
        self.model = DDP(_model())
        # --amp (precision.dtype fp16 or bf16): the criterion under autocast; fp16 with the AMP
        # optimizer's GradScaler, which multiply_grads and clip_grad_norm (unscale_ first) and
        # step (scaler.step, scaler.update) go through.
        self.dtype = DTYPES.get(cfg.precision.dtype)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=cfg.precision.init_scale, enabled=self.dtype == torch.float16)
        self.world = dist.get_world_size()
        sched = cfg.schedules["lr"]
        self.lr_cfg, self.peak = sched, sched.value
        self.optimizer = (FairseqAdam if adam == "fairseq" else torch.optim.AdamW)(
            self.model.parameters(),
            lr=sched.warmup_start,
            betas=tuple(cfg.optim.betas),
            eps=cfg.optim.eps,
            weight_decay=cfg.schedules["weight_decay"].value,
        )
        self.clip_norm = cfg.clip.max_norm
        self.num_updates = 0
        self.dummy_batch = None
        self.zero_on_last_dummy = zero_sample_size_on_last_dummy

    def train_step(self, samples: list) -> None:
        if self.dummy_batch is None:
            self.dummy_batch = samples[0]
        self.optimizer.zero_grad()
        sample_size, is_dummy = torch.zeros(()), False
        for i, sample in enumerate(samples):
            is_dummy = sample is None
            sync = i == len(samples) - 1
            with contextlib.nullcontext() if sync else self.model.no_sync():
                with torch.autocast("cpu", dtype=self.dtype, enabled=self.dtype is not None):
                    loss, sample_size_i = _criterion(self.model, self.dummy_batch if is_dummy else sample)
                if is_dummy:
                    loss = loss * 0  # task.train_step(ignore_grad=True)
                self.scaler.scale(loss).backward()
            if is_dummy and not self.zero_on_last_dummy:
                continue
            sample_size = sample_size + sample_size_i
        if is_dummy and self.zero_on_last_dummy:
            sample_size = sample_size * 0.0
        total = sample_size.float().clone()
        dist.all_reduce(total)  # _aggregate_logging_outputs: the sample sizes summed over replicas
        params = list(self.model.parameters())
        for p in params:  # optimizer.multiply_grads(world / sample_size): DDP averaged
            p.grad.mul_(self.world / total)
        self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in params]
        norm = torch.norm(torch.stack([torch.norm(g, p=2, dtype=torch.float32) for g in grads]))
        coef = (self.clip_norm / (norm + 1e-6)).clamp_(max=1)  # utils.clip_grad_norm_
        for g in grads:
            g.mul_(coef)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.num_updates += 1
        for group in self.optimizer.param_groups:  # lr_step_update: step_update(num_updates)
            group["lr"] = _fairseq_cosine_lr(self.num_updates, self.peak, self.lr_cfg)


# ---------------------------------------------------------------------- the two loops side by side


def _groups(optimizer: torch.optim.Optimizer) -> list[tuple[float, float]]:
    return [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups]


def _reference(cfg, rank: int, dummy_last: tuple[int, ...], zero_on_last_dummy: bool, adam: str):
    reference = FairseqTrainer(cfg, zero_on_last_dummy, adam)
    groups = []
    for u in range(UPDATES):
        # fairseq's optimizer steps with the lr its scheduler set after the previous update.
        groups.append(_groups(reference.optimizer))
        reference.train_step(_samples(rank, u, accum_steps(cfg.accum, epoch=0), dummy_last))
    state = {n: v.detach().clone() for n, v in reference.model.module.state_dict().items()}
    return state, groups, reference.scaler.get_scale() if reference.scaler.is_enabled() else None


def _both_loops(
    rank: int, world: int, dummy_last: tuple[int, ...], zero_on_last_dummy: bool, adams: tuple[str, ...], precision=()
):
    cfg = load_config(resolve("lm"), OVERRIDES + list(precision))
    k = accum_steps(cfg.accum, epoch=0)
    references = {adam: _reference(cfg, rank, dummy_last, zero_on_last_dummy, adam) for adam in adams}
    engine = Engine(DDP(_model()), _engine_loss, cfg.engine, total_steps=UPDATES)
    ours, sample_sizes = [], []
    for u in range(UPDATES):
        result = engine.train_step(_samples(rank, u, k, dummy_last))
        assert result.applied, (u, result.skipped)
        ours.append(_groups(engine.optimizer))
        sample_sizes.append(result.sample_size)
    return {
        **{f"reference_{adam}": state for adam, (state, _, _) in references.items()},
        "reference": references[adams[0]][0],
        "engine": {n: v.detach().clone() for n, v in engine.module.state_dict().items()},
        "start": _model().state_dict(),
        "groups": (references[adams[0]][1], ours),
        "sample_sizes": sample_sizes,
        "scales": (references[adams[0]][2], engine.scaler.get_scale() if engine.scaler.is_enabled() else None),
    }


def _run(
    dummy_last: tuple[int, ...] = (),
    zero_on_last_dummy: bool = True,
    adams: tuple[str, ...] = ("fairseq",),
    precision: tuple[str, ...] = (),
):
    outcomes = run_gloo(2, _both_loops, dummy_last, zero_on_last_dummy, adams, precision)
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message + outcomes[1].message
    return [o.value for o in outcomes]


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_the_lm_recipe_reproduces_fairseqs_train_step_on_two_workers_update_for_update():
    workers = _run(adams=("fairseq", "torch"))
    for w in workers:
        # Every parameter and buffer, after 20 updates that moved them all. Against fairseq's Adam,
        # the difference is its arithmetic's rounding (eps added to sqrt(v) before the bias
        # correction, which goes into the step size): a few float32 ulps. With torch's AdamW in the
        # transcription, the recipe's own optimizer, the loops agree bit for bit.
        assert _largest_difference(w["engine"], w["reference_fairseq"]) <= 1e-6
        assert _largest_difference(w["engine"], w["reference_torch"]) == 0.0
        assert all((w["engine"][n] - w["start"][n]).abs().max() > 1e-3 for n in w["start"]), "every tensor moved"
        # Each group's lr and weight decay at every update: one group, every parameter decayed.
        theirs, ours = w["groups"]
        assert [len(g) for g in ours] == [1] * UPDATES
        for u, (t, o) in enumerate(zip(theirs, ours, strict=True)):
            assert o[0][0] == pytest.approx(t[0][0], rel=1e-12) and o[0][1] == t[0][1] == 0.01, u
        # fairseq's warm-up from its min_lr to the peak, then the cosine down towards min_lr.
        lrs = [t[0][0] for t in theirs]
        assert lrs[0] == 1e-4 and lrs[WARMUP] == pytest.approx(6e-3) and lrs[-1] < 1e-4 * 2
    # The two workers hold the same weights, and the empty updates counted worker 0's tokens alone.
    assert _largest_difference(workers[0]["engine"], workers[1]["engine"]) == 0.0
    sizes = workers[0]["sample_sizes"]
    for u in EMPTY_ON_WORKER_1:
        tokens0 = sum(int((_batch(0, u, i)[1] != PAD).sum()) for i in range(3))
        assert sizes[u] == tokens0


def test_deviation_a_last_dummy_micro_batch_keeps_the_workers_real_sample_sizes():
    """fairseq zeroes a worker's whole ``sample_size`` when its LAST micro-batch is a dummy, while
    the gradients of that worker's real micro-batches stay in the sum: the update is divided by
    fewer tokens than it holds. The engine counts the real micro-batches' tokens (a ``None``
    micro-batch counts zero wherever it stands), so the update is the sum of every real token's
    gradient over their count."""
    dummy_last = (3, 9, 16)
    ours = _run(dummy_last=dummy_last, zero_on_last_dummy=False)
    as_shipped = _run(dummy_last=dummy_last, zero_on_last_dummy=True)
    for w in ours:
        assert _largest_difference(w["engine"], w["reference"]) <= 1e-6
    # The engine is not fairseq as shipped there: its updates were divided by more tokens.
    assert _largest_difference(as_shipped[0]["engine"], as_shipped[0]["reference"]) > 1e-4
    for u in dummy_last:
        real = sum(int((_batch(r, u, i)[1] != PAD).sum()) for r in range(2) for i in range(3 if r == 0 else 2))
        assert ours[0]["sample_sizes"][u] == real


# fairseq's --amp: fp16 autocast with its GradScaler, at fairseq's initial scale (--amp-init-scale,
# 2^7), at which no update overflows (an overflow step is a deliberate deviation); bf16 autocast
# without one. fairseq's --fp16 and --bf16
# (a half-precision model with fp32 master weights) are another loop, not compared.
AMP = {"fp16": ("precision.dtype=fp16", "precision.init_scale=128"), "bf16": ("precision.dtype=bf16",)}


@pytest.mark.parametrize("dtype", sorted(AMP))
def test_the_lm_recipe_reproduces_fairseqs_train_step_under_amp(dtype):
    """The loop, with torch's AdamW (the recipe's) in the transcription: bit for bit. Against
    fairseq's Adam the difference is its arithmetic (as in fp32), which half precision's roundings
    carry a little further: fp16 reaches 1.01e-6 on the LayerNorm's weight (about 1.02, 9 float32
    ulps), so that comparison allows 1e-6 plus 1e-6 of the value."""
    workers = _run(adams=("fairseq", "torch"), precision=AMP[dtype])
    for w in workers:
        assert _largest_difference(w["engine"], w["reference_torch"]) == 0.0
        for n, v in w["reference_fairseq"].items():
            torch.testing.assert_close(w["engine"][n], v, atol=1e-6, rtol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
        worst = _largest_difference(w["engine"], w["reference_fairseq"])
        print(f"fairseq {dtype}: largest difference from fairseq's Adam after {UPDATES} updates: {worst:.3g}")
        assert all((w["engine"][n] - w["start"][n]).abs().max() > 1e-3 for n in w["start"]), "every tensor moved"
        if dtype == "fp16":
            assert w["scales"] == (128.0, 128.0)
