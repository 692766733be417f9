"""Restoring a run's checkpoint on the workers, without Ray: damage falls back to the one before
(or to the beginning), anything else stops the restore on every worker, and the workers must end
up with the same checkpoint. Real files, real gloo process groups."""

from __future__ import annotations

import errno
import pickle
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from raytrain_loops.callbacks.run_log import RunLog, kept_files
from raytrain_loops.checkpoint import files as ckpt
from raytrain_loops.checkpoint.ray_reporter import RayReporter
from raytrain_loops.checkpoint.restore import candidates
from raytrain_loops.engine import Engine
from raytrain_loops.engine.loop import Position
from tests.support import fakes
from tests.support.checkpoints import rewritten, tiny_engine
from tests.support.gloo import run_gloo
from tests.support.pickles import Exploit
from tests.support.runfiles import records, tb_scalars


def _write_checkpoint(run_dir: Path, step: int, world: int, seed: int = 0, callbacks: dict | None = None) -> Path:
    """A checkpoint as the workers of a ``world``-sized group write it (what RayReporter.report
    writes, without Ray): rank 0 the shared state (with ``callbacks``, the callbacks' states),
    every rank its RNG and data position."""
    engine = tiny_engine(seed)
    engine.step = step
    engine.callback_state = callbacks or {}
    d = run_dir / f"checkpoint_{step:08d}"
    for rank in range(world):
        state = engine.state_dict()
        files = {ckpt.rank_file(rank): {"rng": state.pop("rng"), "data": {"epoch": 0, "batches": step}}}
        if rank == 0:
            files[ckpt.STATE] = state
        ckpt.write_files(d, rank, files, world)
    return d


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_run_whose_every_checkpoint_is_damaged_starts_from_the_beginning(tmp_path, capsys):
    run = tmp_path / "run"
    _cut(_write_checkpoint(run, 6, world=1) / ckpt.STATE)  # a first upload cut off by a preemption
    reporter = RayReporter(tiny_engine(seed=3), 0, 1, str(run))
    assert reporter.restore_from(candidates(str(run), None)) is None
    assert reporter.engine.step == 0
    assert reporter.loaded["started_fresh"] and reporter.loaded["checkpoint"] is None
    assert [Path(s["checkpoint"]).name for s in reporter.loaded["skipped"]] == ["checkpoint_00000006"]
    out = capsys.readouterr().out
    assert f"no intact checkpoint in {run} (1 damaged); starting from the beginning" in out

    donor = _write_checkpoint(tmp_path / "donor", 4, world=1, seed=5)  # the init checkpoint, when given
    again = RayReporter(tiny_engine(seed=3), 0, 1, str(run))
    assert again.restore_from(candidates(str(run), None), init_checkpoint=str(donor)) == Position(0, 4)
    assert again.engine.step == 4 and again.loaded["checkpoint"] == str(donor)
    assert len(again.loaded["skipped"]) == 1 and f"starting from {donor}" in capsys.readouterr().out


def test_a_run_log_keeps_what_the_runs_own_checkpoint_recorded_and_nothing_when_the_run_starts_again(tmp_path):
    run = tmp_path / "run"
    step = SimpleNamespace(loss=1.0, lr=0.1, grad_norm=1.0, sample_size=8, applied=True, skipped=None, compute_time=0)
    first = RunLog(str(run), rank=0, total_steps=8, progress=False)
    for s in range(1, 7):
        first.on_step(step, s, 0)
        first.on_interval({"loss": 1.0}, s)
        if s == 4:
            first.before_checkpoint()
            recorded = first.state_dict()["files"]
    first.close()
    _write_checkpoint(run, 4, world=1, callbacks={"RunLog": {"files": recorded}})
    donor = _write_checkpoint(tmp_path / "donor", 4, world=1, callbacks={"RunLog": {"files": {"metrics.jsonl": 10**6}}})

    def kept(init: Path | None = None) -> dict[str, int] | None:
        reporter = RayReporter(tiny_engine(seed=3), 0, 1, str(run))
        reporter.restore_from(candidates(str(run), None), init_checkpoint=init and str(init))
        return kept_files(reporter.loaded, reporter.engine.callback_state)

    assert kept() == kept(donor) == recorded  # the run's own checkpoint, whatever it was started from
    _cut(run / "checkpoint_00000004" / ckpt.STATE)
    # From another run's checkpoint, or from the beginning: every record comes again.
    assert kept(donor) == kept() == kept_files(None, {}) == {}
    assert kept_files({"checkpoint": "c"}, {"RunLog": {"smoother": {}}}) is None  # no lengths recorded: keep all

    resumed = RunLog(str(run), rank=0, total_steps=8, progress=False, start_step=4, kept=recorded)
    resumed.close()
    assert [r["step"] for r in records(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [s for s, _ in tb_scalars(run / "tb")["loss"]] == [1, 2, 3, 4]
    fresh = RunLog(str(run), rank=0, total_steps=8, progress=False, kept={})
    fresh.on_step(step, 1, 0)
    fresh.close()
    assert [r["step"] for r in records(run / "metrics.jsonl")] == [1]
    assert not tb_scalars(run / "tb") and len(list((run / "tb").iterdir())) == 1  # the new attempt's, empty


def test_a_run_whose_checkpoints_are_whole_but_refused_by_the_loader_stops_instead_of_starting_over(tmp_path):
    # A type in the saved state that weights_only does not allow: every checkpoint is refused,
    # and starting from step 0 would silently throw the run's progress away.
    run = tmp_path / "run"
    d = run / "checkpoint_00000006"
    ckpt.write_files(d, 0, {ckpt.STATE: {"model": Path("not a tensor")}, ckpt.rank_file(0): {}}, 1)
    reporter = RayReporter(tiny_engine(seed=3), 0, 1, str(run))
    with pytest.raises(ckpt.CheckpointError, match="1 were refused by torch.load"):
        reporter.restore_from(candidates(str(run), None))


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],
        lambda b: b[:-10],
        lambda b: b"",
        lambda b: b"\x00not a checkpoint" * 20,
        lambda b: b[:100] + bytes([b[100] ^ 0xFF]) + b[101:],
    ],
    ids=["cut in half", "cut at the end", "empty", "garbage", "flipped byte"],
)
def test_damaged_files_read_as_damage(tmp_path, damage):
    torch.save({"w": torch.ones(1000)}, tmp_path / "f.pt")
    (tmp_path / "f.pt").write_bytes(damage((tmp_path / "f.pt").read_bytes()))
    with pytest.raises(ckpt.CheckpointError, match="f.pt: refused or unreadable"):
        ckpt.read_file(tmp_path, "f.pt")


