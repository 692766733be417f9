"""Recovery, end to end on a local Ray: crashed workers, damaged checkpoints, and the errors
that must not be retried. Every fault here is injected through ``fault.plan``."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from raytrain_loops import fit
from raytrain_loops.callbacks import throughput
from raytrain_loops.checkpoint import files as ckpt
from raytrain_loops.driver.tracking import RUN_ID_FILE
from raytrain_loops.errors import TrainingStopped
from raytrain_loops.recipes import resolve
from tests.support.recording import batch_processes, counted_batches, restored
from tests.support.runfiles import records, tb_scalars

pytestmark = pytest.mark.ray


def _overrides(tmp_path: Path, name: str, record: Path, *extra: str, task: str = "RecordingDigits") -> list[str]:
    record.mkdir(parents=True, exist_ok=True)
    return [
        f"task.name=tests.support.recording:{task}",
        f"task.params={{record_dir: {record}, width: 16}}",
        f"data.dir={tmp_path / 'data'}",
        f"run.storage_path={tmp_path / 'runs'}",
        f"run.name={name}",
        "run.progress=false",
        "logging.every_steps=5",
        "accum.steps=2",  # 1347 rows / 2 workers / 32 = 21 batches: 10 updates an epoch, 1 batch left over
        "checkpoint.every_steps=6",
        "run.coalesce_reports=false",  # every checkpoint the cadence asks for: the restarts resume from them
        "eval.every_steps=0",
        *extra,
    ]


def _steps_in(run_dir: Path, log: str) -> list[int]:
    """The step of each line of one of a run's logs (``metrics.jsonl``...), in file order."""
    return [r["step"] for r in records(run_dir / log)]


def _state(result) -> dict:
    return ckpt.read_file(result.checkpoint, ckpt.STATE)


def _clocked(name: str) -> bool:
    """A metric measured by the clock or once per logging interval, not a function of the data."""
    base = name.split("/rank")[0]
    return base.endswith(("_time", "_per_s")) or base in throughput.METRICS


