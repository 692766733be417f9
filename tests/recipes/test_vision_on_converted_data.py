"""The vision recipes on data in their seeds' formats, converted by ``raytrain-loops convert``
(tests/support/vision_data.py writes it): each trains a few updates in local mode."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from examples.imagefolder import main as example
from raytrain_loops import fit
from raytrain_loops.config import ConfigError
from raytrain_loops.data.formats import identity
from raytrain_loops.data.parquet import ROW_SEED
from raytrain_loops.recipes import resolve
from raytrain_loops.tasks import build_task
from raytrain_loops.tasks.converted.seamseg_coco import semantic
from raytrain_loops.tools.convert import convert
from tests.support.runfiles import records
from tests.support.vision_data import write_coco

SIZE = 16


@pytest.fixture(scope="module")
def folder(ray_session, tmp_path_factory) -> str:
    """A converted ImageFolder: 3 classes x 100 images (PNG and JPEG) of 20 pixels, 80 of each
    in ``train/`` and 20 in ``val/``."""
    root = tmp_path_factory.mktemp("folder")
    example(["--make-data", str(root / "src")])
    convert("imagefolder", str(root / "src"), str(root / "converted"))
    return str(root / "converted")


def _steps(run_dir: str) -> list[dict]:
    return records(Path(run_dir) / "metrics.jsonl")


def _train(recipe: str, tmp_path: Path, *overrides: str) -> tuple[list[dict], list[dict], Path]:
    """The steps and evaluations (metrics.jsonl, eval.jsonl) of ``recipe`` trained in local mode,
    and its run directory."""
    common = ["scaling.num_workers=0", f"run.storage_path={tmp_path}", "run.progress=false", "data.batch_size=16"]
    run_dir = Path(fit(resolve(recipe), overrides=[*common, *overrides]).run_dir)
    evals = records(run_dir / "eval.jsonl")
    return _steps(str(run_dir)), evals, run_dir


def test_cvnets_trains_on_a_converted_imagefolder_at_the_configured_size(folder, tmp_path, capsys):
    task = build_task("cvnets", {"data": "imagefolder", "source": folder, "size": SIZE})
    import pyarrow.parquet as pq

    rows = pq.read_table(task.images.split("train")).slice(0, 4).to_pydict()
    batch = {"image": np.asarray(rows["image"], dtype=object), "label": np.asarray(rows["label"]),
             ROW_SEED: np.arange(4, dtype=np.uint64)}  # fmt: skip
    train, again, evaluated = task.preprocess(batch, True), task.preprocess(batch, True), task.preprocess(batch, False)
    assert train["image"].shape == evaluated["image"].shape == (4, 3, SIZE, SIZE)  # CHW, the data's channels
    assert np.array_equal(train["image"], again["image"])  # drawn from the rows' seeds
    assert not np.array_equal(train["image"], evaluated["image"])
    model = task.build_model()
    assert model.features[0][0].in_channels == 3 and model.head.out_features == 3
    # examples/imagefolder.py end to end: the conversion (a no-op here: the fixture's), 4 updates.
    src = str(Path(folder).parent / "src")
    run = example(["--data", src, "--converted", folder, "--local", "--steps", "4", "--size", str(SIZE),
                   "--storage-path", str(tmp_path)])  # fmt: skip
    assert "is up to date: 300 images, 3 classes, 2 files; nothing converted" in capsys.readouterr().out
    steps = _steps(run.run_dir)
    evals = records(Path(run.run_dir) / "eval.jsonl")
    assert [s["step"] for s in steps if s["applied"]] == [1, 2, 3, 4]
    assert all(np.isfinite(s["loss"]) for s in steps), steps
    assert 0.0 <= evals[-1]["eval_accuracy"] <= 1.0 and evals[-1]["step"] == 4
    found = identity.identity(folder)  # the run pins the converted set's identity: paths, sizes, rows
    del found["files"]["meta.json"]
    assert json.loads((Path(run.run_dir) / "artefacts.json").read_text())["data"] == identity.digest(found)


def test_a_converted_set_of_another_format_or_none_is_named(folder, tmp_path):
    with pytest.raises(ConfigError, match="task.params.source.*holds no meta.json: convert the data first"):
        build_task("cvnets", {"data": "imagefolder", "source": str(tmp_path), "size": SIZE}).prepare(tmp_path)
    with pytest.raises(ConfigError, match="task.params.data.*must be one of"):
        build_task("cvnets", {"data": "coco"})


def test_dino_trains_on_a_converted_imagefolder_and_its_teacher_is_a_backbone_for_cvnets(folder, tmp_path, capsys):
    task = build_task("dino", {"data": "imagefolder", "source": folder, "size": SIZE, "local_size": 8, "local_crops": 2})
    task.splits(Path(tmp_path))
    import pyarrow.parquet as pq

    rows = pq.read_table(task.images.split("train")).slice(0, 3).to_pydict()
    batch = {"image": np.asarray(rows["image"], dtype=object), "label": np.asarray(rows["label"]),
             ROW_SEED: np.arange(3, dtype=np.uint64)}  # fmt: skip
    out = task.preprocess(batch, True)
    assert out["global"].shape == (3, 2, 3, SIZE, SIZE) and out["local"].shape == (3, 2, 3, 8, 8)
    assert np.array_equal(task.preprocess(batch, True)["global"], out["global"])  # drawn from the rows' seeds
    views, labels = task.collate(out)
    assert [tuple(v.shape) for v in views] == [(6, 3, SIZE, SIZE), (6, 3, 8, 8)] and len(labels) == 3
    assert torch.equal(views[0][3], torch.from_numpy(out["global"][0, 1]).float() / 255)  # view-major
    steps, evals, run_dir = _train("dino", tmp_path, "task.params.data=imagefolder", f"task.params.source={folder}",
                   f"task.params.size={SIZE}", "task.params.local_size=8", "task.params.local_crops=2",
                   "task.params.out_dim=64", "loop.epochs=1", "loop.max_steps=4", "eval.every_steps=4")  # fmt: skip
    assert [s["step"] for s in steps if s["applied"]] == [1, 2, 3, 4]
    assert all(np.isfinite(s["loss"]) for s in steps), steps
    assert evals[-1]["step"] == 4 and 0.0 <= evals[-1]["eval_ema_knn_accuracy"] <= 1.0, evals

    # DINO's workflow: the run's exported teacher is the backbone a classifier fine-tunes.
    from raytrain_loops.checkpoint import checkpoint_dirs, export

    teacher = export(checkpoint_dirs(str(run_dir))[-1], tmp_path / "teacher.pt", ema=True)["model"]
    params = {"data": "imagefolder", "source": folder, "size": SIZE, "backbone_weights": str(tmp_path / "teacher.pt")}
    model = build_task("cvnets", params).build_model()
    said = capsys.readouterr().out
    assert all(torch.equal(v, teacher[f"backbone.{k}"]) for k, v in model.features.state_dict().items())
    assert "tensors loaded; missing none; unexpected ['center', 'head.last_layer.weight'," in said, said
    with pytest.raises(ConfigError, match=r"backbone_weights: .*teacher.pt: 0.0.weight has shape \[32, 3, 3, 3\], the model's \[8, 3, 3, 3\]"):
        build_task("cvnets", {**params, "width": 8}).build_model()


def test_backbone_weights_in_safetensors_start_the_digits_cnn_and_detrs_resnet_stack(tmp_path, capsys):
    from safetensors.torch import save_file

    source = build_task("cvnets", {}).build_model()
    save_file({f"features.{k}": v.contiguous() for k, v in source.features.state_dict().items()}, tmp_path / "b.safetensors")
    model = build_task("cvnets", {"backbone_weights": str(tmp_path / "b.safetensors")}).build_model()
    assert all(torch.equal(v, source.features.state_dict()[k]) for k, v in model.features.state_dict().items())
    assert "missing none; unexpected none" in capsys.readouterr().out
    # DETR's ResNet-style backbone (task.params.depth) from a state_dict of the same architecture.
    detr = build_task("detr", {"depth": 2, "width": 8}).build_model()
    assert sum(isinstance(m, type(detr.backbone.body[1])) for m in detr.backbone.body) == 6  # 3 stages x depth 2
    save_file({f"backbone.{k}": v.contiguous() for k, v in detr.backbone.state_dict().items()}, tmp_path / "d.safetensors")
    loaded = build_task("detr", {"depth": 2, "width": 8, "backbone_weights": str(tmp_path / "d.safetensors")}).build_model()
    assert all(torch.equal(v, detr.backbone.state_dict()[k]) for k, v in loaded.backbone.state_dict().items())
    with pytest.raises(ConfigError, match=r"backbone_weights: .*d.safetensors: body.0.0.weight has shape"):
        build_task("detr", {"depth": 2, "width": 4, "backbone_weights": str(tmp_path / "d.safetensors")}).build_model()
    (tmp_path / "code.pt").write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match="code.pt is no state_dict torch.load reads safely"):
        build_task("cvnets", {"backbone_weights": str(tmp_path / "code.pt")}).build_model()


@pytest.fixture(scope="module")
def coco(ray_session, tmp_path_factory) -> tuple[Path, str]:
    """The tests' COCO directory (200 images of 20 x 14, polygons, one crowd) and its conversion."""
    root = tmp_path_factory.mktemp("coco")
    write_coco(root / "src", images=200)
    convert("coco", str(root / "src"), str(root / "converted"))
    return root / "src", str(root / "converted")


