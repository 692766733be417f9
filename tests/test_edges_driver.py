"""The driver's checks at the edges, in process: a task's overridden methods checked against the
``Task`` signatures before any data is prepared, and ``data.materialize=auto`` decided on the
columns' size in memory, read from the Parquet footers."""

from __future__ import annotations

import pytest

from examples.custom_task import CONFIG, SpiralTask
from raytrain_loops import ConfigError
from raytrain_loops.config import load_config
from raytrain_loops.driver.preflight import prepare


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
        check_task_methods(name, cls.__new__(cls))