def _assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_killed_and_crashed_workers_resume_to_the_same_weights_seeing_each_sample_once(ray_session, tmp_path):
    """A run whose worker 1 is killed after step 15 and whose worker 0 raises after step 27 ends
    as the run without faults does, and its three attempts log to one MLflow run. Its rows are
    preprocessed (with a random augmentation) in Ray tasks, not by the training workers.

    The run without faults then has its newest checkpoint torn and is continued: the rerun restores
    the checkpoint before it, and a loss spike ends it with no retry and nothing written after it."""
    from ray.util.state import list_actors

    def dataset_managers() -> set[str]:  # Ray Train's Ray Data actor, of any run of the session
        return {a.actor_id for a in list_actors(filters=[("class_name", "=", "DatasetManager")], limit=1000)}

    managers_before = dataset_managers()  # a run given a Ray Dataset earlier in the session starts one
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # Both runs track (a callback's state is in the checkpoint compared below) and evaluate. The
    # restarts resume from checkpoints 12 and 24 and replay steps 13-15 and 25-27, where the ended
    # attempts had logged an evaluation (13, 26) and an interval (14, 26).
    common = [
        "loop.max_steps=36",
        "logging.every_steps=2",
        "eval.every_steps=13",
        f"logging.mlflow.tracking_uri={store}",
        "spike.factor=20",
        "spike.min_steps=5",
    ]
    task = "PreprocessedDigits"
    # The spike at step 40 is for the continuation of the run without faults (below).
    spike = "fault.plan=[{step: 40, rank: 1, kind: spike}]"
    clean_overrides = _overrides(tmp_path, "clean", tmp_path / "rec-clean", *common, spike, task=task)
    clean = fit(resolve("default"), overrides=clean_overrides)
    plan = "fault.plan=[{step: 15, rank: 1, kind: kill}, {step: 27, rank: 0, kind: raise}]"
    faulty = fit(
        resolve("default"),
        overrides=_overrides(tmp_path, "faulty", tmp_path / "rec-faulty", *common, plan, "run.max_failures=2", task=task),
    )
    # Both faults fired (once each) and the run still finished.
    assert sorted(p.name for p in (Path(faulty.run_dir) / "faults").iterdir()) == ["0.fired", "1.fired"]
    assert faulty.metrics["step"] == clean.metrics["step"] == 36
    # The last restart resumed mid-epoch (epoch 2, batch 8) from the newest checkpoint, 24, which
    # Ray may not have registered yet: reports are asynchronous, the files were complete.
    loaded = restored(faulty.run_dir)
    assert Path(loaded["checkpoint"]).name == "checkpoint_00000024" and loaded["skipped"] == []

    # Bit for bit: weights, optimizer moments, EMA, counters, the epoch's partial sums. Not the
    # progress line's smoothing: its logging intervals start again with each attempt, so after a
    # restart they end on other steps (the display continues, it does not replay).
    # Nor the epoch's sums of wall-clock figures (times, rates) and of the throughput callback's
    # figures, which it adds once per logging interval.
    clean_state, faulty_state = _state(clean), _state(faulty)
    assert clean_state["callbacks"].pop("RunLog").keys() == faulty_state["callbacks"].pop("RunLog").keys()
    sums = [state["meters"]["epoch"] for state in (clean_state, faulty_state)]
    assert sums[0].keys() == sums[1].keys()
    for epoch_sums in sums:
        for name in [n for n in epoch_sums if _clocked(n)]:
            del epoch_sums[name]
    assert "loss" in sums[0]
    _assert_same(clean_state, faulty_state)

    used, reference = counted_batches(tmp_path / "rec-faulty"), counted_batches(tmp_path / "rec-clean")
    assert used == reference  # the same rows in every micro-batch of every step
    # Preprocessed in Ray tasks: never in the process that trains on the rows.
    processes = batch_processes(tmp_path / "rec-faulty")
    assert len(processes) >= 36 * 2 * 2
    assert all(pre and pid not in pre for pid, pre in processes)
    per_epoch: dict[int, Counter] = {}
    for record in used.values():
        per_epoch.setdefault(record["epoch"], Counter()).update(record["ids"])
    for epoch, seen in per_epoch.items():
        assert max(seen.values()) == 1, f"epoch {epoch}: a row was used twice"
    assert sum(per_epoch[1].values()) == 10 * 2 * 2 * 32  # a full epoch: 10 updates x 2 micro x 2 workers

    # Each restart cut the run's logs back to its checkpoint: they, TensorBoard and MLflow (one
    # run) hold each step once, with the values of the run without faults.
    run_dir = Path(faulty.run_dir)
    assert _steps_in(run_dir, "metrics.jsonl") == list(range(1, 37))
    assert [r["loss"] for r in records(run_dir / "metrics.jsonl")] == [
        r["loss"] for r in records(Path(clean.run_dir) / "metrics.jsonl")
    ]
    assert _steps_in(run_dir, "eval.jsonl") == [13, 26, 36]  # steps 13 and 26 evaluated by two attempts each
    # The resumed groups' evaluations are the uninterrupted run's, figure for figure (every worker
    # evaluates with rank 0's BatchNorm statistics, which a checkpoint holds).
    assert records(run_dir / "eval.jsonl") == records(Path(clean.run_dir) / "eval.jsonl")
    assert _steps_in(run_dir, "epochs.jsonl") == [10, 20, 30]
    scalars = tb_scalars(run_dir / "tb")
    assert [s for s, _ in scalars["loss"]] == list(range(2, 37, 2))
    assert [s for s, _ in scalars["eval_accuracy"]] == [13, 26, 36]
    assert [s for s, _ in scalars["train_loss"]] == [10, 20, 30]  # each epoch's average at its last step
    client = pytest.importorskip("mlflow").MlflowClient(store)
    (run,) = client.search_runs(
        [client.get_experiment_by_name("raytrain-loops").experiment_id], "attributes.run_name = 'faulty'"
    )  # one run, not one per attempt
    run_id = run.info.run_id
    assert (run_dir / RUN_ID_FILE).read_text().strip() == run_id and run.info.status == "FINISHED"
    assert run.data.params["loop.max_steps"] == "36" and run.data.params["scaling.num_workers"] == "2"
    assert (
        run.data.params["fault.plan"]
        == "[{'step': 15, 'rank': 1, 'kind': 'kill', 'micro_batch': 0}, {'step': 27, 'rank': 0, 'kind': 'raise', 'micro_batch': 0}]"
    )
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(2, 37, 2))
    evals = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "eval_accuracy"))
    assert [s for s, _ in evals] == [13, 26, 36] and evals[-1][1] == pytest.approx(faulty.metrics["eval_accuracy"])
    assert {"summary.json", "config.yaml", "curves.png"} <= {f.path for f in client.list_artifacts(run_id)}
    assert (tmp_path / "mlartifacts" / run_id / "artifacts" / "summary.json").is_file()  # beside the database

    _a_damaged_newest_checkpoint_falls_back_and_a_loss_spike_stops_without_a_retry(
        Path(clean.run_dir), tmp_path / "rec-clean", clean_overrides
    )
    # Three runs, five worker groups, and no Ray Data actor: no run passes Ray Train a Dataset
    # (driver/trainer.py's Trainer leaves out the DatasetManager that Ray Train starts otherwise).
    assert list_actors(filters=[("class_name", "=", "RayTrainWorker")], limit=1000)
    assert dataset_managers() == managers_before