def test_detr_trains_on_a_converted_coco_directory(coco, tmp_path):
    src, converted = coco
    task = build_task("detr", {"data": "coco", "source": converted, "size": 40})
    task.prepare(tmp_path)
    import pyarrow.parquet as pq

    rows = pq.read_table(task.images.split("train")).slice(0, 3).to_pydict()
    batch = {k: np.asarray(v, dtype=object) for k, v in rows.items()} | {ROW_SEED: np.arange(3, dtype=np.uint64)}
    out = task.preprocess(batch, False)
    assert out["image"].shape == (3, 3, 40, 40) and task.num_classes == 2
    data = json.loads((src / "annotations" / "instances_train.json").read_text())
    first = [a for a in data["annotations"] if a["image_id"] == rows["image_id"][0] and not a["iscrowd"]]
    expected = [[(x + w / 2) / 20, (y + h / 2) / 20, w / 20, h / 20] for x, y, w, h in (a["bbox"] for a in first)]
    assert np.allclose(out["boxes"][0], expected, atol=1e-6)  # the crowd left out, at twice the size over 40
    assert out["labels"][0].tolist() == [[3, 7].index(a["category_id"]) for a in first]
    train = task.preprocess(batch, True)
    assert all(((b >= 0) & (b <= 1)).all() for b in train["boxes"]) and train["image"].shape == (3, 3, 40, 40)
    steps, _, _ = _train("detr", tmp_path, "task.params.data=coco", f"task.params.source={converted}",
                         "task.params.size=32", "loop.max_steps=4")  # fmt: skip
    assert [s["step"] for s in steps if s["applied"]] == [1, 2, 3, 4]
    assert all(np.isfinite(s["loss"]) for s in steps), steps


