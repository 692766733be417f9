"""Preprocessing executed by Ray Data (raytrain_loops/worker/preprocessing.py, worker/feed.py): one memory
budget for all workers, measured in the object store while a slow run trains; state built once per
actor; a pool that cannot be placed said on the console and stopped; an execution ended within a
second when its stream closes."""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from raytrain_loops import LossOutput, ParquetSplit, Task, fit
from raytrain_loops.config import load_config
from raytrain_loops.config.run import DataConfig, PreprocessConfig
from raytrain_loops.data.parquet import ROW_SEED, index_split, train_plan
from raytrain_loops.runtime.batches import Batches, EpochPlans, preprocessed_here
from raytrain_loops.worker.preprocessing import EVAL_SHARE, TASK_ROWS, block_bytes, unit_groups

WIDE = 25_600
"""Floats each preprocessed row gets: 100 KiB, a hundred times the raw row."""


class Expanding(Task):
    """Rows of an id, preprocessed into 100 KiB each; every step sleeps (a slow consumer). With
    ``setups``, a directory: each preprocessing process builds its state once (a table it reads for
    every row), leaving a file named by its pid there, and counts its calls."""

    def __init__(self, path: str = "", sleep_s: float = 0.0, setups: str = ""):
        self.path, self.sleep_s, self.setups = path, sleep_s, setups
        self.table: np.ndarray | None = None

    def splits(self, data_dir):
        return {"train": ParquetSplit(self.path, ["id", "pad"])}

    def actor_setup(self):
        if self.setups:
            with open(os.path.join(self.setups, f"setup-{os.getpid()}"), "a") as f:
                f.write("built\n")
        self.table = np.arange(WIDE, dtype=np.float32)

    def preprocess(self, batch, train):
        ids = batch["id"]
        if self.setups:
            with open(os.path.join(self.setups, f"calls-{os.getpid()}"), "a") as f:
                f.write(f"{len(ids)}\n")
        return {"id": ids, "wide": ids[:, None].astype(np.float32) + self.table[None, :]}

    def collate(self, batch):
        return torch.as_tensor(batch["wide"][:, :4] - batch["id"][:, None].astype(np.float32))

    def build_model(self):
        return nn.Linear(4, 1)

    def criterion(self, model, batch, ctx):
        time.sleep(self.sleep_s)
        return LossOutput(model(batch).square().mean(), sample_size=len(batch))


def _ids(path: Path, rows: int) -> str:
    path.mkdir(parents=True, exist_ok=True)
    pad = np.zeros(rows, dtype=np.int64)
    pq.write_table(pa.table({"id": np.arange(rows), "pad": pad}), path / "part-0.parquet", row_group_size=128)
    return str(path)


def _store_stats(address: str) -> tuple[int, int]:
    """(bytes used, bytes spilled so far) of the object store, summed over the nodes."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    stats = get_memory_info_reply(get_state_from_address(address)).store_stats
    return int(stats.object_store_bytes_used), int(stats.spilled_bytes_total)


@pytest.mark.parametrize(
    ("rows_per_window", "at_once", "sizes"),
    [
        (TASK_ROWS / 4, 1, [1, 4, 2] + [1, 4, 4, 4, 3] * 2),
        (TASK_ROWS / 64, 1, [1, 6] + [1, 15] * 2),
        (TASK_ROWS * 2.5, 1, [1] * 39),
        (TASK_ROWS / 64, 8, [1, 2, 2, 2] + ([1] + [2] * 7 + [1]) * 2),
    ],
)
def test_a_preprocessing_task_covers_an_epochs_first_window_then_up_to_task_rows_of_one_epoch(
    rows_per_window, at_once, sizes
):
    """The tasks' groups of an execution resumed at window 1 of epoch 0 (10 rows skipped), then two
    whole epochs of 16 windows: in order, each of successive windows of one epoch, the skip in a
    group's first window only; in each epoch one window, then up to TASK_ROWS' worth (at least
    one window), and no larger than an epoch's windows shared among the tasks run at once."""
    units = [(0, w, 10 if w == 1 else 0) for w in range(1, 8)] + [(e, w, 0) for e in (1, 2) for w in range(16)]
    groups = unit_groups(units, rows_per_window, 16, at_once)
    assert [u for g in groups for u in g] == units
    for g in groups:
        assert len({u[0] for u in g}) == 1 and not any(u[2] for u in g[1:])
        assert [u[1] for u in g] == list(range(g[0][1], g[0][1] + len(g)))  # successive windows
    assert [len(g) for g in groups] == sizes


