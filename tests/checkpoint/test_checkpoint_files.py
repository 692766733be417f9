"""Checkpoint files: damage is detected, code in a pickle is never run, and the guards that end
a run name what went wrong."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch

from raytrain_loops.callbacks.spike_guard import SpikeDetector
from raytrain_loops.checkpoint import files as ckpt
from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.errors import LossSpikeError
from raytrain_loops.recipes import resolve
from tests.support.pickles import Exploit


def _write(d, world=2):
    for rank in range(world):
        files = {ckpt.rank_file(rank): {"rng": torch.arange(3), "data": {"epoch": 1, "batches": 4}}}
        if rank == 0:
            files[ckpt.STATE] = {"model": {"w": torch.ones(4, 4)}}
        ckpt.write_files(d, rank, files, world)


def test_an_intact_checkpoint_verifies_and_reports_its_world_size(tmp_path):
    _write(tmp_path)
    assert ckpt.verify(tmp_path) == 2
    assert torch.equal(ckpt.read_file(tmp_path, ckpt.STATE)["model"]["w"], torch.ones(4, 4))


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda d: (d / ckpt.STATE).write_bytes((d / ckpt.STATE).read_bytes()[:100]), "differs from the manifest"),
        (lambda d: _flip_byte(d / "rank1.pt"), "differs from the manifest (damaged)"),
        (lambda d: (d / "manifest.rank1.json").unlink(), "no manifest.rank1.json (an interrupted write?)"),
        (lambda d: (d / "manifest.rank0.json").unlink(), "no manifest.rank0.json"),
        (lambda d: (d / "manifest.rank0.json").write_text("{"), "unreadable manifest"),
        (lambda d: (d / ckpt.STATE).unlink(), "listed in the manifest but missing"),
    ],
    ids=["truncated", "corrupted", "manifest-less worker", "manifest-less", "bad manifest", "missing file"],
)
def test_damage_is_detected(tmp_path, damage, message):
    _write(tmp_path)
    damage(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match=re.escape(message)):
        ckpt.verify(tmp_path)


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_pickle_that_would_run_code_is_refused_even_with_a_valid_manifest(tmp_path):
    marker = tmp_path / "pwned"
    d = tmp_path / "ckpt"
    ckpt.write_files(d, 0, {ckpt.STATE: {"model": Exploit(marker)}, ckpt.rank_file(0): {}}, 1)
    assert ckpt.verify(d) == 1  # the manifest matches: only the loader stands in the way
    with pytest.raises(ckpt.CheckpointError, match=r"state.pt: refused or unreadable \(UnpicklingError"):
        ckpt.read_file(d, ckpt.STATE)
    assert not marker.exists()
    torch.load(d / ckpt.STATE, weights_only=False)  # the control: unrestricted unpickling runs it
    assert marker.exists()


def test_checkpoint_names_sort_by_step_then_by_rewrite():
    names = ["checkpoint_00000012-2", "checkpoint_00000018", "checkpoint_00000012", "notes", "checkpoint_00000018-3"]
    assert sorted(names, key=ckpt.order_key) == [
        "notes",
        "checkpoint_00000012",
        "checkpoint_00000012-2",
        "checkpoint_00000018",
        "checkpoint_00000018-3",
    ]
    assert ckpt.step_of("checkpoint_00000040-2") == 40 and ckpt.step_of("checkpoint_manager_snapshot.json") == -1
    assert ckpt.step_of("checkpoint_000002") == -1  # Tune's copy, in a sweep trial's run directory


def test_the_spike_detector_waits_for_history_then_calls_a_jump():
    spike = SpikeDetector(factor=5.0, window=4, min_steps=3)
    for step, loss in enumerate([9.0, 8.0, 2.0], 1):  # no call before min_steps of history
        spike.check(loss, step)
    spike.check(float("nan"), 4)  # non-finite values are the non-finite guard's to handle
    spike.check(1.0, 5)
    with pytest.raises(LossSpikeError, match=r"loss spike at step 6: 26 is 5\.2x the mean 5 of the last 4 steps"):
        spike.check(26.0, 6)
    off = SpikeDetector(factor=0.0, window=4, min_steps=3)
    for step, loss in enumerate([9.0, 8.0, 2.0, 1.0, 26.0, 1e9], 1):  # the same history, then a larger jump
        off.check(loss, step)


@pytest.mark.parametrize(
    "override,key,fragment",
    [
        ("fault.plan=[{step: 3, kind: explode}]", "fault.plan[0].kind", "must be one of raise, kill, nan, spike"),
        ("fault.plan=[{rank: 1}]", "fault.plan[0].step", "is required"),
        ("fault.plan=[{step: 2, rnk: 1}]", "fault.plan[0].rnk", "did you mean 'rank'?"),
        ("fault.plan=[{step: 2, rank: -1}]", "fault.plan[0].rank", "must be a worker rank >= 0"),
        ("checkpoint.keep=1", "checkpoint.keep", "must be 0 (keep all) or >= 2"),
        ("spike.factor=0.5", "spike.factor", "must be 0 (off) or > 1"),
        ("scaling.min_workers=3", "scaling.min_workers", "must be <= num_workers=2"),
    ],
)
def test_reliability_settings_are_checked(override, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(resolve("default"), [override])
    assert info.value.key == key and fragment in str(info.value)


def test_a_spike_window_shorter_than_its_min_steps_is_refused_naming_the_key():
    # The history holds at most window losses: min_steps above it would switch the guard off.
    with pytest.raises(ConfigError) as info:
        load_config(resolve("default"), ["spike.factor=3", "spike.window=5", "spike.min_steps=10"])
    assert info.value.key == "spike.min_steps" and "must be <= window=5" in str(info.value)
    assert load_config(resolve("default"), ["spike.window=5", "spike.min_steps=10"]).spike.factor == 0  # off: moot


def test_a_checkpoint_records_who_wrote_it(tmp_path):
    _write(tmp_path, world=3)
    manifest = json.loads((tmp_path / "manifest.rank2.json").read_text())
    assert manifest["world_size"] == 3 and manifest["rank"] == 2 and set(manifest["files"]) == {"rank2.pt"}


def _rewrite_manifest(d, rank, change):
    path = d / f"manifest.rank{rank}.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["../outside.pt", "ABSOLUTE", "sub/../../outside.pt"])
def test_a_manifest_naming_a_file_outside_its_directory_is_damage(tmp_path, name):
    d = tmp_path / "ckpt"
    _write(d, world=1)
    (d / "sub").mkdir()
    name = str(tmp_path / "outside.pt") if name == "ABSOLUTE" else name
    outside = tmp_path / "outside.pt"  # every name above points at it
    outside.write_bytes(b"a file that matches its manifest entry")
    entry = {"bytes": outside.stat().st_size, "sha256": hashlib.sha256(outside.read_bytes()).hexdigest()}
    _rewrite_manifest(d, 0, lambda m: m["files"].update({name: entry}))
    with pytest.raises(ckpt.CheckpointError, match=re.escape(f"file name {name!r} points outside the checkpoint")):
        ckpt.verify(d)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda m: m.update(world_size=0), "world_size must be at least 1; got 0"),
        (lambda m: m.update(world_size=-2), "world_size must be at least 1; got -2"),
        (lambda m: m["files"]["rank0.pt"].pop("sha256"), "unreadable manifest (KeyError"),
        (lambda m: m["files"].update({"rank0.pt": 7}), "unreadable manifest (TypeError"),
    ],
    ids=["world 0", "world negative", "no checksum", "entry not a mapping"],
)
def test_a_manifest_with_impossible_values_is_damage(tmp_path, change, message):
    _write(tmp_path, world=1)
    _rewrite_manifest(tmp_path, 0, change)
    with pytest.raises(ckpt.CheckpointError, match=re.escape(message)):
        ckpt.verify(tmp_path)


@pytest.mark.parametrize(
    "saved,message",
    [
        (["optim.name=adamw"], "the plain checkpoint's optimizer has 1 parameter groups, the model's 2"),
        (["optim.param_groups=decay_split", "ema.enabled=false"], "the plain checkpoint holds no ema state"),
        (
            ["optim.param_groups=decay_split", "HIDDEN"],
            "model.encoder.weight: the checkpoint holds (8, 6), the model (16, 6)",
        ),
    ],
    ids=["optimizer groups", "no ema", "shape"],
)
def test_a_plain_state_that_does_not_fit_a_sharded_engine_is_refused_naming_it_before_anything_is_written(
    saved, message
):
    from raytrain_loops.engine import Engine
    from tests.support import fakes

    def engine(overrides, seed, d_hidden=16):
        config = fakes.config("optim.name=adamw", "ema.enabled=true", *overrides).engine
        return Engine(fakes.make_model(seed=seed, d_hidden=d_hidden), fakes.mean_loss, config, total_steps=4)

    mine = engine(["optim.param_groups=decay_split"], seed=1)
    before = {k: v.clone() for k, v in mine.module.state_dict().items()}
    hidden = 8 if "HIDDEN" in saved else 16
    state = engine([o for o in saved if o != "HIDDEN"], seed=2, d_hidden=hidden).state_dict()  # other weights
    with pytest.raises(ValueError) as info:
        ckpt.fill_from_plain(mine.sharded_targets(), state)
    assert message in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in mine.module.state_dict().items())
