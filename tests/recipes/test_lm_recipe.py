"""The fairseq-style language-model recipe: packed variable-length batches, updates normalised by
the tokens of all workers and micro-batches, dummy batches for a worker that ran out, and the
check that DDP left the same gradients on every worker."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from raytrain_loops.config import load_config
from raytrain_loops.engine import Engine
from raytrain_loops.errors import GradSyncError
from raytrain_loops.recipes import resolve
from raytrain_loops.tasks.lm import BOS, IGNORE, LMTask, cut
from tests.support import fakes
from tests.support.gloo import run_gloo

JSON_DIR = Path(sysconfig.get_paths()["stdlib"]) / "json"  # 5 small files, on every Python
TINY = {"dim": 32, "layers": 2, "heads": 2, "max_len": 64, "max_tokens": 512}


def _row(pieces: list[bytes]) -> dict[str, np.ndarray]:
    """One packed Parquet row, as Ray Data hands it to ``collate``."""
    lengths = np.empty(1, dtype=object)
    lengths[0] = np.array([len(p) for p in pieces], dtype=np.int32)
    return {"tokens": np.array([b"".join(pieces)], dtype=object), "lengths": lengths}


def _batches() -> list:
    """Five real batches of different shapes and token counts, cut from a stdlib file."""
    pieces = cut((JSON_DIR / "decoder.py").read_bytes(), TINY["max_len"])
    task = LMTask(**TINY)
    cuts = [(0, 3), (3, 4), (4, 9), (9, 11), (11, 17)]
    return [task.collate(_row(pieces[a:b])) for a, b in cuts]


def test_collate_pads_on_the_right_and_shifts_inputs_by_one():
    inputs, targets, ntokens = LMTask(**TINY).collate(_row([b"abc", b"de"]))
    assert ntokens == 5
    assert inputs.tolist() == [[BOS, ord("a"), ord("b")], [BOS, ord("d"), 0]]
    assert targets.tolist() == [[ord("a"), ord("b"), ord("c")], [ord("d"), ord("e"), IGNORE]]


def test_prepare_packs_every_byte_under_the_token_budget_once(tmp_path):
    task = LMTask(**{**TINY, "source": str(JSON_DIR), "val_percent": 20.0})
    task.prepare(tmp_path)
    splits = task.splits(tmp_path)
    tables = {name: pq.read_table(s.path) for name, s in splits.items()}
    stats = json.loads((task.data_subdir(tmp_path) / "stats.json").read_text())
    source_bytes = sum(p.stat().st_size for p in JSON_DIR.glob("*.py"))
    assert stats["train"]["tokens"] + stats["valid"]["tokens"] == source_bytes
    assert stats["valid"]["files"] == 1 and stats["train"]["files"] == 4  # scanner.py: crc32 % 10000 = 1173
    for name, table in tables.items():
        lengths = table.column("lengths").to_pylist()
        assert all(len(ls) * max(ls) <= TINY["max_tokens"] and max(ls) <= TINY["max_len"] for ls in lengths)
        assert [len(t) for t in table.column("tokens").to_pylist()] == [sum(ls) for ls in lengths]
        assert sum(map(sum, lengths)) == stats["train" if name == "train" else "valid"]["tokens"]
    assert len({len(ls) for ls in tables["train"].column("lengths").to_pylist()}) > 1  # variable batch shapes
    written = (task.data_subdir(tmp_path) / "train.parquet").stat().st_mtime_ns
    task.prepare(tmp_path)
    assert (task.data_subdir(tmp_path) / "train.parquet").stat().st_mtime_ns == written  # idempotent
    uniform = 8.0
    assert 3.0 < stats["unigram_valid_bpb"] < uniform
    assert task.unigram_bits is not None and len(task.unigram_bits) == 256


def _reference(steps: list[list]) -> dict[str, torch.Tensor]:
    """The update by hand: for each step, minus (the summed loss of all its batches / their tokens)'s
    gradient (SGD, lr 1)."""
    torch.manual_seed(0)
    model = LMTask(**TINY).build_model()
    for batches in steps:
        model.zero_grad()
        loss = sum(
            F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
            for x, y, _ in batches
        )
        (loss / sum(n for _, _, n in batches)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= p.grad
    return fakes.params(model)


def _engine_updates(rank: int, world: int, per_rank_steps) -> dict:
    torch.manual_seed(0)
    model = LMTask(**TINY).build_model()
    if world > 1:
        model = DDP(model)
    engine = Engine(model, LMTask(**TINY).criterion, fakes.config("loss.reduction=sum").engine, total_steps=2)
    batches = _batches()
    sizes = []
    for step in per_rank_steps[rank]:
        result = engine.train_step([None if i is None else batches[i] for i in step])
        assert result.applied
        sizes.append(result.sample_size)
    return {"params": fakes.params(engine.module), "sizes": sizes}


def _assert_matches(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str) -> None:
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, atol=2e-6, rtol=0, msg=f"{what}: {name}")


def test_one_update_is_the_same_over_two_workers_or_two_micro_batches():
    batches = _batches()
    assert batches[0][2] != batches[1][2] and batches[0][0].shape != batches[1][0].shape
    ref = _reference([[batches[0], batches[1]]])
    start = fakes.params(LMTask(**TINY).build_model())
    assert max((ref[k] - start[k]).abs().max().item() for k in ref) > 1e-3, "the update must move the weights"

    one_worker = _engine_updates(0, 1, [[[0, 1]]])
    _assert_matches(one_worker["params"], ref, "1 worker x 2 micro-batches")
    outcomes = run_gloo(2, _engine_updates, [[[0]], [[1]]])
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message
    for o in outcomes:
        _assert_matches(o.value["params"], ref, "2 workers x 1 micro-batch")
        assert o.value["sizes"] == one_worker["sizes"] == [batches[0][2] + batches[1][2]]


def test_a_worker_that_ran_out_joins_with_a_dummy_batch_that_counts_for_nothing():
    batches = _batches()
    # Worker 1 has one batch for the first update and none for the second; worker 0 has four.
    steps = [[[0, 1], [3, 4]], [[2, None], [None, None]]]
    outcomes = run_gloo(2, _engine_updates, steps)
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message
    ref = _reference([[batches[0], batches[1], batches[2]], [batches[3], batches[4]]])
    for o in outcomes:
        _assert_matches(o.value["params"], ref, "uneven shards")
        assert o.value["sizes"] == [sum(batches[i][2] for i in (0, 1, 2)), batches[3][2] + batches[4][2]]


def _desynchronised(rank: int, world: int) -> dict:
    """One update with a DDP comm hook that skips the all-reduce: each worker keeps its own gradients."""
    x, y = fakes.regression_data(n=8, seed=rank)
    out = {}
    for check in (False, True):
        model = DDP(fakes.make_model())

        def local_only(state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        model.register_comm_hook(None, local_only)
        config = fakes.config("loss.reduction=sum", f"grad_sync.check={check}")
        engine = Engine(model, fakes.sum_loss, config.engine, total_steps=1)
        try:
            engine.train_step([(x, y)])
            out[check] = fakes.params(engine.module)
        except GradSyncError as err:
            out[check] = str(err)
    return out


def test_workers_holding_different_gradients_raise_naming_them():
    outcomes = run_gloo(2, _desynchronised)
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message
    unchecked = [o.value[False] for o in outcomes]
    assert any(not torch.equal(unchecked[0][k], unchecked[1][k]) for k in unchecked[0]), "the workers drifted apart"
    for o in outcomes:
        message = o.value[True]
        assert isinstance(message, str), "grad_sync.check=true must raise GradSyncError"
        assert "gradients differ between workers after DDP synchronisation at step 0" in message
        assert "worker 0: " in message and "worker 1: " in message and "worker(s) 0, 1 differ" in message


def test_the_recipe_decays_every_parameter_as_fairseqs_one_group():
    """fairseq's optimizer has one group, weight decay on every parameter (biases and LayerNorm too)."""
    cfg = load_config(resolve("lm"), ["precision.dtype=fp32"])
    task = LMTask(dim=32, layers=1, heads=2, max_len=32)
    model = task.build_model()
    engine = Engine(model, task.criterion, cfg.engine, total_steps=4)
    (group,) = engine.optimizer.param_groups
    assert group["decay"] and len(group["params"]) == len(list(model.parameters()))
    assert any(n.endswith("bias") for n in group["param_names"]) and cfg.schedules["weight_decay"].value == 0.01
