"""A user's edit-and-rerun loop in local mode: the task's code edited under the same command (the
run name hashes the config, not the code) is refused before anything loads, naming the ways on;
a finished local run rerun on Ray workers says what happened and how to train anew."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from examples.custom_task import CONFIG
from raytrain_loops.cli import main

# A user's task module, its hidden layer's width edited between runs.
MODULE = """
from torch import nn
from examples.custom_task import SpiralTask

class TabTask(SpiralTask):
    def build_model(self):
        return nn.Sequential(nn.Linear(2, {width}), nn.ReLU(), nn.Linear({width}, 2))
"""


def _user_dir(tmp_path: Path, monkeypatch, width: int) -> None:
    """``mytask.py`` in the working directory, as the user edited it last (imported afresh)."""
    (tmp_path / "mytask.py").write_text(MODULE.format(width=width))
    sys.modules.pop("mytask", None)
    monkeypatch.chdir(tmp_path)


def _train(capsys, *overrides: str, local: bool = True) -> tuple[int, str]:
    code = main(["train", "recipe.yaml", *(["--local"] if local else []), *overrides])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_an_edited_model_is_refused_before_anything_loads_naming_both_ways_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # an edit within the second is read afresh
    recipe = {**CONFIG, "task": {"name": "mytask:TabTask"}, "loop": {"epochs": 1}}
    recipe["run"] = {"storage_path": str(tmp_path / "runs"), "progress": False}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    _user_dir(tmp_path, monkeypatch, 8)
    code, out = _train(capsys)
    assert code == 0, out
    (run,) = (tmp_path / "runs").iterdir()
    recorded = json.loads((run / "model.json").read_text())
    assert recorded["task"] == "mytask:TabTask" and recorded["parameters"]["2.weight"] == [2, 8]
    _on_ray_workers_it_trains_nothing_and_says_why(run, monkeypatch, capsys)

    _user_dir(tmp_path, monkeypatch, 16)  # the same command after the edit: the same run name
    before = sorted(p.name for p in run.iterdir())
    code, out = _train(capsys)
    assert code == 2 and "already finished" not in out, out
    assert f"the run in {run} was trained with another model than task 'mytask:TabTask' builds now" in out
    assert "model.parameters.0.weight ([8, 2] -> [16, 2])" in out and "model.parameters.2.weight ([2, 8] -> [2, 16])" in out
    assert "give it a new name (run.name=...)" in out and "set run.allow_config_change=true" in out
    assert sorted(p.name for p in run.iterdir()) == before and json.loads((run / "model.json").read_text()) == recorded

    # Allowed, and made longer, the run loads its checkpoint: the weights do not fit, said so.
    code, out = _train(capsys, "run.allow_config_change=true", f"run.name={run.name}", "loop.epochs=2")
    assert code == 2, out
    assert "Error(s) in loading state_dict" not in out and "Traceback" not in out
    assert f"run.name: checkpoint {run / 'checkpoint_00000032'} holds the weights of another model" in out
    assert "size mismatch for 0.weight" in out and "give the run a new name (run.name=...)" in out

    # A new name trains the new model; with MLflow, whose series are TensorBoard's, name for name.
    mlruns = tmp_path / "mlruns"
    code, out = _train(capsys, "run.name=wider", "run.progress=true", f"logging.mlflow.tracking_uri={mlruns}")
    assert code == 0 and "finished in" in out, out
    assert json.loads((tmp_path / "runs" / "wider" / "model.json").read_text())["parameters"]["2.weight"] == [2, 16]
    _steps_and_samples_per_second_agree(out)
    _one_name_per_metric_everywhere(tmp_path / "runs" / "wider", mlruns)


def _steps_and_samples_per_second_agree(out: str) -> None:
    """The progress line's steps/s and samples/s span the same time: every step a batch of 64."""
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == [f"step {s}/32 ({100 * s / 32:.0f}%)" for s in (10, 20, 30)] + [
        "step 32/32 (100%)"  # the last interval, steps 31-32, cut short by the run's end
    ], out
    assert lines[-1].startswith("step 32/32 (100%) | epoch 0 |"), lines[-1]
    for line in lines:
        found = re.search(r"\| ([\d.]+) steps/s, (\d+) samples/s[^|]*\(step time\) \| eta \S+ \(([\d.]+) steps/s overall\)$", line)
        assert found, line
        steps, samples = float(found[1]), float(found[2])
        assert samples == pytest.approx(64 * steps, rel=0.01, abs=64 * 0.05), line