def test_seamseg_trains_on_a_converted_coco_directory_through_the_plan(coco, tmp_path):
    from pycocotools.coco import COCO

    src, converted = coco
    task = build_task("seamseg", {"data": "coco", "source": converted, "size": 32})
    import pyarrow.parquet as pq

    rows = pq.read_table(task.images.split("train")).slice(0, 3).to_pydict()
    batch = {k: np.asarray(v, dtype=object) for k, v in rows.items()} | {ROW_SEED: np.arange(3, dtype=np.uint64)}
    out = task.preprocess(batch, False)
    assert [i.shape for i in out["image"]] == [(32, 48, 3)] * 3  # 14 x 20 at a shorter side of 32, sides rounded to 16s
    coco_api = COCO(str(src / "annotations" / "instances_train.json"))
    for i, image_id in enumerate(rows["image_id"]):  # at the converted size: the masks pycocotools gives
        anns = coco_api.loadAnns(coco_api.getAnnIds(imgIds=[image_id]))
        expected = np.zeros((14, 20), dtype=np.uint8)
        for ann in sorted(anns, key=lambda a: a["iscrowd"]):
            expected[coco_api.annToMask(ann) > 0] = 255 if ann["iscrowd"] else 1 + [3, 7].index(ann["category_id"])
        row = {k: rows[k][i] for k in rows}
        assert np.array_equal(semantic(row, {3: 0, 7: 1}), expected)
    assert 255 in out["sem"][0] and len(out["labels"][0]) == len(out["boxes"][0])
    batch_out = task.collate(task.preprocess(batch, True))
    assert batch_out["images"].shape[:2] == (3, 3) and batch_out["images"].shape[2] % 16 == 0
    steps, _, _ = _train("seamseg", tmp_path, "task.params.data=coco", f"task.params.source={converted}",
                         "task.params.size=32", "loop.max_steps=4", "loop.epochs=1")  # fmt: skip
    assert [s["step"] for s in steps if s["applied"]] == [1, 2, 3, 4]
    assert all(np.isfinite(s["loss"]) for s in steps), steps