def _a_damaged_newest_checkpoint_falls_back_and_a_loss_spike_stops_without_a_retry(
    run: Path, record: Path, overrides: list[str]
) -> None:
    """The finished run of 36 steps has its newest checkpoint torn; the rerun of 42 steps restores
    the one before, and a loss spike at step 40 ends it: no retry, nothing written after the spike."""
    assert sorted(p.name for p in run.glob("checkpoint_0*")) == ["checkpoint_00000030", "checkpoint_00000036"]
    state = run / "checkpoint_00000036" / ckpt.STATE
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # a torn write
    # Retries left: the spike must not use them.
    with pytest.raises(
        TrainingStopped, match=r"LossSpikeError at step 40: loss spike at step 40: .* is \d+\.\dx the mean"
    ):
        fit(resolve("default"), overrides=[*overrides, "loop.max_steps=42", "run.max_failures=3"])
    loaded = restored(run)
    assert loaded["checkpoint"].endswith("checkpoint_00000030")
    assert [s["checkpoint"].rsplit("/", 1)[-1] for s in loaded["skipped"]] == ["checkpoint_00000036"]
    assert "differs from the manifest (damaged)" in loaded["skipped"][0]["reason"]
    # 31-36 redone from the intact checkpoint, in one attempt up to the spike (a retry would run
    # steps again); the log holds them in place of the first run's.
    ran = [r["step"] for r in records(record / "ids.rank0.jsonl") if r["micro"] == 0]
    assert ran == list(range(1, 37)) + list(range(31, 41))
    assert _steps_in(run, "metrics.jsonl") == list(range(1, 41))
    # The redone step 36 got a directory of its own next to the damaged one; nothing after the spike.
    checkpoints = sorted(p.name for p in run.glob("checkpoint_0*"))
    assert checkpoints == ["checkpoint_00000036", "checkpoint_00000036-2"]  # checkpoint.keep=2
    assert ckpt.verify(run / "checkpoint_00000036-2") == 2


def test_a_stop_decided_by_one_worker_alone_ends_every_worker_within_seconds(ray_session, tmp_path):
    record = tmp_path / "rec"
    overrides = _overrides(tmp_path, "alone", record, "loop.max_steps=30", "run.max_failures=2")
    overrides += [
        "task.name=tests.support.recording:StopsAlone",
        f"task.params={{record_dir: {record}, width: 16, stop_step: 3}}",
    ]
    # Worker 1 stops; worker 0 is then in DDP's all-reduce, waiting for it. Worker 1 finds no
    # agreement, raises, Ray ends the group, and the restarted group ends on the posted stop.
    with pytest.raises(TrainingStopped, match=r"TrainingError at step 3: worker 1 alone decided to stop"):
        fit(resolve("default"), overrides=overrides)
    ended = time.time()
    # Before the posted stop, worker 0 waited in DDP's all-reduce until gloo's 30-minute timeout.
    # The bound covers Ray ending the group and starting the second one, which finds the stop:
    # 10-20 s on a quiet 2-core machine, up to about 40 s beside other test processes.
    assert ended - float((record / "stopped").read_text()) < 75
    run = tmp_path / "runs" / "alone"
    # Worker 0 ran the 2 micro-batches of steps 1-3 once each, and was waiting for worker 1 in
    # step 4 when the group ended; the restarted group trained nothing.
    lines = (record / "ids.rank0.jsonl").read_text().splitlines()
    counts = Counter(json.loads(line)["step"] for line in lines)
    assert [counts[s] for s in (1, 2, 3)] == [2, 2, 2] and set(counts) <= {1, 2, 3, 4} and counts[4] <= 2
    (posted,) = run.glob("stops/*/rank1.json")
    assert json.loads(posted.read_text())["kind"] == "TrainingError"
