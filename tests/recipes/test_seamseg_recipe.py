"""The seamseg recipe and its parts: shapes of two aspect ratios (square sets unchanged), rows
grouped by shape and their collation, the weighted named loss terms, the split-level mean IoU
against a hand computation on two gloo workers, and the recipe end to end in local mode with a
reduced budget, every named loss falling from the first epoch to the last."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from raytrain_loops import MapSplit, fit
from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.data import MapBatches
from raytrain_loops.driver.preflight import planned_steps
from raytrain_loops.engine import Engine, StepContext
from raytrain_loops.engine.length import batches_per_epoch
from raytrain_loops.engine.loop import evaluate
from raytrain_loops.recipes import builtin, describe, resolve
from raytrain_loops.tasks import build_task
from raytrain_loops.tasks.datasets.shapes import ShapesSpec, decode_image, decode_masks, write_shapes
from raytrain_loops.tasks.seamseg import IGNORE, TERMS, SeamsegTask, collate, detections, row_groups
from tests.support import fakes
from tests.support.gloo import run_gloo
from tests.support.runfiles import records

SMALL = {"train_images": 48, "validation_images": 16, "width": 8}


# ---------------------------------------------------------------------- data


def test_square_shapes_keep_their_draws_files_and_cache_key(tmp_path):
    """The detr recipe's data: the same images and the same directory as before widths existed."""
    spec = ShapesSpec(train_images=8, validation_images=4)
    paths = write_shapes(tmp_path, spec)
    digest = hashlib.sha256()
    for split in ("train", "validation"):
        table = pq.read_table(paths[split])
        assert table.column_names == ["image", "labels", "boxes", "masks"]
        for col in table.column_names:
            digest.update(repr(table.column(col).to_pylist()).encode())
    # Both values were taken from the square-only generator this option extended.
    assert spec.directory(Path("x")).name == "f88b67a4e9b0"
    assert digest.hexdigest() == "4b4a763f961470f02b97c9d6f81512ab8c84b9428bc1dcbdb30a9f536c4e15a2"
    assert "widths" not in json.loads((spec.directory(tmp_path) / "meta.json").read_text())


def test_shapes_of_two_widths_have_boxes_matching_their_masks(tmp_path):
    spec = ShapesSpec(train_images=40, validation_images=8, widths=[64, 96])
    assert spec.directory(tmp_path) != ShapesSpec(train_images=40, validation_images=8).directory(tmp_path)
    table = pq.read_table(write_shapes(tmp_path, spec)["train"])
    widths = [decode_image(raw, 64).shape[1] for raw in table.column("image").to_pylist()]
    assert set(widths) == {64, 96}
    rows = zip(table.column("boxes").to_pylist(), table.column("masks").to_pylist(), widths, strict=True)
    for boxes, masks, w in rows:
        for (cx, cy, bw, bh), mask in zip(np.asarray(boxes).reshape(-1, 4), decode_masks(masks, 64, w), strict=True):
            ys, xs = np.nonzero(mask)
            assert (xs.min(), xs.max() + 1) == pytest.approx((w * (cx - bw / 2), w * (cx + bw / 2)), abs=1e-3)
            assert (ys.min(), ys.max() + 1) == pytest.approx((64 * (cy - bh / 2), 64 * (cy + bh / 2)), abs=1e-3)
    with pytest.raises(ValueError, match=r"task\.params\.widths must be integers >= max_extent=24; got \[64, 16\]"):
        ShapesSpec(widths=[64, 16])


def _task(tmp_path, **params) -> tuple[SeamsegTask, dict[str, MapSplit]]:
    task = build_task("seamseg", {**SMALL, **params})
    task.prepare(tmp_path)
    return task, task.splits(tmp_path)


