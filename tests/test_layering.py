"""The engine, config and the Ray-free data paths import no Ray (docs/architecture.md: the engine is Ray-free and unit-testable)."""

import subprocess
import sys


def test_engine_config_and_data_do_not_import_ray():
    code = "import sys, raytrain_loops.engine, raytrain_loops.config, raytrain_loops.data; print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _imported(code: str, prefixes: tuple[str, ...]) -> list[str]:
    """The top-level packages among ``prefixes`` that a fresh interpreter has imported after ``code``."""
    probe = f"{code}; import sys; print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(prefixes)!r}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return eval(out.stdout.strip())  # a list of names printed by the probe above


def test_a_worker_imports_only_the_task_it_runs_and_the_console_feed_imports_neither_torch_nor_ray_train():
    """Every Ray actor of a run imports what its module needs at start-up, on every run: a worker
    must not pay for every built-in task's libraries (torchmetrics, SciPy: detection), and the
    console's feed actor, started for every run, must not import torch."""
    heavy = ("torchmetrics", "scipy")
    assert _imported("import raytrain_loops.worker.train", heavy) == []
    assert _imported("import raytrain_loops.console.feed", ("torch", "ray")) == []
    # A task named in a recipe is imported then, with its own libraries.
    assert _imported("from raytrain_loops.tasks import build_task; build_task('detr', {})", heavy) == sorted(heavy)
