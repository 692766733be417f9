"""DETR's ``train_one_epoch`` (``../shared/seeds/``, DETR ``engine.py``) transcribed into plain
PyTorch, beside the engine and the loop driven by ``recipes/detr.yaml``'s own config, with the
model and the data swapped for tiny ones. No Ray: both in this process.

The transcription follows facebookresearch/detr's ``main.py`` set-up: AdamW over two groups
(the parameters named ``backbone`` at ``lr_backbone``, both decayed), ``StepLR(optimizer,
lr_drop)`` stepped after every epoch, and ``engine.py``'s loop: the loss dict's terms weighted
by ``weight_dict`` and summed, ``clip_grad_norm_`` at ``clip_max_norm``, one step per batch. The
model is the recipe's own ``DETR`` at toy size, and the loss dict DETR's terms as the task
computes them (its port of ``SetCriterion``, the same on both sides: the loop is under test)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from raytrain_loops.config import load_config
from raytrain_loops.engine import schedule_value
from raytrain_loops.recipes import resolve
from raytrain_loops.tasks.datasets.shapes import CLASSES
from raytrain_loops.tasks.detr import DetrTask
from tests.seeds.recipe_run import GroupValues, largest_difference, one_thread, run_loop, task_engine

EPOCHS, PER_EPOCH, IMAGES, SIZE = 4, 5, 4, 16
LR_DROP = 2  # DETR's lr_drop, in epochs: the lr falls 10x after epoch 1 of 4
TINY = {"num_queries": 4, "dim": 16, "heads": 2, "dec_layers": 2, "width": 4}
TINY_DATA = {"size": SIZE, "min_extent": 3, "max_extent": 8, "max_objects": 3}
# The run is 20 updates, without the recipe's warm-up (DETR has none: see
# test_deviation_the_recipe_warms_the_lr_up_where_detr_starts_at_its_value), and DETR's drop
# after LR_DROP epochs written either way the engine offers it.
SHORT = ["loop.max_steps=20", "schedules.lr.warmup_steps=0"]
DROPS = {
    "milestone_in_updates": [f"schedules.lr.milestones=[{LR_DROP * PER_EPOCH}]"],
    "per_epoch": ["schedules.lr.per=epoch", f"schedules.lr.milestones=[{LR_DROP}]"],
}


def _batch(g: torch.Generator) -> dict:
    """Images and, per image, 1-3 objects: labels and cxcywh boxes inside the image."""
    labels, boxes = [], []
    for _ in range(IMAGES):
        n = int(torch.randint(1, 4, (), generator=g))
        labels.append(torch.randint(len(CLASSES), (n,), generator=g))
        centre = 0.3 + 0.4 * torch.rand(n, 2, generator=g)
        boxes.append(torch.cat([centre, 0.1 + 0.3 * torch.rand(n, 2, generator=g)], 1))
    return {"images": torch.randn(IMAGES, 3, SIZE, SIZE, generator=g), "labels": labels, "boxes": boxes}


def _setup(drop: str):
    cfg = load_config(resolve("detr"), SHORT + DROPS[drop])
    task = DetrTask(**{**cfg.task.params, **TINY, **TINY_DATA})
    torch.manual_seed(0)
    model = task.build_model()
    g = torch.Generator().manual_seed(1)
    epochs = [[_batch(g) for _ in range(PER_EPOCH)] for _ in range(EPOCHS)]
    return cfg, task, model, epochs


def detr_reference(cfg, task: DetrTask, model, epochs) -> dict:
    """DETR's ``main`` from the optimizer on, and ``train_one_epoch`` per epoch, with DETR's
    arguments read from the recipe: ``lr``, ``lr_backbone`` (its ``backbone_lr_scale`` times
    ``lr``), ``weight_decay``, ``clip_max_norm``."""
    model = copy.deepcopy(model)
    lr, weight_decay = cfg.schedules["lr"].value, cfg.schedules["weight_decay"].value
    assert cfg.schedules["lr"].gamma == 0.1  # StepLR's default, which DETR keeps
    param_dicts = [
        {"params": [p for n, p in model.named_parameters() if "backbone" not in n and p.requires_grad]},
        {
            "params": [p for n, p in model.named_parameters() if "backbone" in n and p.requires_grad],
            "lr": lr * task.backbone_lr_scale,
        },
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=lr, weight_decay=weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, LR_DROP)
    weight_dict = task.weights
    assert cfg.clip.mode == "global"  # DETR clips the total norm (clip_max_norm, 0.1 by default)
    clip_max_norm = cfg.clip.max_norm
    seen = {"lr": [], "wd": []}

    def criterion(outputs, batch) -> dict:
        num_boxes = max(float(sum(len(t) for t in batch["labels"])), 1.0)  # one process: clamp(n / 1, min=1)
        terms, logs = task.losses(*outputs, batch, num_boxes)
        return {**terms, **logs}

    for batches in epochs:
        model.train()
        for batch in batches:
            loss_dict = criterion(model(batch["images"]), batch)
            losses = sum(loss_dict[k] * weight_dict[k] for k in loss_dict if k in weight_dict)
            assert math.isfinite(losses.item())
            optimizer.zero_grad()
            losses.backward()
            if clip_max_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_max_norm)
            optimizer.step()
            seen["lr"].append([g["lr"] for g in optimizer.param_groups])
            seen["wd"].append([g["weight_decay"] for g in optimizer.param_groups])
        lr_scheduler.step()
    return {"model": model, **seen}


def without_key_biases(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each attention's key bias left out of its ``in_proj_bias`` (query, key, value
    biases, in that order). A key bias adds the same to every score of a query, which the softmax
    removes: its gradient is rounding noise (:func:`test_an_attention_key_bias_gets_only_rounding_noise`),
    which AdamW divides by its own root mean square, so its value follows the last bits of the
    arithmetic (the clip factor's, say), not the loop."""
    out = dict(state)
    for name, v in state.items():
        if name.endswith("in_proj_bias"):
            query, _, value = v.chunk(3)
            out[name] = torch.cat([query, value])
    return out


