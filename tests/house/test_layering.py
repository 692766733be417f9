"""The house's rules (docs/architecture.md): the floors, each importing only from its own floor and
those below; no modules importing one another in a circle; no folder of more than 12 modules; the
Ray-free floors (config, storage, the errors, the engine, checkpoints but their ray_* modules, the
loop callbacks, data, the run directory, the runtime) and the console's display and feed import no
Ray; no module over 450 lines and no function over 60."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import raytrain_loops

PACKAGE = Path(raytrain_loops.__file__).parent
ROOT = "raytrain_loops"

FLOORS = [  # lowest first: a module imports from its own floor and the floors below it, never above
    f"{ROOT}.errors",  # every error a run raises or stops with, and a failure's root cause as a user reads it
    f"{ROOT}.config",  # typed config
    f"{ROOT}.storage",  # local paths and object-store URIs alike
    f"{ROOT}.streams",  # closing a stream that holds a thread or open files
    f"{ROOT}.ray_private",  # every private part of Ray that the floors above use
    f"{ROOT}.console",  # the display, the feed actor, the capture of Ray's output
    f"{ROOT}.recipes",  # the built-in recipes
    f"{ROOT}.engine",  # the update, the loop, torch.distributed
    f"{ROOT}.checkpoint",  # checkpoints: written, verified, found, restored, kept; on Ray in its ray_* modules
    f"{ROOT}.callbacks",  # the loop's callbacks
    f"{ROOT}.data",  # Parquet plans, map-style batches, samplers, converted image formats
    f"{ROOT}.tasks",  # what a recipe plugs in
    f"{ROOT}.rundir",  # the run directory: its file names, the stop board
    f"{ROOT}.runtime",  # one training process wired (a Ray worker's and local mode's), the batch source
    f"{ROOT}.controller",  # Ray: the Train controller's callbacks
    f"{ROOT}.worker",  # Ray: every Train worker
    f"{ROOT}.driver",  # Ray: the driver
    f"{ROOT}.sweeps",  # Ray Tune
    f"{ROOT}.jobs",  # the Ray Jobs client
    f"{ROOT}.tools",  # commands outside the training path
    f"{ROOT}.cli",  # the command line
    ROOT,  # the public API (raytrain_loops/__init__.py) alone
]
RAY_FREE_FLOORS = [f"{ROOT}.{f}" for f in ("config", "storage", "streams", "errors", "engine", "callbacks", "data")]
RAY_FREE_FLOORS += [f"{ROOT}.{f}" for f in ("rundir", "runtime", "console.display", "console.feed", "console.deaths")]
RAY_FREE_FLOORS += [f"{ROOT}.checkpoint.{m}" for m in ("best", "dcp_io", "files", "listing", "local_reporter", "reporter", "restore", "weights")]
MAX_MODULES = 12


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def floor_of(module: str) -> int | None:
    """The index in :data:`FLOORS` of the floor ``module`` is on: the longest floor that is the
    module or a package holding it (the root floor holds only the root module)."""
    found = [i for i, f in enumerate(FLOORS) if module == f or (f != ROOT and module.startswith(f + "."))]
    return max(found, key=lambda i: len(FLOORS[i]), default=None)


def imports(module: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) for every import of the package's own modules in ``module``, at any depth
    (in functions and ``TYPE_CHECKING`` blocks too): ``from a import b`` is ``a.b`` when that is a
    module, else ``a``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 packages
                parent = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            out += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in known else base) for a in node.names]
    return sorted({(line, m) for line, m in out if m == ROOT or m.startswith(ROOT + ".")})


def upward_imports(package: Path = PACKAGE) -> list[str]:
    """Every import of a module from a floor above its own, and every module on no floor."""
    found = modules(package)
    problems = [f"{m} is on no floor of FLOORS" for m in found if floor_of(m) is None]
    for module, path in found.items():
        own = floor_of(module)
        for line, target in imports(module, path, set(found)):
            theirs = floor_of(target)
            if own is not None and theirs is not None and theirs > own:
                where = f"{path.relative_to(package.parent)}:{line}"
                problems.append(f"{where} imports {target} (floor {FLOORS[theirs]}, above {FLOORS[own]})")
    return problems


def import_cycles(package: Path = PACKAGE) -> list[list[str]]:
    """The circles of the package's modules importing one another, each sorted (its strongly
    connected components of more than one module; imports in functions and ``TYPE_CHECKING``
    blocks count, and ``from pkg import name`` counts as an import of the package)."""
    found = modules(package)
    graph = {m: sorted({t for _, t in imports(m, p, set(found)) if t != m and t in found}) for m, p in found.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(circles)


def crowded_folders(package: Path = PACKAGE) -> list[str]:
    """The folders holding more than :data:`MAX_MODULES` modules (``__init__.py`` not counted), and
    those of modules without an ``__init__.py`` (setuptools' ``find`` would leave them out)."""
    folders = [package, *(d for d in package.rglob("*") if d.is_dir())]
    counts = {d: len([p for p in d.glob("*.py") if p.name != "__init__.py"]) for d in folders}
    crowded = [f"{d.relative_to(package.parent)}/: {n} modules" for d, n in sorted(counts.items()) if n > MAX_MODULES]
    bare = [f"{d.relative_to(package.parent)}/: no __init__.py" for d, n in sorted(counts.items()) if n and not (d / "__init__.py").exists()]
    return crowded + bare


def test_nothing_imports_from_a_floor_above_its_own_and_every_floor_is_there():
    assert [f for f in FLOORS if f not in modules()] == []  # a floor the list names but the package lost
    assert upward_imports() == []


def test_no_modules_import_one_another_in_a_circle():
    assert import_cycles() == []


def test_the_circle_check_counts_imports_under_type_checking_and_through_a_package(tmp_path):
    pkg = tmp_path / ROOT
    for name in ("__init__", "engine/__init__", "engine/step", "engine/meters", "engine/api", "tasks/__init__", "tasks/base"):
        (pkg / f"{name}.py").parent.mkdir(parents=True, exist_ok=True)
        (pkg / f"{name}.py").write_text("")
    (pkg / "engine/step.py").write_text("from raytrain_loops.engine import meters, api\n")
    (pkg / "engine/meters.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .step import Engine\n")
    (pkg / "tasks/__init__.py").write_text("from raytrain_loops.tasks.base import Task\n")
    (pkg / "tasks/base.py").write_text("def f():\n    from raytrain_loops.tasks import BUILTIN\n")
    assert import_cycles(pkg) == [
        [f"{ROOT}.engine.meters", f"{ROOT}.engine.step"],
        [f"{ROOT}.tasks", f"{ROOT}.tasks.base"],
    ]


def test_no_folder_holds_more_than_12_modules():
    assert crowded_folders() == []


def test_the_rules_catch_an_upward_import_a_module_on_no_floor_and_a_crowded_folder(tmp_path):
    """The checks above, on a package made for them: they would not pass a tree that breaks them."""
    pkg = tmp_path / ROOT
    for name in ("__init__", "config/__init__", "config/base", "driver/__init__", "driver/fit", "extra"):
        (pkg / f"{name}.py").parent.mkdir(parents=True, exist_ok=True)
        (pkg / f"{name}.py").write_text("")
    # An upward import inside a function, a relative one, and one of a submodule through its package.
    (pkg / "config/base.py").write_text("def f():\n    from raytrain_loops.driver import fit\n")
    (pkg / "config/__init__.py").write_text("from ..driver.fit import x\nfrom raytrain_loops.config import base\n")
    assert upward_imports(pkg) == [
        f"{ROOT}.extra is on no floor of FLOORS",
        f"{ROOT}/config/__init__.py:1 imports {ROOT}.driver.fit (floor {ROOT}.driver, above {ROOT}.config)",
        f"{ROOT}/config/base.py:2 imports {ROOT}.driver.fit (floor {ROOT}.driver, above {ROOT}.config)",
    ]
    for i in range(MAX_MODULES):  # and driver/fit.py
        (pkg / "driver" / f"m{i}.py").write_text("")
    (pkg / "jobs").mkdir()
    (pkg / "jobs" / "submit.py").write_text("")
    assert crowded_folders(pkg) == [f"{ROOT}/driver/: {MAX_MODULES + 1} modules", f"{ROOT}/jobs/: no __init__.py"]


def test_the_ray_free_floors_and_the_console_display_and_feed_do_not_import_ray():
    ray_free = [m for m in modules() if any(m == f or m.startswith(f + ".") for f in RAY_FREE_FLOORS)]
    assert len(ray_free) >= 50  # every module of those floors, not the packages alone
    code = f"import sys; import {', '.join(ray_free)}; print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_module_over_450_lines_and_no_function_over_60():
    long_modules, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(PACKAGE.parent))
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
