"""``data.dir`` anywhere: a URI prepared in a local staging directory and uploaded to a real S3
API (moto's server), every wait on the store bounded; each node's reach of the data; the
preprocessing CPUs; and a failure inside a preprocessing task shown as its own error, file and node."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_loops import storage
from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.data import staging
from raytrain_loops.data.reach import Unreachable, check_here
from raytrain_loops.driver.preflight import DataError, data_location, prepare
from raytrain_loops.errors import own_message, root_cause
from raytrain_loops.tasks import ParquetSplit, Task
from tests.support import s3
from tests.support.s3 import files_under

s3_server, s3_root = s3.s3_server, s3.s3_root  # moto's S3 server, a fresh prefix


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_an_upload_sends_only_what_the_store_lacks_or_holds_in_another_version(s3_root, tmp_path, monkeypatch):
    local = tmp_path / "stage"
    _write(local / "a" / "one.parquet", b"1" * 100)
    _write(local / "two.parquet", b"2" * 10)
    _write(local / "two.tmp123", b"half written")  # a writer's temporary file
    _write(local / ".hidden", b"x")
    lines: list[str] = []
    monkeypatch.setattr(staging, "PROGRESS_BYTES", 0)
    monkeypatch.setattr(staging, "PROGRESS_EVERY_S", 0.0)
    assert sorted(staging.upload_missing(local, s3_root, say=lines.append)) == ["a/one.parquet", "two.parquet"]
    assert files_under(s3_root) == {"a/one.parquet": 100, "two.parquet": 10}
    assert lines[0].startswith("uploading 2 files") and any(" of 0 MiB" in line for line in lines[1:])
    assert staging.upload_missing(local, s3_root, say=lines.append) == []  # nothing new: not even read

    _write(local / "two.parquet", b"3" * 10)  # the same size, written again: uploaded again
    os.utime(local / "two.parquet", ns=(1, 1))
    assert staging.upload_missing(local, s3_root) == ["two.parquet"]
    assert storage.read_bytes(storage.join(s3_root, "two.parquet")) == b"3" * 10
    storage.delete(storage.join(s3_root, "a", "one.parquet"))  # gone from the store: uploaded again
    assert staging.upload_missing(local, s3_root) == ["a/one.parquet"]

    other = tmp_path / "another-driver"  # the same set prepared elsewhere: the store has it
    _write(other / "a" / "one.parquet", b"1" * 100)
    _write(other / "two.parquet", b"3" * 10)
    assert staging.upload_missing(other, s3_root) == []
    _write(other / "two.parquet", b"4" * 10)  # then changed there: uploaded
    os.utime(other / "two.parquet", ns=(2, 2))
    assert staging.upload_missing(other, s3_root) == ["two.parquet"]


def test_the_staging_directory_is_one_per_uri_and_kept(tmp_path):
    a = staging.staging_dir("s3://b/x?endpoint_override=h:1", str(tmp_path))
    assert a == staging.staging_dir("s3://b/x?endpoint_override=h:1", str(tmp_path))
    assert a != staging.staging_dir("s3://b/y?endpoint_override=h:1", str(tmp_path))
    assert (a / "uri.txt").read_text().strip() == "s3://b/x?endpoint_override=h:1"
    assert staging.local_files(a) == {}  # uri.txt is not data


@pytest.fixture
def silent_store():
    """A TCP server that accepts connections and never answers: a store that stopped responding."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_a_store_that_stops_answering_fails_the_upload_in_bounded_time_naming_data_dir(
    silent_store, tmp_path, monkeypatch
):
    monkeypatch.setattr(staging, "LIST_TIMEOUT_S", 1.0)
    uri = f"s3://bucket/data?endpoint_override={silent_store}&scheme=http&region=us-east-1"
    config = load_config(None, [f"data.dir={uri}"])
    monkeypatch.setattr(staging, "STAGING_ROOT", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    with pytest.raises(DataError, match=r"data\.dir=s3://bucket/data.*no answer from the store in 1 s"):
        prepare(config, None)
    assert time.monotonic() - start < 30
    assert not (tmp_path / "s3:").exists()


def test_an_upload_that_stalls_names_the_file(tmp_path):
    class Stalled:
        """An output stream that takes the first chunk, then never returns."""

        def open_output_stream(self, path):
            return self

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, data):
            time.sleep(3600)

    _write(tmp_path / "f.parquet", b"x" * 10)
    progress = staging._Progress(10, "s3://b/d", print)
    with pytest.raises(staging.UploadError, match=r"f\.parquet to b/d/f\.parquet: no progress in 1 s"):
        staging.upload_one(Stalled(), tmp_path / "f.parquet", "b/d/f.parquet", progress, stall_s=1.0)


