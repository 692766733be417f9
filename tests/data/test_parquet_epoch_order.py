"""The epoch's order of a Parquet split (raytrain_loops.data.parquet), without Ray: a fresh
shuffle of the whole split every epoch, equal disjoint shares, label mixing within batches, the
same rows from files and from memory, row seeds independent of the group size, and a resume that
reads only what remains."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_loops.config.run import DataConfig
from raytrain_loops.data.parquet import (
    ROW_SEED,
    Reader,
    eval_plan,
    index_split,
    prefetched,
    read_window,
    row_seeds,
    train_plan,
    windows_from,
)

ROWS, LABELS, BATCH = 20_000, 10, 64
DEFAULTS = DataConfig()


def sorted_split(path, rows=ROWS, row_group_size=None, files=1):
    """A split stored sorted by label (rows // LABELS rows per label), with a row id column."""
    ids = np.arange(rows)
    labels = ids * LABELS // rows
    bounds = np.linspace(0, rows, files + 1).astype(int)
    path.mkdir()
    for f in range(files):
        part = slice(bounds[f], bounds[f + 1])
        table = pa.table({"id": ids[part], "label": labels[part]})
        pq.write_table(table, path / f"part-{f:03d}.parquet", row_group_size=row_group_size)
    return index_split(str(path), ["id", "label"])


def share(index, epoch, world, rank, chunk=DEFAULTS.shuffle_chunk_rows, buffer=DEFAULTS.shuffle_buffer, start=0):
    plan = train_plan(index, 0, epoch, world, rank, chunk, buffer)
    reader = Reader(index)
    batches = list(windows_from(reader, plan, start))
    ids = np.concatenate([b["id"] for b in batches]) if batches else np.zeros(0, int)
    labels = np.concatenate([b["label"] for b in batches]) if batches else np.zeros(0, int)
    return ids, labels, reader.rows_read


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    return sorted_split(tmp_path_factory.mktemp("plan") / "sorted")


def test_each_epoch_deals_every_worker_a_new_equal_share_of_the_whole_split_with_every_label(split):
    world = 2
    seen = {}
    for epoch in (0, 1):
        shares = [share(split, epoch, world, r) for r in range(world)]
        ids = [s[0] for s in shares]
        assert [len(i) for i in ids] == [ROWS // world] * world
        assert len(np.intersect1d(ids[0], ids[1])) == 0  # disjoint: each row once per epoch
        for rank, (_, labels, _) in enumerate(shares):
            assert set(labels.tolist()) == set(range(LABELS)), (epoch, rank)
        seen[epoch] = ids
    for rank in range(world):
        overlap = len(np.intersect1d(seen[0][rank], seen[1][rank])) / len(seen[0][rank])
        assert abs(overlap - 1 / world) <= 0.1, overlap
    # Four workers: each sees every label in every epoch (each run of 4 neighbouring chunks gives
    # every worker one), and keeps ~1/4 of its rows from one epoch to the next (averaged over ranks
    # and epochs: 39 chunks a worker, so one worker's overlap alone varies by +-0.07).
    shares = [[share(split, e, 4, r)[:2] for r in range(4)] for e in range(4)]
    overlaps = []
    for e in range(4):
        for rank in range(4):
            assert set(shares[e][rank][1].tolist()) == set(range(LABELS)), (e, rank)
            if e:
                a, b = shares[e - 1][rank][0], shares[e][rank][0]
                overlaps.append(len(np.intersect1d(a, b)) / len(b))
    assert abs(np.mean(overlaps) - 0.25) <= 0.03, overlaps


def test_batches_mix_labels_nearly_as_a_uniform_shuffle_does(split):
    def distinct_per_batch(labels):
        n = len(labels) // BATCH
        return np.mean([len(set(labels[i * BATCH : (i + 1) * BATCH].tolist())) for i in range(n)])

    _, labels, _ = share(split, 0, 2, 0)
    uniform = distinct_per_batch(np.random.default_rng(1).permutation(np.arange(ROWS) * LABELS // ROWS))
    ours = distinct_per_batch(labels)
    assert ours >= 0.8 * uniform, (ours, uniform)
    # The old order (a window of neighbouring rows in a fixed shard) held ~1 label per batch.
    _, unshuffled, _ = share(split, 0, 2, 0, buffer=0)
    assert distinct_per_batch(unshuffled) < 0.3 * uniform


def test_the_order_is_the_same_on_every_run_and_the_same_from_memory_as_from_the_files(split):
    first = share(split, 3, 2, 1)[0]
    assert np.array_equal(first, share(split, 3, 2, 1)[0])
    assert not np.array_equal(first, share(split, 4, 2, 1)[0])
    held = index_split(split.path, split.columns)
    held.table = pq.read_table(split.path, columns=split.columns)
    reader = Reader(held)
    from_memory = np.concatenate([b["id"] for b in windows_from(reader, train_plan(held, 0, 3, 2, 1, 128, 10_000), 0)])
    assert np.array_equal(first, from_memory)
    assert reader.rows_read == 0  # nothing decoded from the files


def test_evaluation_reads_every_row_once_in_storage_order(split):
    ids = []
    for rank in range(3):
        reader = Reader(split)
        ids += [b["id"] for b in windows_from(reader, eval_plan(split, 3, rank), 0)]
    assert np.array_equal(np.concatenate(ids), np.arange(ROWS))


def test_a_resumed_epoch_reads_only_the_rows_left_and_continues_with_the_same_rows(tmp_path):
    # Row groups of one chunk each (as docs/data.md recommends): 100 files of 200 rows.
    index = sorted_split(tmp_path / "grouped", row_group_size=128, files=100)
    buffer = 1000
    full, _, read_all = share(index, 0, 2, 0, buffer=buffer)
    assert read_all <= len(full) + 2 * 128 * (len(full) // buffer + 1)
    batches = len(full) // BATCH
    start = int(batches * 0.9) * BATCH  # 90% of the epoch, in whole batches
    rest, _, read = share(index, 0, 2, 0, buffer=buffer, start=start)
    assert np.array_equal(rest, full[start:])
    left = len(full) - start
    consumed_in_window = start % buffer
    # The rows left, the rows of the open window already trained on (its order is a permutation of
    # all its rows), and the unused parts of at most two row groups per window read.
    windows_read = -(-len(full) // buffer) - start // buffer
    assert read <= left + consumed_in_window + 2 * 128 * windows_read, (read, left)
    assert read < 0.25 * read_all
    # Without the row-level shuffle (data.shuffle_buffer=0) nothing before the position is read:
    # the rows left and the rest of the row group holding the position.
    full, _, _ = share(index, 0, 2, 0, buffer=0)
    rest, _, read = share(index, 0, 2, 0, buffer=0, start=start)
    assert np.array_equal(rest, full[start:])
    assert read <= len(full) - start + 128, read


def test_row_seeds_follow_the_row_not_the_worker_or_the_epochs_position(split):
    def seeds_by_id(world, epoch=0):
        out = {}
        for rank in range(world):
            plan = train_plan(split, 0, epoch, world, rank, 128, 10_000)
            reader = Reader(split)
            for w in range(plan.windows):
                batch = read_window(reader, plan, w, 0, (0, epoch))
                out.update(zip(batch["id"].tolist(), batch[ROW_SEED].tolist(), strict=True))
        return out

    one, three = seeds_by_id(1), seeds_by_id(3)
    common = set(one) & set(three)
    assert len(common) > 0.9 * ROWS
    assert all(one[i] == three[i] for i in common)
    assert len(set(one.values())) == len(one)  # distinct rows, distinct seeds
    again = seeds_by_id(1, epoch=1)
    assert sum(one[i] == again[i] for i in one) == 0  # a new epoch, new draws
    assert row_seeds(0, 0, np.array([[0, 0, 5, 7]])).dtype == np.uint64


def test_a_read_error_on_the_prefetch_thread_is_raised_in_the_caller_as_is_one_closing_it():
    def failing():
        yield 1
        raise OSError("disk gone")

    got = prefetched(failing(), 1)
    assert next(got) == 1
    with pytest.raises(OSError, match="disk gone"):
        next(got)

    class ClosingFails(list):  # read to its end, then its close fails (a file that will not close)
        def close(self):
            raise OSError("flush failed")

    got = prefetched(ClosingFails([1]), 1)
    assert next(got) == 1
    with pytest.raises(OSError, match="flush failed"):
        next(got)


def test_a_file_gone_or_damaged_mid_run_is_an_error_naming_it(tmp_path):
    index = sorted_split(tmp_path / "split", rows=1000, row_group_size=100, files=2)
    victim = sorted(p for p in (tmp_path / "split").iterdir())[1]
    victim.write_bytes(victim.read_bytes()[:200] + b"\0" * 100)  # damaged after the driver indexed it
    plan = train_plan(index, 0, 0, 1, 0, 128, 1000)
    with pytest.raises(OSError, match=f"of {victim}"):
        list(windows_from(Reader(index), plan, 0))


class _Doubling:
    def preprocess(self, batch, train):
        return {k: np.concatenate([v, v]) for k, v in batch.items()}


class _Noisy:
    def preprocess(self, batch, train):
        noise = [np.random.default_rng(int(s)).normal() if train else 0.0 for s in batch[ROW_SEED]]
        return {"id": batch["id"], "x": np.asarray(noise)}


def test_preprocess_maps_one_row_to_one_with_each_rows_own_seed_and_says_so_when_it_does_not(split):
    from raytrain_loops.runtime.batches import read_and_preprocess

    plan = train_plan(split, 0, 2, 2, 1, 128, 1000)
    kwargs = {"index": split, "plan": plan, "first": 3, "skip": 10, "seeds": (0, 2), "rows": 300, "train": True}
    with pytest.raises(ValueError, match=r"_Doubling.preprocess must map each row to one row: 300 rows in"):
        list(read_and_preprocess(task=_Doubling(), windows=[3], **kwargs))
    out = list(read_and_preprocess(task=_Noisy(), windows=[3, 4], **kwargs))
    assert [len(o["id"]) for o in out][:4] == [300, 300, 300, len(out[3]["id"])]
    assert all(ROW_SEED not in o for o in out)  # the seeds do not travel on to the worker
    ids = np.concatenate([o["id"] for o in out])
    expected = [read_window(Reader(split), plan, w, 10 if w == 3 else 0, (0, 2)) for w in (3, 4)]
    assert np.array_equal(ids, np.concatenate([e["id"] for e in expected]))
    seeds = np.concatenate([e[ROW_SEED] for e in expected])
    noise = np.concatenate([o["x"] for o in out])
    assert np.array_equal(noise, [np.random.default_rng(int(s)).normal() for s in seeds])


@pytest.mark.parametrize("at", [0, 10, 900])  # 900: the position's window is the last but one
def test_local_preprocessing_gives_the_rows_seeds_and_parts_the_executor_on_ray_gives_from_a_resumed_position(
    split, at
):
    from raytrain_loops.config.run import DataConfig, PreprocessConfig
    from raytrain_loops.runtime.batches import feed_units, preprocessed_here, read_and_preprocess

    plan = train_plan(split, 0, 2, 2, 1, 128, 1000)
    data = DataConfig(preprocess=PreprocessConfig(batch_rows=300))
    start = plan.window * 3 + at  # in window 3 or 2, its first rows trained on
    first, skip = plan.locate(start)
    assert first >= 2
    here = list(preprocessed_here(_Noisy(), data, plan, split, start, (0, 2), True))
    units = feed_units(plan, start)
    assert units[0] == (first, skip) and all(s == 0 for _, s in units[1:])  # one unit per window
    tasks = [
        part for w, s in units for part in read_and_preprocess(_Noisy(), split, plan, [w], w, s, (0, 2), 300, True)
    ]
    assert [len(o["id"]) for o in tasks] == [len(o["id"]) for o in here]  # each preprocess call, the same rows
    for key in ("id", "x"):
        assert np.array_equal(np.concatenate([o[key] for o in here]), np.concatenate([o[key] for o in tasks]))
    assert sum(len(o["id"]) for o in here) == plan.rows - start
    assert feed_units(plan, plan.rows) == []  # the epoch's end: nothing to execute


def test_a_streamed_split_with_large_row_groups_gets_a_warning_naming_it(split, capsys):
    from raytrain_loops.config import load_config
    from raytrain_loops.driver.trainer import hold_in_memory, place_parquet
    from raytrain_loops.tasks import ParquetSplit

    parquet = ParquetSplit(split.path, split.columns, index=split)
    config = load_config(None, ["data.materialize=never"])
    assert not hold_in_memory(parquet, config)
    assert hold_in_memory(parquet, load_config(None, ["data.materialize=always"]))
    assert hold_in_memory(parquet, load_config(None, []))  # auto: well under 1 GiB
    place_parquet({"train": parquet}, config)
    out = capsys.readouterr().out
    assert f"split 'train' ({split.path}) has row groups of up to {ROWS} rows" in out
    assert "row_group_size=128" in out and parquet.index.table is None  # streamed: nothing held
