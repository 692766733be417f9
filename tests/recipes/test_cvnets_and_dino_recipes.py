"""The cvnets_cls and dino recipes: their mechanisms checked in-process on the recipes' own
configs, the cross-worker centre on a gloo group, and each recipe end to end on two Ray workers
with a reduced budget, read back from the run's own logs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from raytrain_loops import fit
from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.engine import Engine, StepContext, schedule_value
from raytrain_loops.recipes import builtin, describe, resolve
from raytrain_loops.tasks import build_task
from raytrain_loops.tasks.dino import knn_accuracy, random_resized_crops
from tests.support.runfiles import records


def _recipe(name: str, *overrides: str):
    return load_config(resolve(name), list(overrides))


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _images(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_both_recipes_are_built_in_with_their_command_in_the_header():
    for name in ("cvnets_cls", "dino"):
        path = builtin()[name]
        assert f"#   raytrain-loops train {name}\n" in path.read_text()
        assert describe(path)


# ---------------------------------------------------------------------- cvnets_cls


def test_cvnets_batchnorm_momentum_follows_its_schedule_in_the_running_statistics():
    total = 6
    # The momentum's hold (cvnets: through the warm-up) shortened to 2 of the 6 updates.
    cfg = _recipe("cvnets_cls", "precision.dtype=fp32", f"loop.max_steps={total}", "schedules.bn_momentum.warmup_steps=2")
    task = build_task(cfg.task.name, cfg.task.params)
    torch.manual_seed(0)
    model = task.build_model()
    engine = Engine(model, task.criterion, cfg.engine, total_steps=total)
    bn = model.features[0][1]
    batch_means = []
    bn.register_forward_hook(lambda _m, inputs, _out: batch_means.append(inputs[0].detach().mean((0, 2, 3))))
    batch = _images(32)
    momenta = []
    ema_bn = engine.ema.module.features[0][1]
    for step in range(total):
        before, ema_before = bn.running_mean.clone(), ema_bn.running_mean.clone()
        batch_means.clear()
        assert engine.train_step([batch]).applied
        m = schedule_value(cfg.schedules["bn_momentum"], step, total)
        assert all(layer.momentum == m for layer in model.modules() if isinstance(layer, torch.nn.BatchNorm2d))
        torch.testing.assert_close(bn.running_mean, (1 - m) * before + m * batch_means[0])
        # ema.buffers=average: the EMA's running statistics follow the weights' momentum (cvnets).
        e = schedule_value(cfg.schedules["ema_momentum"], step, total)
        torch.testing.assert_close(ema_bn.running_mean, e * ema_before + (1 - e) * bn.running_mean)
        assert ema_bn.num_batches_tracked == bn.num_batches_tracked == step + 1
        momenta.append(m)
    # Held at 0.1 through the warm-up, then annealed toward 0.01 (one step short of it at the last
    # update, as cvnets' AdjustBatchNormMomentum), falling at every update.
    assert momenta[:3] == pytest.approx([0.1, 0.1, 0.1]) and 0.01 < momenta[-1] < 0.03
    assert all(a > b for a, b in zip(momenta[2:], momenta[3:], strict=False))


def test_cvnets_without_a_bn_momentum_schedule_names_the_missing_key():
    task = build_task("cvnets", {})
    ctx = StepContext(step=0, epoch=0, values={"lr": 0.1}, ema=None)
    with pytest.raises(ValueError, match=r"schedules\.bn_momentum, which the config lacks"):
        task.criterion(task.build_model(), _images(4), ctx)


def test_cvnets_recipe_accumulates_from_its_epoch_and_stops_at_max_steps(tmp_path):
    # Local mode: the loop's behaviour, one worker in this process.
    overrides = [
        "scaling.num_workers=0",
        "accum.start_epoch=1",
        "loop.max_steps=51",
        "schedules.lr.warmup_steps=10",
        f"data.dir={tmp_path / 'data'}",
        f"run.storage_path={tmp_path}",
        "run.progress=false",
    ]
    result = fit(resolve("cvnets_cls"), overrides=overrides)
    run_dir = Path(result.run_dir)
    steps = records(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps if s["applied"]] == list(range(1, 52))
    # 42 updates of 32 in epoch 0, then 2 micro-batches per update; max_steps stops the run
    # inside epoch 1.
    assert [(s["epoch"], s["sample_size"]) for s in steps] == [(0, 32.0)] * 42 + [(1, 64.0)] * 9
    lrs = [s["lr"] for s in steps]
    assert lrs[:10] == sorted(lrs[:10]) and lrs[10:] == sorted(lrs[10:], reverse=True)  # warm-up, then cosine
    losses = [s["loss"] for s in steps]
    assert sum(losses[-5:]) < 0.6 * sum(losses[:5]), losses
    evals = records(run_dir / "eval.jsonl")
    # The model and its EMA side by side at each evaluation. Accuracy is still low this early: the
    # BatchNorm running statistics trail the weights with the momentum falling to 0.01 in 51 steps.
    assert [e["step"] for e in evals] == [42, 51]
    assert all({"eval_accuracy", "eval_ema_accuracy", "eval_ema_loss"} <= e.keys() for e in evals), evals
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"], evals
    assert result.metrics["bn_momentum"] < 0.1  # the logged schedule value, averaged over the last interval


# ---------------------------------------------------------------------- dino


def test_invalid_dino_params_are_named():
    with pytest.raises(ConfigError, match=r"task\.params\.local_scale: must be \[low, high\].*got \[0\.5, 0\.2\]"):
        build_task("dino", {"local_scale": [0.5, 0.2]})
    with pytest.raises(ConfigError, match=r"task\.params\.local_crops: must be >= 0; got -1"):
        build_task("dino", {"local_crops": -1})


def test_random_resized_crops_of_the_whole_image_are_the_image():
    x, _ = _images(5)
    torch.testing.assert_close(random_resized_crops(x, 8, scale=(1.0, 1.0), ratio=(1.0, 1.0)), x)
    local = random_resized_crops(x, 5, scale=(0.2, 0.5), max_rotation=15.0)
    assert local.shape == (5, 1, 5, 5) and not torch.equal(local[0], local[1])


def test_knn_on_raw_pixels_reproduces_the_reference_figure(tmp_path):
    task = build_task("dino", {})
    task.prepare(tmp_path)
    task.splits(tmp_path)  # the driver names the bank: the train split, wherever data.dir is
    bank, bank_labels = task.bank(torch.device("cpu"))
    images, labels = task.read(tmp_path / "digits" / "test.parquet")
    accuracy = knn_accuracy(bank.flatten(1), bank_labels, images.flatten(1), labels, k=20)
    assert accuracy.item() == pytest.approx(436 / 450)  # 0.969, the raw-pixel figure on this split


def test_dino_teacher_follows_its_momentum_schedule_sees_global_views_only_and_last_layer_waits_an_epoch():
    total = 4
    cfg = _recipe("dino", "task.params.out_dim=64", "task.params.local_crops=3", f"loop.max_steps={total}")
    task = build_task(cfg.task.name, cfg.task.params)
    torch.manual_seed(0)
    model = task.build_model()
    # Two epochs: the teacher temperature is per epoch, and the last layer trains from epoch 1.
    engine = Engine(model, task.criterion, cfg.engine, total_steps=total, total_epochs=2, after_step=task.after_step)
    teacher = engine.ema.module
    shapes: dict[str, list] = {"student": [], "teacher": []}
    model.backbone.register_forward_pre_hook(lambda _m, a: shapes["student"].append(tuple(a[0].shape)))
    teacher.backbone.register_forward_pre_hook(lambda _m, a: shapes["teacher"].append(tuple(a[0].shape)))
    batch = _images(16)
    last_layer = model.head.last_layer.weight.detach().clone()
    momenta = []
    for step in range(total):
        before = _params(teacher)
        assert engine.train_step([batch]).applied
        m = schedule_value(cfg.schedules["ema_momentum"], step, total)
        for name, p in _params(model).items():
            torch.testing.assert_close(_params(teacher)[name], m * before[name] + (1 - m) * p, msg=name)
        momenta.append(m)
    # DINO's cosine_scheduler(0.996, 1.0, epochs=4, niter_per_ep=1), run once: it never reaches 1
    assert momenta == pytest.approx([0.996, 0.9965857864376269, 0.998, 0.9994142135623731], rel=1e-12)
    assert shapes["teacher"] == [(32, 1, 8, 8)] * total
    assert shapes["student"] == [(32, 1, 8, 8), (48, 1, 5, 5)] * total
    assert torch.equal(model.head.last_layer.weight, last_layer), "the last layer moved in epoch 0"
    assert model.center.abs().sum() > 0
    engine.epoch = 1
    engine.train_step([batch])
    assert not torch.equal(model.head.last_layer.weight, last_layer), "the last layer must train from epoch 1"


def test_dino_recipe_learns_without_collapse_and_reports_knn_against_the_initial_backbone(tmp_path):
    # Local mode: the loop's and the task's behaviour, one worker in this process.
    overrides = [
        "scaling.num_workers=0",
        "loop.epochs=4",
        "schedules.teacher_temp.warmup_steps=3",  # DINO's warm-up over the 4 epochs (the recipe's is 10)
        f"data.dir={tmp_path / 'data'}",
        f"run.storage_path={tmp_path}",
        "run.progress=false",
    ]
    result = fit(resolve("dino"), overrides=overrides)
    run_dir = Path(result.run_dir)
    steps = records(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps if s["applied"]] == list(range(1, 4 * 42 + 1))
    losses = [s["loss"] for s in steps]
    assert sum(losses[-10:]) < 0.92 * sum(losses[:10]), losses
    evals = records(run_dir / "eval.jsonl")
    final = evals[-1]
    assert final["eval_ema_knn_accuracy"] > 0.9 and final["eval_ema_knn_accuracy_init"] > 0.9, final
    assert final["eval_ema_feature_std"] > 0.01, final
    cfg = _recipe("dino")
    assert 0.5 < result.metrics["teacher_entropy"] < math.log(cfg.task.params["out_dim"]) - 0.1, result.metrics
