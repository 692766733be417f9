"""The images task without Ray: the generated PNG set (files, row groups, the same bytes on every
machine), preprocessing that crops and flips from each row's seed, and the model's shapes."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from raytrain_loops.data.parquet import ROW_SEED
from raytrain_loops.tasks.datasets.patterns import CLASSES, ROW_GROUP_ROWS, PatternsSpec, write_patterns
from raytrain_loops.tasks.images import CROP_MARGIN, ImagesTask, decode


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    task = ImagesTask(train_images=300, eval_images=100, size=32, width=8)
    data_dir = tmp_path_factory.mktemp("patterns")
    task.prepare(data_dir)
    return task, data_dir


def test_the_set_is_written_once_in_row_groups_of_a_chunk_and_is_the_same_everywhere(small, tmp_path):
    task, data_dir = small
    splits = task.splits(data_dir)
    train = pq.ParquetFile(next(iter(sorted((data_dir / task.spec.directory(data_dir).name / "train").glob("*.parquet")))))
    assert train.metadata.num_rows == 300 and train.metadata.row_group(0).num_rows == ROW_GROUP_ROWS
    table = pq.read_table(splits["train"].path)
    labels = table.column("label").to_numpy()
    assert set(labels.tolist()) == set(range(len(CLASSES)))
    assert decode(table.column("image")[0].as_py()).shape == (32, 32, 3)
    assert pq.read_table(splits["eval"].path).num_rows == 100
    # Another directory, another process count: the same bytes.
    again = write_patterns(tmp_path, PatternsSpec(300, 100, 32, 0), processes=1)
    assert pq.read_table(again["train"]).equals(table)
    assert (task.spec.directory(data_dir) / "meta.json").exists()
    with pytest.raises(ValueError, match="task.params.size must be >= 32"):
        PatternsSpec(size=16)


def test_preprocess_crops_and_flips_by_each_rows_seed_and_centres_evaluation(small):
    task, data_dir = small
    table = pq.read_table(task.splits(data_dir)["train"].path).slice(0, 16)
    batch = {"image": table.column("image").to_numpy(), "label": table.column("label").to_numpy()}
    seeds = np.arange(16, dtype=np.uint64) * 7919
    train = task.preprocess({**batch, ROW_SEED: seeds}, train=True)
    crop = 32 - CROP_MARGIN
    assert train["image"].shape == (16, crop, crop, 3) and train["image"].dtype == np.uint8
    assert np.array_equal(train["label"], batch["label"])
    assert np.array_equal(train["image"], task.preprocess({**batch, ROW_SEED: seeds}, train=True)["image"])
    other = task.preprocess({**batch, ROW_SEED: seeds + 1}, train=True)["image"]
    assert not np.array_equal(train["image"], other)  # other seeds, other crops
    full = decode(batch["image"][0])
    # Each training crop is a window of the image, flipped or not.
    windows = [full[y : y + crop, x : x + crop] for y in range(CROP_MARGIN + 1) for x in range(CROP_MARGIN + 1)]
    assert any(np.array_equal(train["image"][0], w) or np.array_equal(train["image"][0], w[:, ::-1]) for w in windows)
    evaluation = task.preprocess({**batch, ROW_SEED: seeds}, train=False)["image"]
    m = CROP_MARGIN // 2
    assert np.array_equal(evaluation[0], full[m : m + crop, m : m + crop])


def test_the_model_classifies_a_collated_batch_into_the_ten_classes(small):
    task, _ = small
    batch = {"image": np.zeros((4, 24, 24, 3), dtype=np.uint8), "label": np.arange(4)}
    x, y = task.collate(batch)
    assert x.shape == (4, 3, 24, 24) and x.dtype == torch.float32 and y.dtype == torch.long
    assert task.build_model()(x).shape == (4, len(CLASSES))


def test_the_recipe_limits_the_object_store_of_the_local_ray_it_starts(monkeypatch):
    from raytrain_loops.config import load_config
    from raytrain_loops.driver import ray_start
    from raytrain_loops.recipes import resolve

    started = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_start, "start_local_ray", lambda num_cpus, **kw: started.append((num_cpus, kw)))
    config = load_config(resolve("images_cls"))
    assert config.task.name == "images" and config.data.preprocess.num_cpus == 1
    ray_start.ensure_ray(config)
    cpus = max(os.cpu_count() or 1, 3)  # at least 2 workers + 1 CPU for the preprocessing tasks
    assert started == [(cpus, {"object_store_memory": 1_000_000_000})]
    ray_start.ensure_ray(load_config(resolve("default")))
    assert started[1] == (cpus, {})  # Ray's default size