def test_a_uri_data_dir_is_prepared_locally_uploaded_and_named_by_the_splits(s3_root, tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "STAGING_ROOT", str(tmp_path / "staging"))
    monkeypatch.chdir(tmp_path)
    uri = storage.join(s3_root, "data")
    task, splits, rows = prepare(load_config(None, [f"data.dir={uri}"]), None)
    assert splits["train"].path == storage.join(uri, "digits", "train.parquet")  # the endpoint kept
    assert rows == {"train": 1347, "eval": 450}
    assert set(files_under(uri)) == {"digits/train.parquet", "digits/test.parquet"}
    staged, where = data_location(uri)
    assert where == uri and (staged / "digits" / "train.parquet").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["staging"]  # no local "s3:" directory


def test_a_data_dir_pyarrow_cannot_open_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.dir.*'nosuch://bucket/x' is not a URI pyarrow can open"):
        data_location("nosuch://bucket/x")
    local, where = data_location(f"file://{tmp_path}")
    assert local == where == tmp_path


def test_a_node_that_cannot_open_a_split_is_named_with_data_dir(tmp_path):
    from raytrain_loops.data.parquet import index_split

    data = tmp_path / "data" / "set"
    data.mkdir(parents=True)
    pq.write_table(pa.table({"x": [1, 2]}), data / "part-0.parquet")
    split = ParquetSplit(str(data), ["x"])
    split.index = index_split(split.path, ["x"])
    check_here(str(tmp_path / "data"), {"train": split}, "10.0.0.2 (node id abc)")  # it can
    (data / "part-0.parquet").unlink()  # as on a node that does not have the driver's disk
    with pytest.raises(Unreachable) as caught:
        check_here(str(tmp_path / "data"), {"train": split}, "10.0.0.2 (node id abc)")
    text = str(caught.value)
    assert text.startswith(f"data.dir={tmp_path / 'data'}: node 10.0.0.2 (node id abc) cannot open split 'train'")
    assert "part-0.parquet" in text and "put data.dir on storage every node reaches" in text
    with pytest.raises(Unreachable, match=r"^split 'train' \(.*named by the task\): node n cannot open"):
        check_here(str(tmp_path / "elsewhere"), {"train": split}, "n")


def test_a_split_held_in_memory_is_not_read_by_any_node(tmp_path):
    from raytrain_loops.data.parquet import index_split

    pq.write_table(pa.table({"x": [1]}), tmp_path / "t.parquet")
    split = ParquetSplit(str(tmp_path / "t.parquet"), ["x"])
    split.index = index_split(split.path, ["x"])
    split.index.table = object()  # held: workers slice the copy in the object store
    (tmp_path / "t.parquet").unlink()
    check_here(str(tmp_path), {"train": split}, "n")


def test_the_cause_shown_is_the_raisers_own_message_without_ray_datas_retry_hint():
    inner = FileNotFoundError(
        "/data/part-00000.parquet\nFailed to apply UDF transform after 1/1 attempts (total backoff 0.0s).\n"
        "To change retry attempts, backoff, or which errors are retried, configure `ray.data.DataContext`"
    )
    assert own_message(inner) == "/data/part-00000.parquet"
    assert (
        root_cause(ValueError("Traceback (most recent call last):\n  File x\nKeyError: 'a'"))
        == "ValueError: KeyError: 'a'"
    )


class _Labels(Task):
    """A task that preprocesses its rows (as they are): its windows are read in preprocessing tasks."""

    def preprocess(self, batch, train):
        return {"label": batch["label"]}


@pytest.mark.ray
def test_a_preprocessing_task_that_fails_to_read_a_file_reaches_the_cli_as_its_own_error(ray_session, tmp_path, capsys):
    from raytrain_loops.cli import _failed
    from raytrain_loops.config.run import DataConfig
    from raytrain_loops.data.parquet import eval_plan, index_split
    from raytrain_loops.worker.preprocessing import RayPreprocessing

    missing = tmp_path / "part-00000.parquet"
    pq.write_table(pa.table({"label": list(range(10))}), missing)
    index = index_split(str(tmp_path), ["label"])
    missing.unlink()  # gone after the driver indexed it: the task's read fails
    with pytest.raises(Exception) as caught:
        list(RayPreprocessing(1)(_Labels(), DataConfig(), eval_plan(index, 1, 0), index, 0, (0, 0), False))
    assert _failed("train", caught.value) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"raytrain-loops: train failed: OSError: reading row group 0 of {missing}: ")
    assert "No such file or directory" in last
    assert "(in Ray task " in last and " on node " in last and "Traceback" not in last
    # As a training worker's failure reaches the driver: pickled (Ray Train returns the exception).
    from ray import cloudpickle

    assert root_cause(cloudpickle.loads(cloudpickle.dumps(caught.value))) == root_cause(caught.value)


