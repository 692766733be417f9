"""An epoch finished by a group of another size (raytrain_loops.data.recut), without Ray: every
worker's data position recorded in rows on the epoch's deal, the rows not yet trained re-cut over
the new group, chained re-cuts composed. Rows are counted at 50% and 90% of an epoch: none trained
twice, and none missing beyond what the re-cut part drops as an epoch does (the part's remainder,
its last partial batch, the accumulation leftover). An end-to-end run through the real loop, from
a local run's checkpoint to two gloo processes and back: data/test_recut_through_loop.py."""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torch.utils.data import Dataset

from raytrain_loops.checkpoint import files as ckpt
from raytrain_loops.checkpoint.reporter import CheckpointReporter
from raytrain_loops.checkpoint.restore import candidates
from raytrain_loops.config import load_config
from raytrain_loops.data.parquet import ROW_SEED, index_split, train_plan
from raytrain_loops.data.recut import Deal, recut_plan, resume_point
from raytrain_loops.data.samplers import GroupedBatchSampler
from raytrain_loops.engine.length import accum_steps, steps_in_epoch
from raytrain_loops.engine.loop import Position
from raytrain_loops.runtime.batches import Batches, preprocessed_here
from raytrain_loops.tasks import MapSplit, ParquetSplit, Task
from tests.support.checkpoints import tiny_engine

ROWS, BATCH, EPOCH = 10_240, 32, 1


class Ids(Task):
    """Batches of row ids."""

    def collate(self, batch):
        return batch["id"]


class SeededIds(Ids):
    """Row ids through ``preprocess``, with each row's seed (the augmentation's)."""

    def preprocess(self, batch, train):
        return {"id": batch["id"], "seed": batch[ROW_SEED]}

    def collate(self, batch):
        return np.stack([batch["id"], batch["seed"].astype(np.int64)], axis=1)


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """10,240 rows with an id, in 5 files of row groups of 300 rows (shares, windows and row
    groups do not line up)."""
    path = tmp_path_factory.mktemp("recut") / "train"
    path.mkdir()
    ids = np.arange(ROWS)
    for f, part in enumerate(np.array_split(ids, 5)):
        pq.write_table(pa.table({"id": part}), path / f"part-{f}.parquet", row_group_size=300)
    return ParquetSplit(str(path), ["id"], index_split(str(path), ["id"]))


def _config(workers: int, accum: int = 1, buffer: int = 1000, chunk: int = 128):
    return load_config(
        None,
        [
            f"data.batch_size={BATCH}",
            f"data.shuffle_buffer={buffer}",
            f"data.shuffle_chunk_rows={chunk}",
            f"accum.steps={accum}",
            f"scaling.num_workers={workers}",
            "loop.seed=7",
        ],
    )


@dataclass
class Group:
    """A group's batch sources, run as the loop runs an epoch (engine/loop.py, ``_epoch``)."""

    sources: list[Batches]

    @classmethod
    def of(cls, split, world: int, config, task: Task | None = None) -> Group:
        task = task or Ids()
        rows = {"train": ROWS}
        return cls(
            [Batches(task, config, {"train": split}, rows, r, world, None, preprocessed_here) for r in range(world)]
        )

    def steps(self) -> tuple[int, int]:
        """(micro-batches per update, steps in the epoch) as the loop counts them."""
        s = self.sources[0]
        return accum_steps(s.accum, EPOCH, s.scale), steps_in_epoch(s.accum, s.batches_per_epoch, EPOCH, s.scale)

    def train(self, position: Position, until: int | None = None) -> tuple[list[np.ndarray], Position]:
        """The rows every worker trains from ``position`` to step ``until`` of the epoch (None: its
        end), and the position there."""
        k, steps = self.steps()
        done = position.batches // k
        until = steps if until is None else until
        out = []
        for source in self.sources:
            stream = iter(source.batches("train", EPOCH, position.batches))
            batches = [_ids(next(stream)) for _ in range((until - done) * k)]
            out.append(np.concatenate(batches) if batches else np.zeros(0, np.int64))
        return out, Position(EPOCH, until * k)

    def resume(self, records: list[dict]) -> Position:
        positions = {s.resume(records) for s in self.sources}
        assert len(positions) == 1, positions  # every worker runs the same steps
        return positions.pop()


