"""The driver's checks at the edges, in process: a task's overridden methods checked against the
``Task`` signatures before any data is prepared, splits that cannot be read by index refused, and ``data.materialize=auto`` decided on the
columns' size in memory, read from the Parquet footers."""

from __future__ import annotations

import inspect

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from examples.custom_task import CONFIG, SpiralTask
from raytrain_loops import ConfigError, MapSplit
from raytrain_loops.config import load_config
from raytrain_loops.driver.preflight import DataError, prepare


class PreparedTask(SpiralTask):
    prepared = False

    def prepare(self, data_dir):
        PreparedTask.prepared = True


def test_a_preprocess_without_train_is_refused_naming_the_method_and_its_signature_before_prepare():
    class WrongPreprocess(PreparedTask):
        def preprocess(self, batch):
            return batch

    with pytest.raises(ConfigError) as err:
        prepare(load_config(CONFIG), WrongPreprocess())
    assert str(err.value) == (
        "task.name: 'spirals': WrongPreprocess.preprocess(self, batch) cannot take the call Task.preprocess "
        "receives; expected preprocess(self, batch: dict[str, np.ndarray], train: bool) -> dict[str, np.ndarray]"
    )
    assert not PreparedTask.prepared  # refused before any data was prepared


def test_overrides_that_take_every_call_pass_and_those_that_cannot_are_refused():
    from raytrain_loops.driver.preflight import check_task_methods

    class Fine(SpiralTask):
        def preprocess(self, rows, train=True, **extra):  # another name, positionally called
            return rows

        def criterion(self, *args):
            return None

        @staticmethod
        def collate(batch):
            return batch

        def evaluate(self, model, batch):  # metrics only when eval_metrics is overridden
            return {}

    check_task_methods("fine", Fine())

    class NeedsMetrics(Fine):
        def eval_metrics(self):
            return {"m": object()}

    with pytest.raises(ConfigError, match=r"NeedsMetrics\.evaluate\(self, model, batch\) cannot take .* expected "):
        check_task_methods("m", NeedsMetrics())

    class ExtraRequired(SpiralTask):
        def build_model(self, width):
            return None

    with pytest.raises(ConfigError, match=r"ExtraRequired\.build_model\(self, width\) .*expected build_model\(self\)"):
        check_task_methods("x", ExtraRequired())

    class NotCallable(SpiralTask):
        collate = 3

    with pytest.raises(ConfigError, match="NotCallable.collate is int, not a method"):
        check_task_methods("x", NotCallable())


def test_every_built_in_task_passes_the_check():
    from raytrain_loops.driver.preflight import check_task_methods
    from raytrain_loops.tasks import BUILTIN_PATHS, builtin

    for name in BUILTIN_PATHS:
        cls = builtin(name)
        if not isinstance(cls, type):  # a function that builds the task: the class it returns
            cls = inspect.signature(cls, eval_str=True).return_annotation
        check_task_methods(name, cls.__new__(cls))


def _split_of(path, columns):
    from raytrain_loops.data.parquet import index_split
    from raytrain_loops.tasks import ParquetSplit

    split = ParquetSplit(str(path), columns)
    split.index = index_split(str(path), columns)
    return split


def test_materialize_auto_decides_on_the_columns_size_in_memory_read_from_the_footers(tmp_path, monkeypatch):
    from raytrain_loops.driver import trainer

    rows = 100_000
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "label": [f"category_{i % 3}" for i in range(rows)],  # dictionary-encoded: 1.6 KB on disk
            "text": [f"{x:032x}" for x in rng.integers(0, 2**62, rows)],  # plain, compressed on disk
            "x": np.zeros(rows, dtype=np.int64),  # run-length encoded: 0.4 KB on disk
            "flag": np.arange(rows) % 2 == 0,  # bits in memory
            "unread": [b"\0" * 1000] * rows,  # 100 MB in memory, not a column the task reads
        }
    )
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=25_000)
    read = ["label", "text", "x", "flag"]
    split = _split_of(tmp_path / "t.parquet", read)
    in_memory = table.select(read).nbytes  # 5.8 MB
    assert (tmp_path / "t.parquet").stat().st_size < in_memory / 2  # what auto measured: the file's size
    assert 0.9 * in_memory <= split.index.memory_bytes <= 1.3 * in_memory  # the footers' estimate
    for column in read:  # each column alone, dictionary-encoded and run-length encoded ones included
        alone = _split_of(tmp_path / "t.parquet", [column]).index.memory_bytes
        assert 0.9 * table[column].nbytes <= alone <= 1.3 * table[column].nbytes, column

    config = load_config({**CONFIG, "data": {"batch_size": 64, "materialize": "auto"}})
    monkeypatch.setattr(trainer, "MATERIALIZE_BELOW_BYTES", 4 << 20)  # the files fit under it, the table not
    assert not trainer.hold_in_memory(split, config)
    monkeypatch.setattr(trainer, "MATERIALIZE_BELOW_BYTES", 8 << 20)
    assert trainer.hold_in_memory(split, config)


class _Rows(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(8))


@pytest.mark.parametrize(
    "train,said",
    [
        (
            lambda d: DataLoader(d, batch_size=64),
            "split 'train' is a DataLoader, which a split cannot be: the engine shuffles, shards and "
            "batches the rows itself, and resumes an epoch exactly where it stopped by reading rows by their index. "
            "Pass the loader's dataset and collate_fn in a MapSplit: MapSplit(loader.dataset, "
            "collate_fn=loader.collate_fn)",
        ),
        (
            lambda d: MapSplit(DataLoader(d, batch_size=64)),
            "split 'train': MapSplit's dataset is a DataLoader, which a split cannot be: ",
        ),
        (
            lambda d: MapSplit(_Rows()),
            "split 'train': MapSplit's dataset is an iterable dataset (_Rows), which a split cannot be: the engine shuffles, "
            "shards and batches the rows itself, and resumes an epoch exactly where it stopped by reading rows by "
            "their index, which an iterable cannot do. Pass indexable data (a Dataset with __len__ and "
            "__getitem__, in a MapSplit), or write its rows to Parquet once in Task.prepare",
        ),
        (lambda d: _Rows(), "split 'train' is an iterable dataset (_Rows), which a split cannot be: "),
        (lambda d: MapSplit(iter(d)), "split 'train': MapSplit's dataset (iterator) has no __len__ and __getitem__: "),
    ],
)
def test_a_split_that_cannot_be_read_by_index_is_refused_saying_what_to_pass_instead(train, said):
    class Wrapped(SpiralTask):
        def splits(self, data_dir):
            return {**super().splits(data_dir), "train": train(super().splits(data_dir)["train"].dataset)}

    with pytest.raises(DataError) as err:
        prepare(load_config(CONFIG), Wrapped())
    assert str(err.value).startswith(said), str(err.value)
    assert str(err.value).endswith("(the inputs a split accepts: docs/your-task.md, 'Data')")