def test_rows_are_grouped_by_shape_and_a_training_batch_must_not_mix_them(tmp_path):
    task, splits = _task(tmp_path)
    train = splits["train"]
    groups = row_groups(train.dataset)
    widths = [train.dataset[i]["image"].shape[1] for i in range(len(train.dataset))]
    assert sorted(set(groups)) == [0, 1] and len(groups) == len(train.dataset) == 48
    assert all({0: 64, 1: 96}[g] == w for g, w in zip(groups, widths, strict=True))
    # The dataset travels to the workers without its rows: they are read where they are used.
    train.dataset[0]  # reads the file into memory
    pickled = pickle.dumps(train.dataset)
    assert len(pickled) < 1000 and len(pickle.loads(pickled)) == 48

    one = [i for i, g in enumerate(groups) if g == 1][:3]
    batch = train.collate_fn([train.dataset[i] for i in one])
    assert batch["images"].shape == (3, 3, 64, 96) and batch["heat"].shape == (3, 1, 16, 24)
    assert len(batch["centres"]) == sum(len(lab) for lab in batch["labels"]) == len(batch["ltrb"])
    b, y, x = batch["centres"].unbind(1)
    assert bool((batch["heat"][b, 0, y, x] == 1).all())  # every object's centre is a peak of its heatmap
    mixed = [groups.index(0), groups.index(1)]
    with pytest.raises(ValueError, match=r"mixes image shapes \[\(64, 64\), \(64, 96\)\].*row_groups"):
        train.collate_fn([train.dataset[i] for i in mixed])
    padded = splits["eval"].collate_fn([train.dataset[i] for i in mixed])
    assert padded["images"].shape == (2, 3, 64, 96)
    assert bool((padded["sem"][0, :, 64:] == IGNORE).all()) and not bool((padded["sem"][1] == IGNORE).any())


def test_the_shipped_training_split_batches_one_shape_at_a_time_on_every_worker(tmp_path):
    _, splits = _task(tmp_path)
    data = load_config(None, ["data.batch_size=4"]).data
    shapes, rows = set(), 0
    for rank in (0, 1):
        source = MapBatches(splits, data, seed=0, rank=rank, world=2)
        for batch in source.batches("train", epoch=0):  # the task's collate refuses mixed shapes
            shapes.add(tuple(batch["images"].shape[2:]))
            rows += len(batch["images"])
        assert source.batches_per_epoch == len(list(source.batches("train", epoch=0)))
    assert shapes == {(64, 64), (64, 96)} and rows <= 48


# ---------------------------------------------------------------------- losses


def test_loss_weights_are_checked_by_name_and_weight_the_named_terms(tmp_path):
    with pytest.raises(ConfigError, match=r"task\.params\.loss_weights: needs one weight per loss term .* got 2"):
        build_task("seamseg", {"loss_weights": [1.0, 2.0]})
    with pytest.raises(ConfigError, match=r"task\.params\.loss_weights: must be numbers"):
        build_task("seamseg", {"loss_weights": [1.0, "x", 1.0]})
    with pytest.raises(ConfigError, match=r"task\.params\.widths: must be a multiple of 4"):
        build_task("seamseg", {"widths": [64, 90]})
    task, splits = _task(tmp_path, loss_weights=[2.0, 0.5, 3.0])
    train = splits["train"]
    rows = [i for i, g in enumerate(row_groups(train.dataset)) if g == 0][:4]
    batch = train.collate_fn([train.dataset[i] for i in rows])
    torch.manual_seed(0)
    model = task.build_model()
    ctx = StepContext(step=0, epoch=0, values={}, ema=None, totals=task.counts(batch), slots=1)
    out = task.criterion(model, batch, ctx)
    assert list(out.terms) == list(TERMS)
    assert out.weights == {"obj": 2.0, "bbx": 0.5, "sem": 3.0}
    expected = 2.0 * out.terms["obj"] + 0.5 * out.terms["bbx"] + 3.0 * out.terms["sem"]
    torch.testing.assert_close(out.loss, expected)
    assert all(float(t) > 0 for t in out.terms.values())


# ---------------------------------------------------------------------- mean IoU, detections