def _on_ray_workers_it_trains_nothing_and_says_why(run: Path, monkeypatch, capsys) -> None:
    """The finished local run, rerun on 2 Ray workers: decided before Ray would start, and said."""
    from raytrain_loops.driver import fit as fit_module

    def ray_must_not_start(*args, **kwargs):
        raise AssertionError("Ray started")

    monkeypatch.setattr(fit_module, "ensure_ray", ray_must_not_start)
    accuracy = json.loads((run / "summary.json").read_text())["metrics"]["eval_accuracy"]
    code, out = _train(capsys, "scaling.num_workers=2", local=False)
    assert code == 0, out
    assert f"the run already finished at step 32: eval_accuracy={accuracy:.4g} (every metric: {run}/summary.json)" in out
    assert "nothing trained (it trained with scaling.num_workers=0: a run is the same run at any scale)" in out
    assert "To train anew, give it another run.name" in out
    assert "finished in" not in out and f"run directory: {run}" in out  # no old wall time as if trained now
    monkeypatch.undo()


def _one_name_per_metric_everywhere(run: Path, mlruns: Path) -> None:
    """TensorBoard and MLflow hold the same series under the names of the console and the files
    (``loss``, ``train_loss``, ``eval_accuracy``), each against the step: every interval, the
    last one cut short included; the epoch's averages; no position, throughput, memory or
    per-worker series (``logging.system_series`` is off)."""
    from tests.support.runfiles import records, tb_scalars

    mlflow = pytest.importorskip("mlflow")
    scalars = tb_scalars(run / "tb")
    assert {"loss", "acc", "lr", "grad_norm", "train_loss", "train_acc", "train_lr", "eval_accuracy"} <= set(scalars)
    assert not [t for t in scalars if "/" in t or "time" in t or "samples" in t or "rss" in t or t in ("step", "epoch")]
    assert [s for s, _ in scalars["loss"]] == [10, 20, 30, 32]
    assert [s for s, _ in scalars["train_loss"]] == [32] and [s for s, _ in scalars["eval_accuracy"]] == [32]
    (epoch,) = records(run / "epochs.jsonl")
    assert scalars["train_loss"][0][1] == pytest.approx(epoch["train_loss"])
    (evaluated,) = records(run / "eval.jsonl")
    assert scalars["eval_accuracy"][0][1] == pytest.approx(evaluated["eval_accuracy"])

    client = mlflow.MlflowClient(str(mlruns))
    (tracked,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert set(tracked.data.metrics) == set(scalars)
    for name, points in scalars.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(tracked.info.run_id, name))
        assert [s for s, _ in history] == [s for s, _ in points], name
        assert [v for _, v in history] == pytest.approx([v for _, v in points]), name


class _Rows(__import__("raytrain_loops").Task):
    """A Parquet split of ``ids`` and a map-style eval split of ``n`` rows (the data's identity by default)."""

    def __init__(self, path: str, n: int = 8):
        self.path, self.n = path, n

    def splits(self, data_dir):
        from raytrain_loops import MapSplit, ParquetSplit

        return {"train": ParquetSplit(self.path, ["x"]), "eval": MapSplit([float(i) for i in range(self.n)])}

    def collate(self, batch):
        import torch

        return torch.as_tensor(batch["x"], dtype=torch.float32)[:, None]

    def build_model(self):
        from torch import nn

        return nn.Linear(1, 1)

    def criterion(self, model, batch, ctx):
        from raytrain_loops import LossOutput

        return LossOutput(model(batch).square().mean(), sample_size=len(batch))


def _write_rows(path: Path, n: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"x": [float(i) for i in range(n)]}), path / "part-0.parquet")


def test_a_rerun_on_changed_data_is_refused_naming_the_split_and_one_regenerated_identically_is_not(tmp_path):
    from raytrain_loops import ConfigError, fit

    data = tmp_path / "rows"
    _write_rows(data, 64)
    config = {"scaling": {"num_workers": 0}, "run": {"storage_path": str(tmp_path / "runs")}, "data": {"batch_size": 8}}
    first = fit(config, task=_Rows(str(data)))
    assert first.trained
    pinned = json.loads((Path(first.run_dir) / "artefacts.json").read_text())["data"]["splits"]
    assert pinned["train"]["files"] == 1 and pinned["train"]["rows"] == 64
    assert pinned["eval"] == {"type": "builtins.list", "rows": 8}
    _write_rows(data, 64)  # regenerated identically: new mtimes, the same data
    assert not fit(config, task=_Rows(str(data))).trained  # "already finished"
    _write_rows(data, 72)
    with pytest.raises(ConfigError) as caught:
        fit(config, task=_Rows(str(data)))
    text = str(caught.value)
    print(text)
    assert text.startswith("task: the run in ") and "Changed: artefacts.data.train ('1 file, 64 rows, " in text
    assert "' -> '1 file, 72 rows, " in text and "run.allow_config_change=true" in text
    with pytest.raises(ConfigError, match=r"artefacts\.data\.eval \('builtins\.list of 8 rows' -> 'builtins\.list of 9 rows'\)"):
        _write_rows(data, 64)
        fit(config, task=_Rows(str(data), n=9))
    again = fit({**config, "run": {**config["run"], "allow_config_change": True}}, task=_Rows(str(data), n=9))
    assert not again.trained  # accepted: the finished run stays finished, its data pinned anew
