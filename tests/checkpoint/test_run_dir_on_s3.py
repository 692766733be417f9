"""Run directories on an object store: a real S3 API (moto's server) read and
written through pyarrow's S3 file system, as Ray Train and the run's own files use it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.fs as pafs
import pytest
import yaml

from raytrain_loops import storage
from raytrain_loops.callbacks.run_log import RunLog
from raytrain_loops.checkpoint import files as ckpt
from raytrain_loops.driver.run_checks import RunLock, RunLocked
from tests.support import s3
from tests.support.runfiles import tb_scalars
from tests.support.s3 import files_under

s3_server, s3_root = s3.s3_server, s3.s3_root  # moto's S3 server, a fresh prefix in its bucket


def test_the_storage_layer_keeps_the_endpoint_in_every_path(s3_root, tmp_path):
    run = storage.join(s3_root, "run")
    assert run.endswith("/run?" + s3_root.split("?")[1]) and storage.name(run) == "run"
    storage.write_text(storage.join(run, "a.txt"), "one")
    assert storage.read_text(storage.join(run, "a.txt")) == "one" and storage.read_text(storage.join(run, "b")) is None
    local = tmp_path / "ckpt"
    ckpt.write_files(local, 0, {ckpt.STATE: {"x": 1}, ckpt.rank_file(0): {}}, 1)
    storage.upload_dir(str(local), storage.join(run, "checkpoint_00000004"))
    [listed] = storage.list_dirs(run)
    assert listed == storage.join(run, "checkpoint_00000004")  # a path that still reaches the endpoint
    storage.copy_tree(listed, storage.join(run, "best", "checkpoint_00000004"))
    copy = storage.download_dir(storage.join(run, "best", "checkpoint_00000004"), str(tmp_path / "down"))
    assert ckpt.verify(copy) == 1
    storage.delete_tree(storage.join(run, "best"))
    assert set(files_under(run)) == {"a.txt", *(f"checkpoint_00000004/{n}" for n in os.listdir(local))}

    with RunLock(run), pytest.raises(RunLocked, match="in use by the driver"):  # on a bucket, too
        RunLock(run).acquire()
    assert "driver.lock" not in files_under(run)


def _step(loss: float) -> SimpleNamespace:
    """What the loop hands the run log after a step (a StepResult's fields)."""
    return SimpleNamespace(
        loss=loss, lr=0.1, grad_norm=1.0, sample_size=8, applied=True, skipped=None, compute_time=0.0
    )


def test_the_run_log_on_a_bucket_continues_from_the_checkpoint_the_next_attempt_resumes_from(s3_root, tmp_path):
    run = storage.join(s3_root, "run")
    first = RunLog(run, rank=0, total_steps=8, progress=False)
    for step in range(1, 7):
        first.on_step(_step(1.0 / step), step, 0)
        first.on_interval({"loss": 1.0 / step}, step)
        if step in (4, 6):
            first.on_eval({"eval_accuracy": step / 10}, step, 0)
            first.before_checkpoint()  # uploaded with the checkpoint of this step
        if step == 4:
            state = first.state_dict()
    # Killed before the checkpoint of step 6 was written: the next attempt resumes from step 4.
    second = RunLog(run, rank=0, total_steps=8, progress=False, start_step=4, kept=state["files"])
    for step in range(5, 9):
        second.on_step(_step(1.0 / step), step, 0)
        second.on_interval({"loss": 1.0 / step}, step)
    second.on_eval({"eval_accuracy": 0.7}, 8, 0)
    second.close()
    steps = [json.loads(line)["step"] for line in storage.read_text(storage.join(run, "metrics.jsonl")).splitlines()]
    assert steps == list(range(1, 9))
    evals = [json.loads(line) for line in storage.read_text(storage.join(run, "eval.jsonl")).splitlines()]
    assert [(e["step"], e["eval_accuracy"]) for e in evals] == [(4, 0.4), (8, 0.7)]
    scalars = tb_scalars(Path(storage.download_dir(storage.join(run, "tb"), str(tmp_path / "tb"))))
    assert [s for s, _ in scalars["loss"]] == list(range(1, 9))
    assert [s for s, _ in scalars["eval_accuracy"]] == [4, 8]
    assert not os.path.exists(second.local_dir)  # closed: its local copy is gone


def test_a_killed_workers_local_copies_are_removed_by_the_next_start(s3_root):
    run = storage.join(s3_root, "run")
    code = (
        "from raytrain_loops.callbacks.run_log import RunLog; import sys, time; "
        f"log = RunLog({run!r}, rank=0, total_steps=8, progress=False); print(log.local_dir, flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ)
    left = proc.stdout.readline().strip()
    assert os.path.isdir(left)
    os.kill(proc.pid, signal.SIGKILL)  # no cleanup runs
    proc.wait()
    assert os.path.isdir(left)
    log = RunLog(run, rank=0, total_steps=8, progress=False)  # the next attempt's worker
    assert not os.path.exists(left)
    log.close()


def test_a_profile_trace_of_a_run_in_a_bucket_is_uploaded_and_its_local_copy_removed(s3_root):
    import torch

    from raytrain_loops.callbacks.profiler import Profile
    from raytrain_loops.config import load_config
    from raytrain_loops.engine import Engine
    from tests.support import fakes

    run = storage.join(s3_root, "run")
    cfg = load_config(None, ["logging.profile.enabled=true", "logging.profile.start_step=1", "logging.profile.steps=2"])
    profile = Profile(cfg.logging.profile, run, 1, torch.device("cpu"))
    engine = Engine(fakes.make_model(), fakes.mean_loss, fakes.config("schedules.lr.value=0.05").engine, total_steps=4)
    for _ in range(4):
        profile.before_step(engine.step, [fakes.regression_data()])
        profile.on_step(engine.train_step([fakes.regression_data()]), engine.step, 0)
    profile.close()
    assert profile.traces == [storage.join(run, "profile", "rank1.3.pt.trace.json")]
    assert list(files_under(run)) == ["profile/rank1.3.pt.trace.json"]
    assert "traceEvents" in json.loads(storage.read_text(profile.traces[0]))
    assert not os.path.exists(profile._local_dir)


class _Result(SimpleNamespace):
    """One trial's outcome, as Tune's ResultGrid holds it."""


class _Grid(list):
    def get_best_result(self, metric, mode, scope):
        return (max if mode == "max" else min)(self, key=lambda r: r.metrics[metric])


def test_a_sweeps_outputs_go_to_the_bucket(s3_root, tmp_path, monkeypatch):
    import pandas as pd

    from raytrain_loops.config import load_config
    from raytrain_loops.config.sweep import load_sweep
    from raytrain_loops.sweeps.results import write_outputs

    monkeypatch.chdir(tmp_path)
    base = load_config(None)
    sweep = load_sweep(
        {"metric": "eval_accuracy", "mode": "max", "space": {"schedules.lr.value": {"choice": [0.1, 0.01]}}}, base
    )
    grid = _Grid(
        _Result(
            config={"schedules.lr.value": lr},
            metrics={"eval_accuracy": acc},
            metrics_dataframe=pd.DataFrame({"step": [1, 2], "eval_accuracy": [acc / 2, acc]}),
            path=f"/x/trial_0000{i}",
            error=None,
        )
        for i, (lr, acc) in enumerate([(0.1, 0.6), (0.01, 0.8)])
    )
    sweep_dir = storage.join(s3_root, "sweep")
    result = write_outputs(grid, sweep, base, base.run, sweep_dir)
    assert result.best_values == {"schedules.lr.value": 0.01}
    files = files_under(sweep_dir)
    assert set(files) == {"results.csv", "best.yaml", "metric_per_trial.png"}
    assert yaml.safe_load(storage.read_text(storage.join(sweep_dir, "best.yaml")))["schedules"]["lr"]["value"] == 0.01
    assert "trial_00001" in storage.read_text(storage.join(sweep_dir, "results.csv"))
    assert not any(Path(tmp_path).iterdir())  # nothing written to a local directory named "s3:"


@pytest.fixture
def throttled(s3_server):
    """A proxy in front of the moto server (tests/support/store_proxy.py) and a prefix in the bucket through it."""
    from tests.support.store_proxy import ThrottlingProxy

    proxy = ThrottlingProxy(s3_server)
    prefix = uuid.uuid4().hex[:8]
    through = f"s3://runs/{prefix}?endpoint_override={proxy.endpoint}&scheme=http&region=us-east-1"
    # Written straight to the server (the proxy forwards plain requests only), read through the proxy.
    yield proxy, through, pafs.FileSystem.from_uri(f"s3://runs?endpoint_override={s3_server}&scheme=http&region=us-east-1")[0], f"runs/{prefix}"
    proxy.close()


def test_a_parquet_read_survives_a_store_that_throttles_and_names_the_file_when_it_never_stops(throttled, monkeypatch):
    """The plan's reader (data/parquet.py) under 503 SlowDown answers: pyarrow's own retries give
    up first (2 attempts a request here), then the reader opens the file again with backoff. A store
    that keeps answering 503 stops the read naming the file, the row group and the answer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_loops.data import parquet

    proxy, root, fs, base = throttled
    pq.write_table(pa.table({"id": np.arange(1000)}), f"{base}/train/part-0.parquet", filesystem=fs, row_group_size=250)
    index = parquet.index_split(storage.join(root, "train"), ["id"])
    pieces = np.array([[0, g, 0, 250] for g in range(4)], dtype=np.int64)

    # pyarrow's own retries of a request: 2 attempts here (its default makes many more, with backoff).
    index.filesystem = pafs.S3FileSystem(
        endpoint_override=proxy.endpoint,
        scheme="http",
        region="us-east-1",
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=2),
    )
    proxy.fail("part-0.parquet", 7)  # more than pyarrow's attempts of one request, three times over
    reader = parquet.Reader(index)
    assert np.array_equal(reader.read(pieces)["id"], np.arange(1000))
    reader.close()
    assert proxy.failed == 7
    print(f"survived {proxy.failed} answers of 503 SlowDown")

    monkeypatch.setattr(parquet, "RETRY_BASE_S", 0.01)
    proxy.fail("part-0.parquet", 10_000)
    reader = parquet.Reader(index)
    with pytest.raises(OSError) as caught:
        reader.read(pieces)
    reader.close()
    text = str(caught.value)
    assert text.startswith(f"reading row group 0 of {index.files[0]} after {parquet.READ_ATTEMPTS} attempts: ")
    assert "SLOW_DOWN" in text or "503" in text
    assert proxy.failed >= parquet.READ_ATTEMPTS


def test_a_permanent_store_error_is_not_tried_again(throttled):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_loops.data import parquet

    proxy, root, fs, base = throttled
    pq.write_table(pa.table({"id": np.arange(10)}), f"{base}/t/part-0.parquet", filesystem=fs)
    index = parquet.index_split(storage.join(root, "t"), ["id"])
    fs.delete_file(f"{base}/t/part-0.parquet")
    before = proxy.forwarded
    with pytest.raises(OSError, match=r"^reading row group 0 of .*part-0.parquet: ") as caught:
        parquet.Reader(index).read(np.array([[0, 0, 0, 10]], dtype=np.int64))
    assert "after" not in str(caught.value).split(":")[0]
    assert proxy.forwarded - before <= 3  # one attempt (pyarrow's own request, no retry of ours)
