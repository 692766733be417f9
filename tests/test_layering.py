"""The house's rules (docs/architecture.md): the engine, the loop callbacks, the console's display,
config, data, storage and the runtime (local mode among it) import no Ray; no module over 450 lines and no function over 60."""

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import raytrain_loops

RAY_FREE = [
    "raytrain_loops.engine",
    "raytrain_loops.config",
    "raytrain_loops.data",
    "raytrain_loops.storage",
    "raytrain_loops.console.display",
    "raytrain_loops.console.feed",
    "raytrain_loops.runtime.batches",
    *(f"raytrain_loops.runtime.{m.name}" for m in pkgutil.iter_modules([str(Path(raytrain_loops.__file__).parent / "runtime")])),
    *(f"raytrain_loops.callbacks.{m.name}" for m in pkgutil.iter_modules([str(Path(raytrain_loops.__file__).parent / "callbacks")])),
]


def test_the_engine_callbacks_display_config_data_storage_and_runtime_do_not_import_ray():
    assert len(RAY_FREE) >= 18  # every callback and runtime module is in the list
    code = f"import sys; import {', '.join(RAY_FREE)}; print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_module_over_450_lines_and_no_function_over_60():
    package = Path(raytrain_loops.__file__).parent
    long_modules, long_functions = [], []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(package.parent))
        if len(text.splitlines()) > 450:
            long_modules.append((name, len(text.splitlines())))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60:
                long_functions.append((name, node.name, node.end_lineno - node.lineno + 1))
    assert long_modules == [] and long_functions == []


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