class FixedOutputs(nn.Module):
    """Predicts the given maps whatever the images: segmentation logits one-hot on ``labels``
    (B, H, W), objectness logits ``obj`` (B, 1, H/4, W/4) (none: -10, no detections) and box
    distances ``bbx`` (B, 4, H/4, W/4), each cut to the batch's shape."""

    def __init__(self, labels: torch.Tensor, obj: torch.Tensor | None = None, bbx: torch.Tensor | None = None):
        super().__init__()
        b, h, w = labels.shape
        self.labels = labels
        self.obj = torch.full((b, 1, h // 4, w // 4), -10.0) if obj is None else obj
        self.bbx = torch.zeros(b, 4, h // 4, w // 4) if bbx is None else bbx
        self.bias = nn.Parameter(torch.zeros(()))  # DDP needs a parameter

    def forward(self, images):
        _, _, h, w = images.shape
        sem = nn.functional.one_hot(self.labels[:, :h, :w], 4).permute(0, 3, 1, 2).float() * 10
        return {
            "sem": sem + self.bias,
            "obj": self.obj[..., : h // 4, : w // 4],
            "bbx": self.bbx[..., : h // 4, : w // 4],
        }


def _item(truth: list[list[int]], row: int, boxes=()) -> dict[str, np.ndarray]:
    sem = np.asarray(truth, dtype=np.uint8)
    return {
        "image": np.zeros((*sem.shape, 3), np.uint8),
        "sem": sem,
        "boxes": np.asarray(boxes, np.float32).reshape(-1, 4),
        "labels": np.zeros(len(boxes), np.int64),
        "id": row,
    }


# Worker 0: one 4x4 image and one 4x8 image (the first padded to 4x8); worker 1: one 4x8 image.
# The predictions' columns 4-7 of the 4x4 image fall in its padding.
SPLITS = {
    "every class present": (
        {0: [[[0, 0, 1, 1]] * 4, [[0, 0, 0, 0, 2, 2, 3, 3]] * 4], 1: [[[3, 3, 3, 3, 0, 0, 0, 0]] * 4]},
        {0: [[[0, 1, 1, 1, 0, 0, 0, 0]] * 4, [[0, 0, 0, 2, 2, 2, 3, 0]] * 4], 1: [[[3, 3, 0, 0, 0, 0, 0, 1]] * 4]},
    ),
    # No triangle (3) in any target or prediction but the padding; ellipses on worker 1 only.
    "a class absent from the split": (
        {0: [[[0, 0, 1, 1]] * 4, [[0, 0, 0, 0, 1, 1, 0, 0]] * 4], 1: [[[2, 2, 0, 0, 0, 0, 0, 0]] * 4]},
        {0: [[[0, 1, 1, 1, 3, 3, 3, 3]] * 4, [[0, 0, 0, 0, 1, 1, 0, 0]] * 4], 1: [[[2, 0, 0, 0, 0, 0, 0, 0]] * 4]},
    ),
}
EXPECTED = {
    # background 7/13, rectangle 2/4, ellipse 2/3, triangle 3/6
    "every class present": [7 / 13, 2 / 4, 2 / 3, 3 / 6],
    # background 13/15, rectangle 4/5, ellipse 1/2; the triangle left out of the mean
    "a class absent from the split": [13 / 15, 4 / 5, 1 / 2, float("nan")],
}


def _valid_pixels(truth, pred) -> tuple[torch.Tensor, torch.Tensor]:
    """Every worker's pixels, the padding left out: (predictions, targets)."""
    preds, targets = [], []
    for rank in (0, 1):
        for t, p in zip(truth[rank], pred[rank], strict=True):
            t = torch.tensor(t)
            preds.append(torch.tensor(p)[:, : t.shape[1]].flatten())
            targets.append(t.flatten())
    return torch.cat(preds), torch.cat(targets)


def _miou_on_two_workers(rank: int, world: int, truth, pred):
    from raytrain_loops.tasks.seamseg import SeamsegTask

    task = SeamsegTask()
    batch = collate([_item(t, row=2 * i + rank) for i, t in enumerate(truth[rank])], pad=True)
    model = FixedOutputs(torch.tensor(pred[rank]))
    engine = Engine(nn.parallel.DistributedDataParallel(model), fakes.mean_loss, fakes.config().engine, total_steps=1)
    return evaluate(engine, [batch], task.evaluate, False, task.eval_metrics)


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_eval_miou_is_torchmetrics_macro_mean_iou_over_both_workers(split):
    from torchmetrics.classification import MulticlassJaccardIndex

    truth, pred = SPLITS[split]
    expected = EXPECTED[split]
    reference = MulticlassJaccardIndex(4, average="macro")(*_valid_pixels(truth, pred))
    assert float(reference) == pytest.approx(np.nanmean(expected), abs=1e-6)
    outcomes = run_gloo(2, _miou_on_two_workers, truth, pred)
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message + outcomes[1].message
    for o in outcomes:
        assert o.value["eval_miou"] == pytest.approx(float(reference), abs=1e-6)
        names = ("background", "rectangle", "ellipse", "triangle")
        got = [o.value[f"eval_iou_{name}"] for name in names]
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)  # NaN where expected is NaN
        for key in ("eval_map50", "eval_sem"):
            assert key in o.value, key


def test_a_perfect_segmentation_scores_1_whatever_classes_the_split_lacks():
    from raytrain_loops.tasks.seamseg import SEGMENTS, SegmentationIoU

    truth = torch.tensor([[[0, 0, 1, 1, IGNORE]] * 3])  # no ellipse, no triangle; one column of padding
    pred = torch.tensor([[[0, 0, 1, 1, 3]] * 3])
    metric = SegmentationIoU(SEGMENTS)
    metric.update(pred, truth)
    out = {k: float(v) for k, v in metric.compute().items()}
    assert out["miou"] == 1.0 and out["iou_background"] == 1.0 and out["iou_rectangle"] == 1.0
    assert np.isnan(out["iou_ellipse"]) and np.isnan(out["iou_triangle"])


def _detection_maps() -> tuple[torch.Tensor, torch.Tensor]:
    """Objectness and box distances for a 64x64 image (A, 16x16 cells) padded to 64x96 (16x24
    cells) and a 64x96 image (B, none): A's own peaks at cells (8, 15), on its right edge, (3, 5)
    and (12, 14), whose box centre lies beyond the image; its padding holds a stronger cell
    beside (8, 15) and a peak of its own at (3, 20)."""
    obj = torch.full((2, 1, 16, 24), -10.0)
    bbx = torch.full((2, 4, 16, 24), 0.5)
    for (y, x), logit in {(8, 15): 2.0, (3, 5): 1.0, (12, 14): 1.5, (8, 16): 4.0, (3, 20): 3.0}.items():
        obj[0, 0, y, x] = logit
    bbx[0, :, 12, 14] = torch.tensor([0.1, 0.5, 1.0, 0.5])  # from x 56.4 to 74: centre 65.2
    return obj, bbx


def test_padding_holds_no_detection_and_costs_no_loss(tmp_path):
    task = SeamsegTask()
    obj, bbx = _detection_maps()
    a = _item([[1] * 64] * 64, row=0, boxes=[[52, 26, 64, 42], [14, 6, 30, 22]])
    b = _item([[0] * 96] * 64, row=1)
    labels = torch.ones(2, 64, 96, dtype=torch.long)
    pair = FixedOutputs(labels, obj, bbx)
    alone = [
        FixedOutputs(labels[:1, :, :64], obj[:1, ..., :16], bbx[:1, ..., :16]),
        FixedOutputs(labels[1:], obj[1:], bbx[1:]),
    ]
    padded = collate([a, b], pad=True)
    singles = [collate([a]), collate([b])]

    found = detections(pair(padded["images"]), padded["sizes"], task.top_k, task.score_threshold)[0]
    own = detections(alone[0](singles[0]["images"]), singles[0]["sizes"], task.top_k, task.score_threshold)[0]
    centres = (found["boxes"][:, :2] + found["boxes"][:, 2:]) / 2
    assert centres.tolist() == [[62.0, 34.0], [22.0, 14.0]]  # the peaks at (8, 15) and (3, 5)
    for key in ("boxes", "scores", "labels"):
        torch.testing.assert_close(found[key], own[key], rtol=0, atol=0)

    # The focal loss sums over cells: the padded pair costs what the two images cost alone.
    obj_loss = [task.losses(m(batch["images"]), batch, 1.0)["obj"] for m, batch in zip(alone, singles, strict=True)]
    torch.testing.assert_close(task.losses(pair(padded["images"]), padded, 1.0)["obj"], sum(obj_loss))

    # And the split's mAP is the same however the images were batched.
    by_batching = []
    for batches in ([(pair, padded)], list(zip(alone, singles, strict=True))):
        metrics = task.eval_metrics()
        for model, batch in batches:
            task.evaluate(model, batch, metrics)
        by_batching.append({k: float(v) for k, v in metrics["det"].compute().items()})
    assert by_batching[0] == by_batching[1] and by_batching[0]["map"] > 0, by_batching


# ---------------------------------------------------------------------- the recipe


def test_seamseg_recipe_is_built_in_with_its_command():
    path = builtin()["seamseg"]
    assert "#   raytrain-loops train seamseg\n" in path.read_text() and describe(path)
    cfg = load_config(resolve("seamseg"), [])
    assert cfg.task.params["loss_weights"] == [1.0, 1.0, 2.0]
    assert len(set(cfg.task.params["widths"])) >= 2
    assert (cfg.scaling.num_workers, cfg.scaling.use_gpu) == (2, False)
    task = build_task(cfg.task.name, cfg.task.params)
    # seamseg decays biases and norm parameters too (its weight_decay_norm defaults to yes): one group.
    model = task.build_model()
    (group,) = Engine(model, task.criterion, cfg.engine, total_steps=4).optimizer.param_groups
    assert group["decay"] and len(group["params"]) == len(list(model.parameters()))


def test_seamseg_recipe_end_to_end_every_named_loss_falls(tmp_path):
    """Local mode: the task's behaviour in the loop, one worker in this process. Its parts across
    two workers run without Ray: the split's mean IoU (above, gloo), epoch averages
    (tests/engine/test_meters.py, tests/engine/test_loop_cadence.py), the terms' global counts (tests/engine/test_task_api_collectives.py),
    a grouped run's length (tests/data/test_batch_samplers.py); and below, this recipe's length on its two
    workers and the task and splits as each Ray worker receives them (pickled)."""
    overrides = [
        "task.params.train_images=192",  # one worker's share of a two-worker run's 384 (as many steps)
        "task.params.validation_images=64",
        "task.params.width=8",
        "loop.epochs=3",
        "logging.every_steps=2",
        "schedules.lr.warmup_steps=4",
        f"data.dir={tmp_path / 'data'}",
        f"run.storage_path={tmp_path}",
        "run.progress=false",
    ]
    cfg = load_config(resolve("seamseg"), [*overrides, "scaling.num_workers=0"])
    result = fit(cfg)  # the shipped task: its training batches come from the grouping sampler
    run_dir = Path(result.run_dir)
    # The run's length is the sampler's: 3 epochs of its batches, not of a DistributedSampler's
    # share of the rows.
    task = build_task(cfg.task.name, cfg.task.params)
    splits = task.splits(tmp_path / "data")
    per_worker = MapBatches(splits, cfg.data, cfg.loop.seed, 0, 1).batches_per_epoch
    assert per_worker != batches_per_epoch(len(splits["train"].dataset), 1, cfg.data.batch_size, padded=True)
    assert result.metrics["step"] == 3 * per_worker
    epochs = records(run_dir / "epochs.jsonl")
    assert [e["epoch"] for e in epochs] == [0, 1, 2]
    for name in TERMS:  # each epoch's averages
        first, last = epochs[0][f"train_{name}_unscaled"], epochs[-1][f"train_{name}_unscaled"]
        assert last < first, (name, [e[f"train_{name}_unscaled"] for e in epochs])
    assert all(0 < e["train_data_time"] < e["train_batch_time"] for e in epochs)
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("eval_miou", "eval_iou_background", "eval_map50", "eval_sem"):
        assert key in summary["metrics"], key
    evals = records(run_dir / "eval.jsonl")
    assert evals[-1]["eval_miou"] > evals[0]["eval_miou"], evals

    # On the recipe's two Ray workers: what each receives is the task and its splits pickled (their
    # rows read where they are used), batching as here; the run's length is the sampler's, the
    # same on the driver and both workers.
    two = load_config(resolve("seamseg"), overrides)
    shipped_task, shipped = pickle.loads(pickle.dumps((task, splits)))
    assert type(shipped_task) is SeamsegTask and (shipped_task.weights, shipped_task.spec) == (task.weights, task.spec)
    sources = [MapBatches(shipped, two.data, two.loop.seed, rank, 2) for rank in (0, 1)]
    per_worker = sources[0].batches_per_epoch
    assert [s.batches_per_epoch for s in sources] == [per_worker] * 2
    assert per_worker != batches_per_epoch(len(splits["train"].dataset), 2, two.data.batch_size, padded=True)
    assert planned_steps(two, splits, {"train": len(splits["train"].dataset)}) == 3 * per_worker
    here = next(iter(MapBatches(splits, two.data, two.loop.seed, 1, 2).batches("train", epoch=1)))
    there = next(iter(sources[1].batches("train", epoch=1)))
    for key in ("images", "heat", "sem"):
        torch.testing.assert_close(there[key], here[key], rtol=0, atol=0)