def _detr_against_the_engine(drop: str) -> None:
    cfg, task, model, epochs = _setup(drop)
    reference = detr_reference(cfg, task, model, epochs)
    engine = task_engine(task, model, cfg, PER_EPOCH)
    groups = GroupValues(engine)
    start = {n: v.clone() for n, v in model.state_dict().items()}
    run_loop(engine, cfg, epochs, [groups])
    assert engine.step == 20

    # Each group's lr (the backbone's at 0.1x, both 10x lower from epoch LR_DROP) and weight decay (both).
    torch.testing.assert_close(groups.lr, reference["lr"], rtol=1e-12, atol=0)
    torch.testing.assert_close(groups.wd, reference["wd"], rtol=0, atol=0)
    lr = cfg.schedules["lr"].value
    assert groups.lr[LR_DROP * PER_EPOCH - 1] == pytest.approx([lr, 0.1 * lr])
    assert groups.lr[LR_DROP * PER_EPOCH] == pytest.approx([0.1 * lr, 0.01 * lr])
    assert all(wd == [cfg.schedules["weight_decay"].value] * 2 for wd in groups.wd)
    # Every parameter and buffer (the backbone's BatchNorm statistics).
    ours = engine.module.state_dict()
    worst = largest_difference(without_key_biases(ours), without_key_biases(reference["model"].state_dict()))
    print(f"DETR ({drop}): largest difference over parameters and buffers after 20 updates: {worst:.3g}")
    assert all(not torch.equal(v, start[n]) for n, v in ours.items() if v.is_floating_point())


@pytest.mark.parametrize("drop", sorted(DROPS))
def test_the_detr_recipe_reproduces_detrs_train_one_epoch_update_for_update(drop):
    with one_thread():
        _detr_against_the_engine(drop)


def test_an_attention_key_bias_gets_only_rounding_noise():
    with one_thread():
        _, task, model, epochs = _setup("per_epoch")
        batch = epochs[0][0]
        terms, _ = task.losses(*model(batch["images"]), batch, 1.0)
        sum(task.weights[k] * t for k, t in terms.items()).backward()
    biases = {n: p.grad.chunk(3) for n, p in model.named_parameters() if n.endswith("in_proj_bias")}
    assert len(biases) == 5  # the encoder's self-attention, and self- and cross-attention of 2 decoder layers
    for name, (query, key, value) in biases.items():
        assert key.abs().max() < 1e-6 * value.abs().max(), name
        assert query.abs().max() > 1e-3 * value.abs().max(), name


def test_deviation_the_recipe_warms_the_lr_up_where_detr_starts_at_its_value():
    """The recipe's lr rises from 1e-5 over its first 50 updates, then is DETR's step schedule:
    its value until the drop at update 1,300 of 1,600, a tenth of it after."""
    cfg = load_config(resolve("detr"), [])
    s, n = cfg.schedules["lr"], cfg.loop.max_steps
    values = [schedule_value(s, t, n) for t in (0, 49, 50, 1299, 1300, n - 1)]
    assert values == pytest.approx([1e-5, 9.802e-4, 1e-3, 1e-3, 1e-4, 1e-4], rel=1e-12)
    # Without the warm-up, the first update already takes DETR's value.
    short = load_config(resolve("detr"), SHORT + DROPS["milestone_in_updates"]).schedules["lr"]
    assert schedule_value(short, 0, 20) == 1e-3
