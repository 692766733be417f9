"""The detr recipe and its parts: GIoU, Hungarian matching and split-level mAP by hand (against
COCOeval: tests/recipes/test_detection_map_vs_cocoeval.py), the shapes data set on disk and its images' ids,
split-level metrics over two gloo workers (one without images), and the recipe end to end on two
Ray workers with a reduced budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from raytrain_loops import fit
from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.engine import Engine, NonFiniteError
from raytrain_loops.engine.loop import evaluate
from raytrain_loops.recipes import builtin, describe, resolve
from raytrain_loops.tasks import build_task
from raytrain_loops.tasks.datasets.shapes import CLASSES, ShapesSpec, decode_masks, write_shapes
from raytrain_loops.tasks.detection import MeanAveragePrecision, generalized_box_iou, hungarian_match
from raytrain_loops.tasks.images import Block
from tests.support import fakes
from tests.support.gloo import run_gloo
from tests.support.runfiles import records

SMALL = {"train_images": 64, "validation_images": 16}


def test_generalized_iou_by_hand():
    a = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    b = torch.tensor([[0.0, 0.0, 1.0, 1.0], [2.0, 0.0, 3.0, 1.0], [0.5, 0.0, 1.5, 1.0]])
    # identical: 1; disjoint with a gap of 1: iou 0, hull 3, union 2: -1/3; half overlap: 1/3 - 0
    torch.testing.assert_close(generalized_box_iou(a, b), torch.tensor([[1.0, -1 / 3, 1 / 3]]))


def test_hungarian_matching_finds_the_permutation_of_least_cost():
    boxes = torch.tensor([[[0.2, 0.2, 0.1, 0.1], [0.7, 0.7, 0.2, 0.2], [0.5, 0.5, 0.05, 0.05]]])
    logits = torch.zeros(1, 3, 4)
    targets = [(torch.tensor([0, 1]), torch.tensor([[0.7, 0.7, 0.2, 0.2], [0.21, 0.2, 0.1, 0.1]]))]
    [(queries, objects)] = hungarian_match(logits, boxes, targets, 1.0, 5.0, 2.0)
    assert dict(zip(objects.tolist(), queries.tolist(), strict=True)) == {0: 1, 1: 0}


def _image(image_id, dets, gts):
    """dets: (box, score, label); gts: (box, label); boxes xyxy."""
    p = {
        "boxes": torch.tensor([d[0] for d in dets], dtype=torch.float32).reshape(-1, 4),
        "scores": torch.tensor([d[1] for d in dets]),
        "labels": torch.tensor([d[2] for d in dets], dtype=torch.long),
    }
    t = {"boxes": torch.tensor([g[0] for g in gts], dtype=torch.float32).reshape(-1, 4), "image_id": image_id}
    t["labels"] = torch.tensor([g[1] for g in gts], dtype=torch.long)
    return p, t


A, B, FAR = [0, 0, 10, 10], [20, 20, 30, 30], [50, 50, 60, 60]
# Class 0: 2 objects; ranked detections hit, miss, hit: precision 1, 1/2, 2/3 at recall 1/2, 1/2, 1.
# Class 1: 1 object found by the only detection (AP 1). Class 2 has no object and is left out.
IMAGES = [
    _image(1, [(A, 0.9, 0), (FAR, 0.8, 0), (B, 0.3, 1)], [(A, 0), (B, 1)]),
    _image(2, [(B, 0.7, 0), (A, 0.2, 2)], [(B, 0)]),
    _image(3, [], []),  # nothing found, nothing there
]
AP0 = (51 * 1.0 + 50 * 2 / 3) / 101  # 101 recall points: 0..0.5 at precision 1, the rest at 2/3


def _map(images) -> dict[str, float]:
    metric = MeanAveragePrecision(num_classes=3)
    for p, t in images:
        metric.update([p], [t])
    return {k: float(v) for k, v in metric.compute().items()}


def test_map_by_hand():
    # Every true positive has IoU 1 and every false one IoU 0: the same AP at every threshold.
    assert _map(IMAGES) == pytest.approx(dict.fromkeys(("map", "map50", "map75"), (AP0 + 1.0) / 2), abs=1e-12)
    # Objects but no detections: 0; no objects: undefined (COCOeval's -1).
    assert _map([_image(1, [], [(A, 0)])]) == {"map": 0.0, "map50": 0.0, "map75": 0.0}
    assert all(np.isnan(v) for v in _map([_image(1, [(A, 0.5, 0)], [])]).values())


def _split_metric_on_two_workers(rank: int, world: int):
    """Worker 0 evaluates every image, worker 1 none: the split's mAP on both, through the loop's evaluate."""
    task_like_batches = [IMAGES] if rank == 0 else []
    engine = Engine(
        torch.nn.parallel.DistributedDataParallel(fakes.make_model()),
        fakes.mean_loss,
        fakes.config().engine,
        total_steps=1,
    )

    def evaluate_fn(model, batch, metrics):
        metrics["map"].update([p for p, _ in batch], [t for _, t in batch])
        return {"images": (float(len(batch)), 1.0)}

    return evaluate(engine, task_like_batches, evaluate_fn, False, lambda: {"map": MeanAveragePrecision(3)})


def test_split_level_metrics_cover_every_workers_images_even_a_worker_without_any():
    outcomes = run_gloo(2, _split_metric_on_two_workers)
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message + outcomes[1].message
    for o in outcomes:
        assert o.value["eval_map50"] == pytest.approx((AP0 + 1.0) / 2)
        assert o.value["eval_images"] == 3.0


def test_shapes_are_written_once_keyed_by_their_parameters_with_boxes_matching_masks(tmp_path):
    spec = ShapesSpec(**SMALL)
    paths = write_shapes(tmp_path, spec)
    mtime = paths["train"].stat().st_mtime_ns
    assert write_shapes(tmp_path, spec)["train"].stat().st_mtime_ns == mtime
    assert spec.directory(tmp_path) != ShapesSpec(**{**SMALL, "seed": 1}).directory(tmp_path)
    assert not list(spec.directory(tmp_path).glob("*.tmp*"))
    table = pq.read_table(paths["train"])
    assert table.num_rows == 64 and pq.read_table(paths["validation"]).num_rows == 16
    labels = table.column("labels").to_pylist()
    assert {len(v) for v in labels} <= {1, 2, 3, 4} and len({len(v) for v in labels}) > 1
    assert set(sum(labels, [])) == set(range(len(CLASSES)))
    for boxes, masks in zip(table.column("boxes").to_pylist()[:8], table.column("masks").to_pylist()[:8], strict=True):
        m = decode_masks(masks, 64)
        for (cx, cy, w, h), mask in zip(np.asarray(boxes).reshape(-1, 4), m, strict=True):
            ys, xs = np.nonzero(mask)
            assert (xs.min(), xs.max() + 1) == pytest.approx((64 * (cx - w / 2), 64 * (cx + w / 2)), abs=1e-3)
            assert (ys.min(), ys.max() + 1) == pytest.approx((64 * (cy - h / 2), 64 * (cy + h / 2)), abs=1e-3)
    again = ShapesSpec(**SMALL)
    other = tmp_path / "other"
    write_shapes(other, again)
    assert pq.read_table(again.directory(other) / "train.parquet").equals(table)  # seeded


def test_detr_images_are_known_by_distinct_ids_from_their_bytes_however_they_are_batched(tmp_path):
    task = build_task("detr", SMALL)
    task.prepare(tmp_path)
    table = pq.read_table(task.splits(tmp_path)["eval"].path)
    columns = {k: table.column(k).to_numpy(zero_copy_only=False) for k in ("image", "labels", "boxes")}
    whole = task.collate(columns)["ids"].tolist()
    parts = [task.collate({k: v[a:b] for k, v in columns.items()})["ids"].tolist() for a, b in ((9, 16), (0, 9))]
    assert parts[1] + parts[0] == whole and len(set(whole)) == 16


def test_detr_params_are_checked_by_name():
    with pytest.raises(ConfigError, match=r"task\.params\.weight_dict: needs exactly .* missing \['loss_giou'\]"):
        build_task("detr", {"weight_dict": {"loss_ce": 1, "loss_bbox": 5}})
    with pytest.raises(ConfigError, match=r"task\.params\.num_queries: must be >= max_objects=4; got 3"):
        build_task("detr", {"num_queries": 3})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['colour'\]"):
        build_task("detr", {"colour": 1})


def test_detr_recipe_is_built_in_with_its_command():
    path = builtin()["detr"]
    assert "#   raytrain-loops train detr\n" in path.read_text() and describe(path)
    cfg = load_config(resolve("detr"), [])
    assert (cfg.clip.mode, cfg.nonfinite.policy, cfg.optim.param_groups) == ("global", "stop", "task")
    assert cfg.schedules["lr"].kind == "step"
    # The recipe's backbone is the ResNet-style stack; depth 0 keeps the four plain conv blocks.
    params = {**cfg.task.params, **SMALL}
    body = build_task("detr", params).build_model().backbone.body
    assert sum(isinstance(m, Block) for m in body) == 3 * params["depth"] >= 3, body
    old = build_task("detr", {**params, "depth": 0}).build_model().backbone.body
    assert len(old) == 4 and not any(isinstance(m, Block) for m in old), old


def test_detr_recipe_end_to_end_logs_its_terms_and_improves(tmp_path):
    # Local mode: the task's behaviour in the loop, one worker in this process.
    overrides = [
        "scaling.num_workers=0",
        "task.params.train_images=512",
        "task.params.validation_images=64",
        "loop.max_steps=48",
        "schedules.lr.milestones=[40]",
        "schedules.lr.warmup_steps=8",
        "eval.every_steps=16",
        "checkpoint.every_steps=48",
        "logging.every_steps=8",
        f"data.dir={tmp_path / 'data'}",
        f"run.storage_path={tmp_path}",
        "run.progress=false",
    ]
    result = fit(resolve("detr"), overrides=overrides)
    m = result.metrics
    for name in ("loss_ce", "loss_bbox", "loss_giou"):
        for key in (name, f"{name}_unscaled", f"{name}_0", f"{name}_1_unscaled"):
            assert key in m, key
        assert m[name] == pytest.approx(m[f"{name}_unscaled"] * {"loss_ce": 1, "loss_bbox": 5, "loss_giou": 2}[name])
    assert "class_error" in m and "cardinality_error" in m
    evals = records(Path(result.run_dir) / "eval.jsonl")
    assert [e["step"] for e in evals] == [16, 32, 48]
    first, last = evals[0], evals[-1]
    for key in ("eval_map", "eval_map50", "eval_init_map50", "eval_class_error", "eval_loss_giou"):
        assert key in last, key
    assert last["eval_loss"] < first["eval_loss"], evals
    assert last["eval_loss_giou"] < first["eval_loss_giou"], evals
    # The same initial model on the same images at every evaluation; training leaves it behind.
    assert len({e["eval_init_map50"] for e in evals}) == 1, evals
    # Training leaves the initial model behind (its boxes all sit near the centre: mAP 0); between
    # this run's evaluations mAP@.5 is too small to rank them. The matched boxes' L1 term falls
    # well clear of that noise; the matched queries' class error needs more updates than these.
    assert last["eval_map50"] > last["eval_init_map50"], evals
    assert last["eval_loss_bbox"] < 0.8 * first["eval_loss_bbox"], evals


def test_a_nonfinite_detr_loss_stops_naming_its_terms_not_a_matching_error(tmp_path):
    task = build_task("detr", {**SMALL, "dim": 32, "width": 8})
    task.prepare(tmp_path)
    table = pq.read_table(task.splits(tmp_path)["train"].path).slice(0, 8)
    batch = task.collate({k: table.column(k).to_numpy(zero_copy_only=False) for k in ("image", "labels", "boxes")})
    cfg = load_config(resolve("detr"), ["nonfinite.policy=stop"])
    torch.manual_seed(0)
    model = task.build_model()
    engine = Engine(
        model,
        task.criterion,
        cfg.engine,
        total_steps=4,
        task_param_groups=task.param_groups(model),
        counts=task.counts,
        count_keys=task.count_keys,
    )
    assert engine.train_step([batch]).applied
    # DETR's AdamW decays both groups: the backbone's (at 0.1x the lr) as the rest.
    groups = engine.optimizer.param_groups
    assert len(groups) == 2 and [g["weight_decay"] for g in groups] == [1.0e-4, 1.0e-4]
    assert groups[1]["lr"] == pytest.approx(0.1 * groups[0]["lr"]) or groups[0]["lr"] == pytest.approx(0.1 * groups[1]["lr"])
    with torch.no_grad():
        model.box_head[-1].bias.fill_(float("nan"))  # every predicted box is NaN
    with pytest.raises(NonFiniteError, match=r"module 'box_head.*loss_bbox=nan.*loss_ce=\d"):
        engine.train_step([batch])
