"""``raytrain-loops evaluate`` given what it cannot evaluate: a clear error naming the path, exit
code 2, before any data is prepared or any module named in the run's files is imported. (An
evaluation itself: ``cli/test_local_mode.py`` in this process, ``ray/test_cli_and_api_on_ray.py`` on 2 Ray workers.)"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import yaml

from raytrain_loops.checkpoint import files as ckpt
from raytrain_loops.cli import main


def _checkpoint(run: Path, config: dict | None = None) -> Path:
    """A run directory holding an intact checkpoint of step 4 (and ``config.yaml``, when given)."""
    d = run / "checkpoint_00000004"
    state = {"model": {"w": torch.zeros(3)}, "counters": {"step": 4}}
    ckpt.write_files(d, 0, {ckpt.STATE: state, ckpt.rank_file(0): {"data": {"epoch": 0, "batches": 4}}}, 1)
    if config is not None:
        (run / "config.yaml").write_text(yaml.safe_dump(config))
    return d


def _evaluate(capsys, *args: str) -> tuple[int, str]:
    code = main(["evaluate", *args])
    return code, capsys.readouterr().err


def test_what_is_not_an_intact_checkpoint_of_a_run_is_refused_naming_the_path(tmp_path, capsys):
    code, err = _evaluate(capsys, str(tmp_path / "nowhere"), "--local")
    assert code == 2 and f"{tmp_path / 'nowhere'} is not a checkpoint: no such directory" in err

    (tmp_path / "empty").mkdir()
    code, err = _evaluate(capsys, str(tmp_path / "empty"))
    assert code == 2 and f"{tmp_path / 'empty'} is not a checkpoint: it holds no manifest.rank0.json" in err

    bare = _checkpoint(tmp_path / "bare")
    code, err = _evaluate(capsys, str(bare), "--local")
    assert code == 2 and f"{tmp_path / 'bare' / 'config.yaml'} does not exist" in err

    damaged = _checkpoint(tmp_path / "damaged", {"task": {"name": "digits"}})
    state = damaged / ckpt.STATE
    state.write_bytes(state.read_bytes()[:-7])
    code, err = _evaluate(capsys, str(damaged), "--local")
    assert code == 2 and f"{damaged} is damaged: " in err and "differs from the manifest" in err


def test_a_task_module_named_in_config_yaml_is_not_imported_unless_named_again(tmp_path, capsys):
    module = "tests.not_imported_by_evaluate"
    d = _checkpoint(tmp_path / "run", {"task": {"name": f"{module}:Task"}})
    code, err = _evaluate(capsys, str(d), "--local")
    assert code == 2 and f"names the task '{module}:Task', not a built-in one" in err
    assert f"task.name={module}:Task" in err and module not in sys.modules
    # Named again by the caller: imported (here it does not exist, and the error says so).
    code, err = _evaluate(capsys, str(d), "--local", f"task.name={module}:Task")
    assert code == 2 and module in err and "names the task" not in err


def test_a_bad_override_names_the_key(tmp_path, capsys):
    d = _checkpoint(tmp_path / "run", {"task": {"name": "digits"}})
    code, err = _evaluate(capsys, str(d), "--local", "eval.bn_buffers=median")
    assert code == 2 and "eval.bn_buffers" in err
