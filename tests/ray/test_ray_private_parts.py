"""The private parts of Ray in one place (raytrain_loops/ray_private.py): each resolves against
the installed Ray, no other module of the package imports one, and the tests' own uses (their
measurements and Ray's real objects) are listed here. Without a running Ray: importing Ray's
modules starts none. The first test to run on a newer Ray (the README's paragraph "Ray.")."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest
import ray

from raytrain_loops import ray_private
from raytrain_loops.ray_private import ENTRIES, Private
from raytrain_loops.tools.check_clusters import launcher_problems

PACKAGE = Path(ray_private.__file__).parent
TESTS = Path(__file__).resolve().parents[1]

_MEASURE = "the tests' measurements and Ray's real objects"
_LOST = "the tests that use it fail; rewrite them against this Ray"
TEST_PARTS = [  # every private part of Ray the tests import, with the test that does
    Private("ray._private.ray_logging", "", f"{_MEASURE}: cli/test_console_display.py", _LOST),
    Private("ray._private.worker", "", f"{_MEASURE}: cli/test_console_display.py, ray/test_worker_death_lines.py, capture_ray_deaths.py", _LOST),
    Private("ray._private.internal_api", "get_memory_info_reply", f"{_MEASURE}: data/test_preprocess_on_ray_data.py", _LOST),
    Private("ray._private.internal_api", "get_state_from_address", f"{_MEASURE}: data/test_preprocess_on_ray_data.py", _LOST),
    Private("ray.autoscaler._private.aws", "config", f"{_MEASURE}: ray/test_cluster_files.py", _LOST),
    Private("ray.autoscaler._private.gcp", "config", f"{_MEASURE}: ray/test_cluster_files.py", _LOST),
    Private("ray.train.v2._internal.exceptions", "WorkerHealthCheckFailedError", f"{_MEASURE}: ray/test_worker_death_lines.py", _LOST),
    Private("ray.train.v2._internal.exceptions", "WorkerHealthCheckTimeoutError", f"{_MEASURE}: ray/test_worker_death_lines.py", _LOST),
    Private(
        "ray.train.v2._internal.execution.checkpoint.checkpoint_manager",
        "CheckpointManager",
        f"{_MEASURE}: checkpoint/test_retention_best.py",
        _LOST,
    ),
    Private("ray.train.v2._internal.execution.storage", "StorageContext", f"{_MEASURE}: checkpoint/test_retention_best.py", _LOST),
    Private(
        "ray.train.v2._internal.execution.training_report", "_TrainingReport", f"{_MEASURE}: checkpoint/test_retention_best.py", _LOST
    ),
]


def _private_module(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "ray" and any(p.startswith("_") for p in parts)


def private_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every import of a private part of Ray in ``path``: a module with a
    ``_``-named package on its path (name ``""`` for ``import``), or a ``_``-named name from Ray."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, "") for a in node.names if _private_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray":
            found += [
                (node.lineno, node.module, a.name)
                for a in node.names
                if _private_module(node.module) or a.name.startswith("_")
            ]
    return found


@pytest.mark.parametrize("entry", [*ENTRIES, *TEST_PARTS], ids=lambda e: e.name.strip("."))
def test_every_private_part_of_ray_in_use_is_in_the_installed_ray(entry):
    found, lacking = entry.resolve()
    assert lacking is None, entry.missing(lacking)
    assert found is not None


def reaches(path: Path, words: set[str]) -> list[tuple[int, str]]:
    """(line, word) where ``path``'s code reaches a private part of Ray without an import: a
    ``_``-named attribute of Ray's among ``words``, or a private module's path in a string."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in words:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            word = node.value
            if word in words or (re.fullmatch(r"ray(\.\w+)+", word) and _private_module(word)):
                found.append((node.lineno, word))
    return found