@pytest.mark.ray
def test_the_preprocessed_rows_of_all_workers_stay_within_one_budget_while_a_slow_run_trains(ray_session, tmp_path):
    """2 workers, each with 4 windows of 256 rows an epoch for 2 epochs, every row preprocessed into
    100 KiB (25 MiB a window, 200 MiB an epoch), a step that sleeps 40 ms, a budget of 48 MiB for
    both: the object store's peak, measured every 0.1 s beside the run, stays within the budget
    plus one block per worker, and nothing is spilled. The preprocessing runs in actor pools placed
    on the custom resource asked for (a GPU's stand-in), each actor building its state once."""
    address = ray_session.get_runtime_context().gcs_address
    base, spilled0 = _store_stats(address)
    budget = 48 * 2**20
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _store_stats(address)[0] - base)
            time.sleep(0.1)

    setups = tmp_path / "setups"
    setups.mkdir()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = fit(
            {
                "run": {"storage_path": str(tmp_path / "runs")},
                "scaling": {"num_workers": 2},
                "loop": {"epochs": 2},
                "data": {
                    "batch_size": 32,
                    "shuffle_buffer": 256,
                    "prefetch_batches": 1,
                    "preprocess": {
                        "batch_rows": 32,
                        "memory_gb": budget / 2**30,
                        "num_cpus": 0.25,
                        "actors": [1, 2],
                        "resources": {"accel": 1},
                    },
                },
                "logging": {"every_steps": 100},
            },
            task=Expanding(_ids(tmp_path / "ids", 2048), sleep_s=0.04, setups=str(setups)),
        )
    finally:
        stop.set()
        watcher.join()
    assert result.metrics["step"] == 2 * 2048 // 64
    block = 1.5 * block_bytes(budget / 2 * (1 - EVAL_SHARE))  # the largest block a worker's execution makes
    print(f"budget {budget / 2**20:.0f} MiB, peak {peak[0] / 2**20:.1f} MiB, blocks <= {block / 2**20:.1f} MiB")
    assert 0 < peak[0] <= budget + 2 * block
    assert _store_stats(address)[1] == spilled0
    built = {p.name.split("-")[1]: p.read_text().splitlines() for p in setups.glob("setup-*")}
    calls = {p.name.split("-")[1]: p.read_text().split() for p in setups.glob("calls-*")}
    assert set(calls) <= set(built) and 1 <= len(built) <= 2  # no more actors than "accel" places
    assert all(lines == ["built"] for lines in built.values())  # once per actor process
    assert sum(int(n) for rows in calls.values() for n in rows) >= 2 * 2048  # every row, both epochs
    assert max(len(rows) for rows in calls.values()) > 1  # many calls on one state


class _Holder:
    """An actor that holds the resources it was started with."""

    def ready(self) -> bool:
        return True


class _Slow(Task):
    """Rows of an id, each call of ``preprocess`` taking 0.2 s and leaving its start time in ``log``."""

    def __init__(self, log: str):
        self.log = log

    def preprocess(self, batch, train):
        with open(self.log, "a") as f:
            f.write(f"{time.time()}\n")
        time.sleep(0.2)
        return {"id": batch["id"]}


def _feed_args(tmp_path: Path, rows: int, **preprocess):
    index = index_split(_ids(tmp_path / "ids", rows), ["id", "pad"])
    data = DataConfig(batch_size=8, shuffle_buffer=64, preprocess=PreprocessConfig(batch_rows=8, **preprocess))
    return data, index, train_plan(index, 0, 0, 1, 0, 8, 64), EpochPlans(index, 0, 1, 0, 8, 64, 3)