@pytest.mark.parametrize("error", [MemoryError(), OSError(errno.EIO, "Input/output error")], ids=["memory", "eio"])
def test_a_failed_read_that_is_not_damage_propagates(tmp_path, monkeypatch, error):
    torch.save({"w": torch.ones(3)}, tmp_path / "f.pt")

    def failing_device(*args, **kwargs):  # the storage beneath the reader, failing
        raise error

    monkeypatch.setattr(torch, "load", failing_device)
    with pytest.raises(type(error)):
        ckpt.read_file(tmp_path, "f.pt")


def _restore_with_failing_reads(rank: int, world: int, run: str, failing_rank: int) -> dict:
    """Restore on every worker; ``failing_rank`` gets an I/O error reading the newest checkpoint."""
    if rank == failing_rank:
        real_load = torch.load

        def load(path, *args, **kwargs):
            if "checkpoint_00000012" in str(path):
                raise OSError(errno.EIO, "Input/output error", str(path))
            return real_load(path, *args, **kwargs)

        torch.load = load
    reporter = RayReporter(tiny_engine(seed=9), rank, world, run)
    position = reporter.restore_from(candidates(run, None))
    return {"position": position.batches, "loaded": reporter.loaded["checkpoint"]}


def test_a_worker_that_cannot_read_the_newest_checkpoint_does_not_take_an_older_one(tmp_path):
    _write_checkpoint(tmp_path, 6, world=2)
    _write_checkpoint(tmp_path, 12, world=2)
    outcomes = run_gloo(2, _restore_with_failing_reads, str(tmp_path), 1)
    assert outcomes[1].error == "OSError" and "Input/output error" in outcomes[1].message
    assert outcomes[0].error == "RestoreMismatch"
    assert re.search(
        r"failed to restore a checkpoint: \{1: .OSError: \[Errno 5\] Input/output error", outcomes[0].message
    )


def _restore_from_listing(rank: int, world: int, listings: list[list[str]]) -> int:
    reporter = RayReporter(tiny_engine(seed=9), rank, world, "unused")
    return reporter.restore_from(listings[rank]).batches


def test_a_worker_whose_listing_lags_restores_the_newest_checkpoint_with_the_others(tmp_path):
    old, new = _write_checkpoint(tmp_path, 6, world=2), _write_checkpoint(tmp_path, 12, world=2, seed=1)
    # Rank 1's listing of the store lags behind (an eventually consistent object store): the
    # workers go through every worker's candidates together, and rank 1 reads the newest too.
    outcomes = run_gloo(2, _restore_from_listing, [[str(new), str(old)], [str(old)]])
    assert [(o.error, o.value) for o in outcomes] == [(None, 12), (None, 12)], outcomes[0].message


def _agree(rank: int, world: int, loaded: list[dict]) -> None:
    from raytrain_loops.checkpoint.restore import agree

    agree(loaded[rank], rank)


def test_workers_that_restore_different_weights_stop_naming_them():
    # The same checkpoint read as different weights (a store that served two versions of it).
    loaded = [{"checkpoint": "/r/checkpoint_00000012", "model_sha256": d} for d in ("aa", "bb")]
    outcomes = run_gloo(2, _agree, loaded)
    for o in outcomes:
        assert o.error == "RestoreMismatch", o.message
        assert "worker 0: ('checkpoint_00000012', 12, 'aa'); worker 1: ('checkpoint_00000012', 12, 'bb')" in o.message