@pytest.mark.ray
def test_the_driver_checks_each_node_reads_the_streamed_splits_and_the_preprocessing_cpus(ray_session, tmp_path, capsys):
    from raytrain_loops.data.parquet import index_split
    from raytrain_loops.driver.nodes import check_nodes, check_preprocess_cpus
    from raytrain_loops.tasks import build_task

    data = tmp_path / "set"
    data.mkdir()
    pq.write_table(pa.table({"x": [1, 2]}), data / "part-0.parquet")
    split = ParquetSplit(str(data), ["x"])
    split.index = index_split(split.path, ["x"])
    config = load_config(None, [f"data.dir={tmp_path}", "data.preprocess.num_cpus=3"])
    check_nodes(config, {"train": split}, held=set())
    (data / "part-0.parquet").unlink()
    check_nodes(config, {"train": split}, held={"train"})  # read by no node
    with pytest.raises(DataError, match=rf"^data\.dir={tmp_path}: node \S+ \(node id \w+\) cannot open split 'train'"):
        check_nodes(config, {"train": split}, held=set())

    images = build_task("images", {})  # it preprocesses in Ray tasks
    check_preprocess_cpus(load_config(None, ["data.preprocess.num_cpus=2"]), images, {"train": split})  # 4 - 2 left
    with pytest.raises(ConfigError, match=r"data\.preprocess\.num_cpus.*asks 3 CPUs.*2 of them left beside the 2"):
        check_preprocess_cpus(config, images, {"train": split})
    # Custom resources and GPUs on one node: the session's node advertises accel 2 and no GPU.
    check_preprocess_cpus(load_config(None, ["data.preprocess.resources={accel: 2}"]), images, {"train": split})
    with pytest.raises(ConfigError, match=r"^data\.preprocess\.resources\.accel: .*asks accel 3 on one node, but the nodes have accel 2$"):
        check_preprocess_cpus(load_config(None, ["data.preprocess.resources={accel: 3}"]), images, {"train": split})
    capsys.readouterr()
    check_preprocess_cpus(load_config(None, ["data.preprocess.num_gpus=1"]), images, {"train": split})
    assert capsys.readouterr().out.startswith("data.preprocess: no node advertises GPU yet: the preprocessing waits")


def test_a_data_dir_only_the_head_has_stops_the_run_naming_data_dir_and_the_node(cluster, tmp_path):
    """On two nodes that share no disk, a local data.dir streamed by the workers
    (data.materialize=never) is refused before training, naming data.dir and the second node."""
    cluster.ensure_second()  # left running for the next multi-node test
    assert not cluster.second_sees(tmp_path)
    second = cluster.second_node_id()
    args = ["default", "loop.max_steps=4", "data.materialize=never", "run.progress=false"]
    args += [f"data.dir={tmp_path / 'data'}", f"run.storage_path={tmp_path / 'runs'}"]
    out = cluster.cli("train", *args, timeout=300)
    last = out.stderr.strip().splitlines()[-1]
    print(last)  # the error a user sees
    assert out.returncode == 2, out.stdout + out.stderr
    assert last.startswith(f"raytrain-loops: error: data.dir={tmp_path / 'data'}: node ")
    assert (
        f"(node id {second[:12]}) cannot open split 'train' ({tmp_path / 'data' / 'digits' / 'train.parquet'})" in last
    )
    assert "FileNotFoundError" in last and "put data.dir on storage every node reaches" in last
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("checkpoint_*"))


def test_the_built_in_tasks_read_a_uri_data_dir_from_the_store(s3_root, tmp_path, monkeypatch):
    """seamseg's map-style rows, dino's k-NN bank, detr's and images' Parquet splits: every path
    a worker reads names the bucket, and reading it there gives the rows prepared on the driver."""
    import torch

    monkeypatch.setattr(staging, "STAGING_ROOT", str(tmp_path / "staging"))
    uri = storage.join(s3_root, "data")
    params = {
        "seamseg": {"train_images": 48, "validation_images": 16, "width": 8},
        "detr": {"train_images": 64, "validation_images": 16},
        "images": {"train_images": 300, "eval_images": 100, "size": 32, "width": 8},
        "dino": {},
    }
    for name, task_params in params.items():
        config = load_config(None, [f"task.name={name}", f"data.dir={uri}", "data.batch_size=8"])
        config.task.params = task_params
        task, splits, rows = prepare(config, None)
        for split in splits.values():
            path = split.path if isinstance(split, ParquetSplit) else split.dataset.path
            assert path.startswith(uri.split("?")[0]) and path.endswith(uri.split("?")[1]), (name, path)
        if name == "seamseg":
            first = splits["train"].dataset[0]  # read from the bucket, in this process as on a worker
            assert first["image"].shape[-1] == 3 and len(splits["train"].dataset) == rows["train"] == 48
        if name == "dino":
            bank, labels = task.bank(torch.device("cpu"))
            assert task.bank_path == splits["train"].path and len(labels) == rows["train"] == 1347
    assert {"digits", "shapes"} <= {p.split("/")[0] for p in files_under(uri)}
    assert any(p.startswith("patterns-") for p in files_under(uri))