@pytest.mark.ray
def test_a_pool_no_node_can_place_is_said_on_the_console_then_stops_the_run_naming_what_it_asks(ray_session, tmp_path):
    """The session's one node advertises "accel" 2, both held by an actor while the pool asks for
    one: nothing can be placed. (A resource no node has would leave Ray's autoscaler reporting the
    infeasible request to every later driver of the session.)"""
    from raytrain_loops.worker.preprocessing import RayPreprocessing

    holder = ray_session.remote(num_cpus=0, resources={"accel": 2})(_Holder).remote()
    ray_session.get(holder.ready.remote())
    data, index, plan, ahead = _feed_args(tmp_path, 256, resources={"accel": 1}, warn_after_s=0.5, timeout_s=3)
    said: list[str] = []
    feed = RayPreprocessing(1, said.append)
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError) as caught:
            list(feed(_Slow(str(tmp_path / "log")), data, plan, index, 0, (0, 0), True, ahead))
    finally:
        feed.close()
        ray_session.kill(holder)
    assert 3 <= time.monotonic() - start < 10
    print(said[0])  # the line a user sees
    assert len(said) == 1 and said[0].startswith("preprocessing: no preprocessed rows for 1 s")
    for text in (said[0], str(caught.value)):
        assert "each preprocessing task asks for CPU 1, accel 1 (data.preprocess.num_cpus, num_gpus, resources)" in text
        assert "the cluster's nodes offer " in text
        assert "accel 0 free of 2" in text and "CPU " in text
    assert "(data.preprocess.timeout_s=3)" in str(caught.value)
    assert not (tmp_path / "log").exists()  # nothing ran


@pytest.mark.ray
@pytest.mark.deadline
def test_a_stream_closed_early_ends_its_execution_within_a_second(ray_session, tmp_path):
    """An epoch stopped early and the attempt's end (the source closed): the work ahead is cancelled,
    no call of ``preprocess`` starts once ``close`` returned, and it returns within a second."""
    from raytrain_loops.worker.preprocessing import RayPreprocessing

    log = tmp_path / "log"
    data, index, plan, ahead = _feed_args(tmp_path, 1024, concurrency=2)
    feed = RayPreprocessing(1)
    rows = feed(_Slow(str(log)), data, plan, index, 0, (0, 0), True, ahead)
    first = next(iter(rows))
    assert 0 < len(first["id"]) <= 64  # parts of 8 rows, merged into blocks of at most a window here
    rows.close()  # the epoch stopped early: the execution goes on into the next epoch
    started = time.monotonic()
    feed.close()  # the attempt ends
    closed_in = time.monotonic() - started
    closed_at = time.time()
    time.sleep(1.5)
    starts = [float(t) for t in log.read_text().split()]
    print(f"closed in {closed_in * 1000:.0f} ms; {len(starts)} calls of 128 started")
    assert closed_in < 1.0
    assert max(starts) < closed_at and len(starts) < 1024 // 8


class _Released:
    """Stands for the Ray Dataset of an execution whose blocks come when the test releases them."""

    def __init__(self):
        self.blocks: queue.Queue = queue.Queue()

    def iter_batches(self, **_):
        while (block := self.blocks.get()) is not None:
            yield block


def _block(ids: range) -> dict[str, np.ndarray]:
    """A preprocessed block of epoch 0 as a task returns it (its epoch and node columns)."""
    from raytrain_loops.worker.preprocessing import EPOCH, NODE

    n = len(ids)
    return {"id": np.asarray(ids), EPOCH: np.zeros(n, np.int64), NODE: np.array(["node"] * n)}