def test_no_module_but_ray_private_reaches_a_private_part_of_ray():
    """Imports of a private part of Ray, and the code that reaches one without an import (a
    ``_``-named attribute of Ray's, a private module's path in a string), are in ray_private.py
    alone; the door imports Ray's modules only when an accessor runs."""
    door = Path(ray_private.__file__)
    words = {p for e in ENTRIES for p in e.attr.split(".") if p.startswith("_")}
    assert "_current_executor" in words  # an attribute of Ray's objects, not a module
    outside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != door:
            where = path.relative_to(PACKAGE.parent)
            outside += [f"{where}:{line}: {m} {n}".rstrip() for line, m, n in private_imports(path)]
            outside += [f"{where}:{line}: {word}" for line, word in reaches(path, words)]
    assert outside == []
    assert private_imports(door) == [] and len(reaches(door, words)) > 0


def test_the_tests_private_imports_of_ray_are_all_listed():
    used = {(m, n) for p in sorted(TESTS.rglob("*.py")) for _, m, n in private_imports(p)}
    assert used == {(e.module, e.attr) for e in TEST_PARTS}


def test_a_missing_part_names_the_ray_version_and_says_its_fallback_once(caplog):
    gone = Private("ray._private.worker", "no_such_part", serves="a feature", without="the feature is off")
    with caplog.at_level(logging.WARNING, logger=ray_private.LOGGER):
        assert ray_private.get(gone) is None and ray_private.get(gone) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"ray {ray.__version__}: ray._private.worker.no_such_part is missing (serves a feature); the feature is off"
    ]
    needs = Private("ray._private.worker", "print_to_stdstream", "a", "b", needs=("no_such_method",))
    assert needs.resolve() == (None, "ray._private.worker.print_to_stdstream.no_such_method")
    assert Private("ray.data.dataset", "Dataset._no_executor", "a", "b").resolve() == (
        None,
        "ray.data.dataset.Dataset._no_executor",
    )
    assert Private("ray._private.no_such_module", "x", "a", "b").resolve() == (None, "ray._private.no_such_module")


def test_preprocessing_is_placed_on_its_node_first_while_ray_data_reads_the_deprecated_field(monkeypatch):
    """``DataContext.scheduling_strategy`` (deprecated by Ray): set where the installed Ray has it;
    where a Ray has dropped it, left alone (no attribute Ray would not read) and said once."""
    from ray.data import DataContext
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy("ab" * 28, soft=True)
    ctx = DataContext()
    ray_private.place_first_on(ctx, here)
    assert ctx.scheduling_strategy is here and ctx.scheduling_strategy_large_args is here
    dropped = Private("ray.data.context", "DataContext", "placement", "placed by Ray Data", needs=("no_such_field",))
    monkeypatch.setattr(ray_private, "DATA_PLACEMENT", dropped)
    ctx = DataContext()
    ray_private.place_first_on(ctx, here)
    assert ctx.scheduling_strategy is not here and not hasattr(ctx, "no_such_field")


def test_the_cluster_lint_reports_a_ray_without_its_parts_as_a_problem(monkeypatch):
    gone = Private("ray.autoscaler._private.util", "no_prepare_config", "the lint", "no lint", fallback=False)
    monkeypatch.setattr(ray_private, "PREPARE_CONFIG", gone)
    cfg = {"cluster_name": "c", "provider": {"type": "aws", "region": "us-east-1"}}
    assert launcher_problems(cfg, "x.yaml")[-1] == (
        f"x.yaml: cannot be judged as `ray up` runs it: ray {ray.__version__}: "
        "ray.autoscaler._private.util.no_prepare_config is missing (serves the lint)"
    )


def test_a_trainer_given_no_ray_dataset_leaves_out_ray_trains_datasets_callback():
    """Ray Train's callback found through the door is the one Ray adds: the trainer drops it."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrain_loops.driver.trainer import Trainer

    scaling = ScalingConfig(num_workers=1)
    rays = TorchTrainer(lambda: None, scaling_config=scaling)._create_default_callbacks()
    ours = Trainer(lambda: None, scaling_config=scaling)._create_default_callbacks()
    datasets = ray_private.datasets_callback()
    assert [type(c) for c in rays if not isinstance(c, datasets)] == [type(c) for c in ours]
    assert len(ours) == len(rays) - 1