# ---------------------------------------------------------------- sharded checkpoints


def _adamw(seed: int = 0) -> Engine:
    model = fakes.make_model(seed=seed)
    return Engine(model, fakes.mean_loss, fakes.config("optim.name=adamw").engine, total_steps=100)


def _write_sharded(run_dir: Path, step: int, seed: int = 0, change=None) -> Path:
    """A sharded checkpoint as one worker writes it (DCP shards, without a process group);
    ``change`` edits the state first."""
    engine = _adamw(seed)
    engine.step = step
    state = {**engine.state_dict(), **engine.sharded_targets(), "layout": "sharded"}
    if change:
        change(state)
    d = run_dir / f"checkpoint_{step:08d}"
    files = {ckpt.rank_file(0): {"rng": state.pop("rng"), "data": {"epoch": 0, "batches": step}}}
    ckpt.write_sharded(d, 0, files, state, 1)
    return d


def test_a_crafted_dcp_metadata_runs_nothing_and_the_restore_takes_the_checkpoint_before(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    _write_sharded(run, 6, seed=1)
    d = _write_sharded(run, 12, seed=2)
    metadata = FileSystemReader(d / "dcp").read_metadata()  # written here: safe to unpickle
    metadata.storage_meta.save_id = Exploit(marker)  # the rest stays a valid checkpoint
    rewritten(d, "dcp/.metadata", pickle.dumps(metadata))
    assert ckpt.verify(d) == 1

    reporter = RayReporter(_adamw(seed=3), 0, 1, str(run))
    assert reporter.restore_from(candidates(str(run), None)) == Position(0, 6)
    assert not marker.exists()
    assert reporter.engine.step == 6 and reporter.loaded["checkpoint"] == str(run / "checkpoint_00000006")
    [skip] = reporter.loaded["skipped"]
    assert skip["checkpoint"] == str(d) and skip["refused"]
    assert (
        "dcp/.metadata: refused or unreadable (UnpicklingError: posix.system is not one of the types" in skip["reason"]
    )
    with pytest.raises(ckpt.CheckpointError, match="posix.system is not one of the types DCP metadata holds"):
        ckpt.export(d, tmp_path / "state.pt")
    assert not marker.exists() and not (tmp_path / "state.pt").exists()

    FileSystemReader(d / "dcp").read_metadata()  # the control: DCP's own reader runs it
    assert marker.exists()


def test_a_crafted_non_tensor_item_in_dcp_shards_runs_nothing_and_the_restore_takes_the_checkpoint_before(tmp_path):
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    _write_sharded(run, 6, seed=1)

    def craft(state):  # an optimizer setting, saved by DCP as a pickled item
        state["optimizer"]["param_groups"][0]["foreach"] = Exploit(marker)

    d = _write_sharded(run, 12, seed=2, change=craft)
    assert ckpt.verify(d) == 1  # written by the writer itself: its manifest matches

    reporter = RayReporter(_adamw(seed=3), 0, 1, str(run))
    assert reporter.restore_from(candidates(str(run), None)) == Position(0, 6)
    assert not marker.exists()
    [skip] = reporter.loaded["skipped"]
    assert skip["refused"] and "checkpoint_00000012/dcp: refused or unreadable (UnpicklingError" in skip["reason"]
    with pytest.raises(ckpt.CheckpointError, match="UnpicklingError"):
        ckpt.export(d, tmp_path / "state.pt")
    assert not marker.exists()

    target = {k: v for k, v in _adamw().sharded_targets().items() if v is not None}
    dcp.load(target, checkpoint_id=d / "dcp")  # the control: DCP's own load runs it
    assert marker.exists()


def test_a_sharded_load_that_failed_after_writing_into_the_model_does_not_start_from_the_beginning(tmp_path):
    from raytrain_loops.checkpoint import dcp_io

    run = tmp_path / "run"
    d = _write_sharded(run, 12, seed=2)
    # The last tensor of the shard file garbled, the manifest rewritten to match: every check
    # before the load passes, and DCP fails reading it after it copied the others into the model.
    metadata = dcp_io.read_metadata(d / "dcp")
    last = max(metadata.storage_data.values(), key=lambda where: where.offset)
    data = bytearray((d / "dcp" / last.relative_path).read_bytes())
    data[last.offset : last.offset + last.length] = b"PK\x03\x04" + bytes(last.length - 4)  # a zip without its parts
    rewritten(d, f"dcp/{last.relative_path}", bytes(data))

    reporter = RayReporter(_adamw(seed=3), 0, 1, str(run))
    with pytest.raises(ckpt.CheckpointError, match="had already written part of its state into the model"):
        reporter.restore_from(candidates(str(run), None))