@pytest.mark.ray
def test_the_thread_ahead_counts_a_wait_only_while_the_loop_waits_and_a_close_interrupts_it(ray_session, tmp_path):
    """A preprocessed split's batches made on the collate-ahead thread, from an execution whose
    blocks the test releases. While the loop does not ask (a long step, an evaluation), the
    thread's wait for a block is not the loop's: no bound counts it. Once the loop waits, the
    console line comes after ``warn_after_s`` and the error after ``timeout_s``, raised in the
    loop. A stream closed while its thread waits returns at once (the wait interrupted), and the
    block released after it is the next stream's."""
    from raytrain_loops.worker.feed import Execution, Starvation
    from raytrain_loops.worker.preprocessing import _Rows, _Stream

    _, index, _, _ = _feed_args(tmp_path, 256)
    config = load_config(None, ["data.batch_size=4", "scaling.num_workers=1"])
    said: list[str] = []
    released = _Released()
    stream = _Stream(Execution(released, Starvation({"CPU": 1.0}, 0.4, 0.8, said.append)), [(0, 0, 0)])
    source = Batches(_Slow(""), config, {"train": ParquetSplit("", ["id"], index)}, {"train": 256}, 0, 1, None,
                     lambda *_: _Rows(stream.epoch(0), stream.execution))  # fmt: skip
    batches = iter(source.batches("train", 0))
    released.blocks.put(_block(range(8)))
    assert next(batches)["id"].tolist() == [0, 1, 2, 3]
    time.sleep(1.2)  # the thread waits for a block all along; the loop does not
    assert said == [] and next(batches)["id"].tolist() == [4, 5, 6, 7]
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no preprocessed rows for 1 s.*\(data.preprocess.timeout_s=0.8\)"):
        next(batches)
    assert 0.8 <= time.monotonic() - started < 2.0
    assert len(said) == 1 and said[0].startswith("preprocessing: no preprocessed rows for 0 s: each ")

    said.clear()
    stream = _Stream(Execution(released := _Released(), Starvation({"CPU": 1.0}, 30, 60, said.append)), [(0, 0, 0)])
    batches = iter(source.batches("train", 0))
    released.blocks.put(_block(range(4)))
    assert next(batches)["id"].tolist() == [0, 1, 2, 3]
    time.sleep(0.2)  # the thread now waits for the next block
    started = time.monotonic()
    batches.close()
    assert time.monotonic() - started < 0.5
    assert not [t for t in threading.enumerate() if t.name == "collate-ahead"]
    released.blocks.put(_block(range(4, 8)))
    batches = iter(source.batches("train", 0))
    assert next(batches)["id"].tolist() == [4, 5, 6, 7]
    batches.close()
    stream.execution.close()


class _Ids(Task):
    def preprocess(self, batch, train):
        return {"id": batch["id"], "seed": batch[ROW_SEED]}


@pytest.mark.ray
def test_one_execution_runs_from_epoch_to_epoch_with_the_local_rows_and_an_epoch_stopped_early_is_left(
    ray_session, tmp_path
):
    """The train split's execution goes on into the next epochs: each epoch's rows and row seeds
    are the local path's, in its order; the rest of an epoch stopped early is dropped, not read
    into the next; one execution serves all three epochs."""
    from raytrain_loops.worker.preprocessing import RayPreprocessing

    data, index, _, ahead = _feed_args(tmp_path, 256)
    feed = RayPreprocessing(1)
    got, executions = {}, set()
    for epoch in range(3):
        plan = train_plan(index, 0, epoch, 1, 0, 8, 64)
        rows = feed(_Ids(), data, plan, index, 0, (0, epoch), True, ahead)
        blocks = []
        for block in rows:
            blocks.append(block)
            if epoch == 1 and sum(len(b["id"]) for b in blocks) >= 100:
                break  # the epoch stops early
        rows.close()
        executions.add(id(feed._train))
        got[epoch] = {k: np.concatenate([b[k] for b in blocks]) for k in ("id", "seed")}
        here = list(preprocessed_here(_Ids(), data, plan, index, 0, (0, epoch), True))
        want = {k: np.concatenate([b[k] for b in here]) for k in ("id", "seed")}
        n = len(got[epoch]["id"])
        assert n == (len(want["id"]) if epoch != 1 else n) and n >= 100
        for k in ("id", "seed"):
            assert np.array_equal(got[epoch][k], want[k][:n]), (epoch, k)
    feed.close()
    assert len(executions) == 1
    assert sorted(got[0]["id"].tolist()) == sorted(got[2]["id"].tolist()) == list(range(256))