def _ids(batch) -> np.ndarray:
    """A batch's rows: the ids (and seeds) of a Parquet batch, a map-style batch's ``id`` tensor."""
    return batch["id"].numpy() if isinstance(batch, dict) else np.asarray(batch)


def _dropped(rows: int, world: int, k: int) -> int:
    """What an epoch of ``rows`` drops on a group of ``world``: the shares' remainder, and of
    each share its last partial batch and the accumulation leftover."""
    share = rows // world
    return rows - world * (share // BATCH // k * k * BATCH)


def _stage(split, before: Group, position: Position, after_world: int, config, task=None):
    """``before`` stopped at ``position``: its records, and the group of ``after_world`` resumed."""
    records = [s.record(position) for s in before.sources]
    after = Group.of(split, after_world, config, task)
    return records, after, after.resume(records)


def _counts(trained: list[np.ndarray]) -> tuple[int, int]:
    ids = np.concatenate(trained)
    counts = np.bincount(ids, minlength=ROWS)
    return int((counts > 1).sum()), int((counts == 0).sum())


CASES = {
    "2->1": ([2, 1], {}),
    "1->2": ([1, 2], {}),
    "4->3": ([4, 3], {}),
    "4->3 elastic, 3 micro-batches per update": ([4, 3], {"elastic": True, "accum": 3}),
    "4->3->2": ([4, 3, 2], {}),
}


@pytest.mark.parametrize("fraction", [0.5, 0.9])
@pytest.mark.parametrize("case", CASES)
def test_a_group_of_another_size_trains_every_row_left_once_and_drops_no_more_than_an_epoch_does(split, case, fraction):
    worlds, opts = CASES[case]
    full = max(worlds) if opts.get("elastic") else None
    configs = [_config(full or w, opts.get("accum", 1)) for w in worlds]
    group = Group.of(split, worlds[0], configs[0])
    _, steps = group.steps()
    trained, position = group.train(Position(EPOCH, 0), int(steps * fraction))
    left = ROWS - sum(len(t) for t in trained)
    for i, world in enumerate(worlds[1:], 1):
        records, group, position = _stage(split, group, position, world, configs[i])
        assert all(r["deal"]["world"] == worlds[0] and len(r["deal"]["recuts"]) == i - 1 for r in records)
        k, steps = group.steps()
        share = left // world
        # The loop's steps left are the re-cut part's: its batches // micro-batches per update.
        assert steps - position.batches // k == share // BATCH // k
        last = i == len(worlds) - 1
        done, position = group.train(position, None if last else (position.batches // k + steps) // 2)
        trained += done
        left -= sum(len(t) for t in done)
    twice, never = _counts(trained)
    assert twice == 0
    # Missing: exactly what the last re-cut part drops (its remainder, last partial batch and
    # accumulation leftover), less than one update of the new group.
    assert never == _dropped(left + sum(len(t) for t in done), world, k) == left
    assert never < world * k * BATCH
    print(
        f"{case} at {fraction:.0%}: {twice} twice, {never} never; an epoch at {world} drops {_dropped(ROWS, world, k)}"
    )


def test_the_same_size_resumes_its_own_plan_exactly_and_a_recut_deal_continues_where_it_stopped(split):
    config = _config(2)
    group = Group.of(split, 2, config)
    whole, _ = group.train(Position(EPOCH, 0))
    first, position = group.train(Position(EPOCH, 0), 40)
    records = [s.record(position) for s in group.sources]
    assert records[1] == {"epoch": EPOCH, "batches": 40, "rows": 40 * BATCH, "deal": {"world": 2, "recuts": []}}
    again = Group.of(split, 2, config)
    assert again.resume(records) == position
    rest, _ = again.train(position)
    assert all(np.array_equal(np.r_[a, b], w) for a, b, w in zip(first, rest, whole, strict=True))
    # An old record (epoch and batches only) resumes the same.
    old = [{"epoch": r["epoch"], "batches": r["batches"]} for r in records]
    assert Group.of(split, 2, config).resume(old) == position

    # 2 -> 3 at step 40, then the 3-group stopped after 30 steps and resumed at 3: the same rows as uninterrupted.
    _, three, at = _stage(split, group, position, 3, _config(3))
    whole3, _ = three.train(at)
    part, stop = three.train(at, at.batches + 30)
    records = [s.record(stop) for s in three.sources]
    assert records[2]["rows"] == 30 * BATCH and records[2]["deal"]["recuts"][0]["rows"] == [40 * BATCH] * 2
    again = Group.of(split, 3, _config(3))
    assert again.resume(records) == stop
    rest, _ = again.train(stop)
    assert all(np.array_equal(np.r_[a, b], w) for a, b, w in zip(part, rest, whole3, strict=True))


def test_recut_rows_are_read_where_they_are_with_their_own_seeds_on_both_read_paths(split):
    config = _config(4)
    group = Group.of(split, 4, config, SeededIds())
    whole, _ = group.train(Position(EPOCH, 0))
    seeds = {int(i): int(s) for w in whole for i, s in w}
    _, position = group.train(Position(EPOCH, 0), 25)
    _, three, at = _stage(split, group, position, 3, _config(3), SeededIds())
    done, _ = three.train(at)
    rows = np.concatenate(done)
    assert len(rows) and all(seeds.get(int(i), int(s)) == int(s) for i, s in rows)
    # The part's rows are the old workers' rows in their own reading order, from their positions on.
    plan = three.sources[0].resumed.part
    rest0 = whole[0][25 * BATCH :, 0]  # old worker 0's rows left (its share divides into batches)
    assert len(done[0]) > len(rest0) and np.array_equal(done[0][: len(rest0), 0], rest0)
    # The preprocessing tasks read the same windows (read_and_preprocess with the part's windows).
    from raytrain_loops.runtime.batches import read_and_preprocess

    first, skip = plan.locate(0)
    tasks = read_and_preprocess(SeededIds(), split.index, plan, range(plan.windows), first, skip, (7, EPOCH), 100, True)
    ids = np.concatenate([t["id"] for t in tasks])
    assert np.array_equal(ids[: len(done[0])], done[0][:, 0])


def test_without_a_shuffle_buffer_the_recut_reads_storage_order_and_nothing_twice(split):
    group = Group.of(split, 2, _config(2, buffer=0))
    trained, position = group.train(Position(EPOCH, 0), 100)
    _, one, at = _stage(split, group, position, 1, _config(1, buffer=0))
    done, _ = one.train(at)
    twice, never = _counts(trained + done)
    assert twice == 0 and never == _dropped(ROWS - 2 * 100 * BATCH, 1, 1)
    assert np.array_equal(done[0][:64], np.arange(100 * BATCH, 100 * BATCH + 64))  # worker 0's rows left first


def test_the_deal_plans_are_the_groups_own_and_an_untouched_epoch_is_dealt_afresh(split):
    index = split.index
    plan = recut_plan(index, 7, EPOCH, 128, 1000, Deal(3, ((2, (0, 0, 0)),)), 1)
    for q in range(3):
        own = train_plan(index, 7, EPOCH, 3, q, 128, 1000)
        assert np.array_equal(plan.base[q].pieces, own.pieces) and plan.base[q].key == own.key
    # A checkpoint at an epoch's start: the new group's own plan.
    records = [{"epoch": 2, "batches": 0, "rows": 0, "deal": {"world": 3, "recuts": []}}] * 3
    assert resume_point(records, 2, 1, BATCH).deal == Deal(2)


def test_an_old_record_resumed_by_another_size_is_recut_from_its_writers_own_plan(split):
    group = Group.of(split, 2, _config(2))
    trained, position = group.train(Position(EPOCH, 0), 60)
    old = [{"epoch": EPOCH, "batches": 60}] * 2  # written before the deal was recorded
    assert resume_point(old, 1, 0, BATCH).deal == Deal(2, ((1, (60 * BATCH, 60 * BATCH)),))
    one = Group.of(split, 1, _config(1))
    done, _ = one.train(one.resume(old))
    twice, never = _counts(trained + done)
    assert twice == 0 and never == _dropped(ROWS - 2 * 60 * BATCH, 1, 1)


@pytest.mark.parametrize(
    "records,match",
    [
        ([{"epoch": 1, "batches": 3, "rows": 96, "deal": {"world": 2, "recuts": []}}] * 3, "cut for 2 workers"),
        ([{"epoch": 1, "batches": 3}, {"epoch": 2, "batches": 3}], "worker 1 recorded epoch 2"),
        ([{"epoch": 1, "batches": 3, "rows": -1, "deal": {"world": 2, "recuts": []}}] * 2, "integer >= 0"),
        ([{"epoch": 1, "rows": 3}] * 2, "malformed data position"),
    ],
)
def test_records_that_disagree_or_are_malformed_are_refused_naming_what(records, match):
    with pytest.raises(ValueError, match=match):
        resume_point(records, 1, 0, BATCH)


class Rows(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"id": i}


def _map_group(world: int, sampler: bool, n: int = 1000):
    groups = np.arange(n) % 3  # three aspect-ratio bins
    factory = (lambda b, r, w, s: GroupedBatchSampler(groups, b, r, w, s)) if sampler else None
    split = MapSplit(Rows(n), batch_sampler=factory)
    config = _config(world)
    return Group([Batches(Ids(), config, {"train": split}, {}, r, world, None, None) for r in range(world)])


@pytest.mark.parametrize("sampler", [False, True], ids=["DistributedSampler", "batch sampler"])
def test_map_style_batches_left_are_dealt_out_whole_to_the_new_group(sampler):
    group = _map_group(4, sampler)
    trained, position = group.train(Position(EPOCH, 0), 3)
    records = [s.record(position) for s in group.sources]
    three = _map_group(3, sampler)
    at = three.resume(records)
    done, _ = three.train(at)
    counts = np.bincount(np.concatenate(trained + done), minlength=1000)
    assert (counts > 1).sum() == 0
    # Missing: what the 4-group's epoch dropped (partial batches) and the batches left that do not divide by 3.
    left = sum(s.batches_per_epoch for s in group.sources) - 4 * 3
    assert sum(len(d) for d in done) == left // 3 * 3 * BATCH
    if sampler:  # each batch still holds one group
        for s in three.sources:
            assert all(len({int(i) % 3 for i in b}) == 1 for b in s.resumed.part)


@pytest.mark.parametrize("start", [333, 378])
def test_a_recut_part_resumed_near_a_segments_end_reads_each_row_once_window_by_window(split, start):
    """The executor on Ray preprocesses a part window by window from its resume position
    (``feed_units``); 378 leaves fewer rows in its segment than one call of ``preprocess`` takes
    (300), where a slice of the segment once ran past its end."""
    from raytrain_loops.config.run import PreprocessConfig
    from raytrain_loops.data.parquet import Reader, read_window
    from raytrain_loops.runtime.batches import feed_units, read_and_preprocess

    deal = Deal(4, ((3, (800, 800, 800, 800)), (2, (1000, 1000, 1000))))
    plan = recut_plan(split.index, 7, EPOCH, 128, 1000, deal, 1)
    data = dataclasses.replace(_config(2).data, preprocess=PreprocessConfig(batch_rows=300))
    here = list(preprocessed_here(SeededIds(), data, plan, split.index, start, (7, EPOCH), True))
    parts = [
        part
        for w, skip in feed_units(plan, start)
        for part in read_and_preprocess(SeededIds(), split.index, plan, [w], w, skip, (7, EPOCH), 300, True)
    ]
    for key in ("id", "seed"):
        assert np.array_equal(np.concatenate([b[key] for b in here]), np.concatenate([b[key] for b in parts]))
    assert sum(len(b["id"]) for b in parts) == plan.rows - start > 0
    assert all(len(b["id"]) <= 300 for b in parts)
    # A segment read from past its rows gives none (not rows of the window beyond the segment).
    w, offset = plan.locate(start)
    seg = int(plan.segments[w][3] - plan.segments[w][2])
    reader = Reader(split.index)
    assert len(read_window(reader, plan, w, seg + 1, (7, EPOCH))["id"]) == 0
    reader.close()


@pytest.mark.ray
def test_the_preprocessing_tasks_read_a_recut_part_as_the_process_does(ray_session, split):
    from raytrain_loops.config.run import PreprocessConfig
    from raytrain_loops.worker.preprocessing import RayPreprocessing

    deal = Deal(4, ((3, (800, 800, 800, 800)), (2, (1000, 1000, 1000))))
    plan = recut_plan(split.index, 7, EPOCH, 128, 1000, deal, 1)
    data = dataclasses.replace(_config(2).data, preprocess=PreprocessConfig(batch_rows=300))
    start = 333  # inside a segment: its rows before the position are left out
    here = list(preprocessed_here(SeededIds(), data, plan, split.index, start, (7, EPOCH), True))
    on_ray = list(RayPreprocessing(1)(SeededIds(), data, plan, split.index, start, (7, EPOCH), True))
    for key in ("id", "seed"):
        assert np.array_equal(np.concatenate([b[key] for b in here]), np.concatenate([b[key] for b in on_ray]))
    assert sum(len(b["id"]) for b in on_ray) == plan.rows - start > 0


def _checkpoint(run: Path, step: int, group: Group, position: Position, epoch_of_rank1: int | None = None) -> None:
    """A checkpoint as ``group``'s workers write it (the reporter's own files, each worker's data
    record from its source), optionally with worker 1's epoch tampered with."""
    engine = tiny_engine()
    engine.step = step
    world = len(group.sources)
    for rank, source in enumerate(group.sources):
        reporter = _Reporter(engine, rank, world, str(run))
        reporter.data = source
        tmp = Path(reporter._write(position, None))
        if rank == 1 and epoch_of_rank1 is not None:
            mine = ckpt.read_file(tmp, ckpt.rank_file(1))
            mine["data"]["epoch"] = epoch_of_rank1
            ckpt.write_files(tmp, 1, {ckpt.rank_file(1): mine}, world)
        shutil.copytree(tmp, run / f"checkpoint_{step:08d}", dirs_exist_ok=True)
        shutil.rmtree(tmp)


class _Reporter(CheckpointReporter):
    def report(self, metrics, checkpoint):
        raise AssertionError("not reported here")


def test_the_reporter_records_every_workers_position_and_a_group_of_another_size_resumes_from_them(
    split, tmp_path, capsys
):
    run = tmp_path / "run"
    group = Group.of(split, 2, _config(2))
    trained, position = group.train(Position(EPOCH, 0), 60)
    _checkpoint(run, 60, group, position)
    _checkpoint(run, 61, group, position, epoch_of_rank1=EPOCH + 1)  # records that disagree: unusable
    one = Group.of(split, 1, _config(1))
    reporter = _Reporter(tiny_engine(seed=3), 0, 1, str(run))
    reporter.data = one.sources[0]
    at = reporter.restore_from(candidates(str(run), None))
    assert reporter.engine.step == 60 and reporter.loaded["world_size"] == 2
    out = capsys.readouterr().out
    assert "checkpoint_00000061 is unusable" in out and "worker 1 recorded epoch 2" in out
    done, _ = one.train(at)
    twice, never = _counts(trained + done)
    assert twice == 0 and never == _dropped(ROWS - 2 * 60 * BATCH, 1, 1)
    # A checkpoint whose load fails after its position was taken leaves nothing behind.
    assert one.sources[0].resume(None) == Position() and one.sources[0].resumed is None
    assert np.array_equal(
        one.train(Position(EPOCH, 0))[0][0], Group.of(split, 1, _config(1)).train(Position(EPOCH, 0))[0][0]
    )
