"""The lm task on generated tokens (``task.params.data=generated``): a seeded language with a
known floor, packed like the bytes, and a tied GPT that learns it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from raytrain_loops.config import ConfigError
from raytrain_loops.engine import Engine
from raytrain_loops.tasks.base import build_task
from raytrain_loops.tasks.lm import IGNORE, LMTask
from tests.support import fakes

TINY = {"data": "generated", "vocab": 512, "dim": 32, "layers": 2, "heads": 2, "max_len": 64, "max_tokens": 1024}


def _rows(task: LMTask, path: str) -> list[tuple[np.ndarray, list[int]]]:
    """Each Parquet row's tokens, decoded as the task stores them, and its lengths."""
    table = pq.read_table(path).to_pydict()
    dtype = "<u2" if task.vocab <= 65536 else "<i4"
    return [(np.frombuffer(t, dtype=dtype), ls) for t, ls in zip(table["tokens"], table["lengths"], strict=True)]


def _collated(task: LMTask, data_dir, split: str) -> list:
    table = pq.read_table(task.splits(data_dir)[split].path).to_pydict()
    return [
        task.collate({"tokens": np.array([t], dtype=object), "lengths": np.array([ls], dtype=object)})
        for t, ls in zip(table["tokens"], table["lengths"], strict=True)
    ]


def _digests(task: LMTask, data_dir) -> dict[str, bytes]:
    base = task.data_subdir(data_dir)
    return {name: (base / name).read_bytes() for name in ("train.parquet", "valid.parquet", "stats.json")}


def test_generated_tokens_are_the_same_for_a_seed_packed_under_the_budget_and_their_floor_is_right(tmp_path):
    params = {**TINY, "tokens": 60_000, "seed": 3, "val_percent": 10.0}
    task = LMTask(**params)
    task.prepare(tmp_path / "a")
    again = LMTask(**params)
    again.prepare(tmp_path / "b")
    assert _digests(task, tmp_path / "a") == _digests(again, tmp_path / "b")  # deterministic for a seed
    other = LMTask(**{**params, "seed": 4})
    assert other.data_subdir(tmp_path) != task.data_subdir(tmp_path)
    other.prepare(tmp_path / "a")
    assert _digests(other, tmp_path / "a")["train.parquet"] != _digests(task, tmp_path / "a")["train.parquet"]

    stats = json.loads((task.data_subdir(tmp_path / "a") / "stats.json").read_text())
    assert stats["train"]["tokens"] == 60_000 and stats["valid"]["tokens"] == 6_000
    splits = task.splits(tmp_path / "a")
    for name, split in (("train", splits["train"]), ("valid", splits["eval"])):
        rows = _rows(task, split.path)
        tokens = np.concatenate([t for t, _ in rows])
        assert tokens.min() >= 0 and tokens.max() < task.bos == 511  # BOS is never a target
        assert all(len(ls) * max(ls) <= TINY["max_tokens"] and max(ls) <= TINY["max_len"] for _, ls in rows)
        assert all(len(t) == sum(ls) for t, ls in rows) and len(tokens) == stats[name]["tokens"]
        assert len({len(ls) for _, ls in rows}) > 1 and len({max(ls) for _, ls in rows}) > 1  # variable shapes
    inputs, targets, n = _collated(task, tmp_path / "a", "eval")[0]
    assert (inputs[:, 0] == task.bos).all() and not (targets == task.bos).any()
    assert n == int((targets != IGNORE).sum())

    # The floor is the mean of -log2 P(token | previous) over the validation tokens; if the tokens
    # follow the language, it is within sampling error of the expected conditional entropy.
    language = task.language
    rows = _rows(task, splits["eval"].path)
    entropy = []
    for t, ls in rows:
        previous = np.concatenate([[-1], t[:-1].astype(np.int64)])
        previous[np.cumsum(ls) - ls] = -1
        entropy.append(_conditional_entropy(language, previous))
    expected = float(np.concatenate(entropy).mean())
    assert abs(stats["floor_valid_bpt"] - expected) < 0.1, (stats["floor_valid_bpt"], expected)
    uniform = np.log2(task.vocab - 1)
    assert stats["floor_valid_bpt"] + 2.0 < stats["unigram_valid_bpt"] < uniform
    assert len(task.unigram_bits) == task.vocab - 1

    written = (task.data_subdir(tmp_path / "a") / "train.parquet").stat().st_mtime_ns
    task.prepare(tmp_path / "a")
    assert (task.data_subdir(tmp_path / "a") / "train.parquet").stat().st_mtime_ns == written  # idempotent


def _conditional_entropy(language, previous: np.ndarray) -> np.ndarray:
    """H(next | previous) in bits for each position (a unigram draw after BOS)."""
    from raytrain_loops.tasks.datasets.tokens import FOLLOW, SUCCESSORS

    n = language.symbols
    table = np.tile((1 - FOLLOW) * language.unigram, (n, 1))
    for j in range(SUCCESSORS):
        np.add.at(table, (np.arange(n), language.successors[:, j]), FOLLOW / SUCCESSORS)
    h = -(table * np.log2(table)).sum(1)
    h_unigram = -(language.unigram * np.log2(language.unigram)).sum()
    return np.where(previous < 0, h_unigram, h[np.maximum(previous, 0)])


def test_a_vocabulary_over_uint16_is_stored_as_int32(tmp_path):
    task = LMTask(**{**TINY, "vocab": 70_000, "tokens": 4_000, "max_len": 32, "max_tokens": 256})
    task.prepare(tmp_path)
    tokens = np.concatenate([t for t, _ in _rows(task, task.splits(tmp_path)["train"].path)])
    assert len(tokens) == 4_000 and tokens.max() >= 1 << 16 and tokens.max() < task.bos == 69_999
    inputs, targets, _ = _collated(task, tmp_path, "train")[0]
    assert inputs[0, 0] == 69_999 and int(targets[targets != IGNORE].max()) < 69_999


def test_the_generated_model_ties_its_embedding_and_head_and_bytes_keep_their_names():
    model = LMTask(**{**TINY, "tokens": 1000}).build_model()
    assert model.head.weight is model.embed.weight and model.head.bias is None
    assert tuple(model.embed.weight.shape) == (512, 32)
    names = [n for n, _ in model.named_parameters()]
    assert "embed.weight" in names and "head.weight" not in names  # one parameter for the optimizer
    byte_model = LMTask(dim=32, layers=2, heads=2).build_model()
    assert [n for n, _ in byte_model.named_parameters()][:1] + [n for n, _ in byte_model.named_parameters()][-2:] == [
        "embed.weight",
        "head.weight",
        "head.bias",
    ]
    assert tuple(byte_model.embed.weight.shape) == (257, 32) and tuple(byte_model.head.weight.shape) == (256, 32)


@pytest.fixture
def one_thread():
    """One intra-op thread for a long run of tiny ops: on a shared machine, more threads than
    free cores make each op wait (5 s of training becomes 50)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_tiny_generated_token_model_goes_well_below_the_unigram_toward_the_floor(tmp_path, one_thread):
    steps = 300
    task = LMTask(**{**TINY, "tokens": steps * TINY["max_tokens"], "seed": 0, "val_percent": 5.0})
    task.prepare(tmp_path)
    train, valid = _collated(task, tmp_path, "train"), _collated(task, tmp_path, "eval")
    torch.manual_seed(0)
    schedule = ["schedules.lr.kind=cosine", "schedules.lr.value=1e-2", "schedules.lr.end=1e-4"]
    config = fakes.config("loss.reduction=sum", "optim.name=adamw", *schedule, "schedules.lr.warmup_steps=10")
    engine = Engine(task.build_model(), task.criterion, config.engine, total_steps=steps)
    for step in range(steps):
        engine.train_step([train[step % len(train)]])
    logged = engine.reduce_metrics()
    assert "bpt" in logged and "bpb" not in logged  # bits per token, not per byte
    sums: dict[str, float] = {}
    engine.module.eval()
    with torch.no_grad():
        for batch in valid:
            for name, (value, count) in task.evaluate(engine.module, batch).items():
                sums[name] = sums.get(name, 0.0) + float(value) * count
    total = sum(b[2] for b in valid)
    got, unigram, floor = (sums[k] / total for k in ("bpt", "unigram_bpt", "floor_bpt"))
    print(f"after {steps} steps: eval_bpt {got:.3f}, unigram {unigram:.3f}, floor {floor:.3f}")
    stats = json.loads((task.data_subdir(tmp_path) / "stats.json").read_text())
    assert abs(floor - stats["floor_valid_bpt"]) < 1e-6 and abs(unigram - stats["unigram_valid_bpt"]) < 1e-4
    assert "bpb" not in sums and "unigram_bpb" not in sums
    # Three quarters of the way from the unigram to the floor at least (measured: about 85%).
    assert floor - 0.05 < got < floor + 0.25 * (unigram - floor), (got, unigram, floor)


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"data": "generated", "vocab": 1}, "task.params.vocab"),
        ({"data": "generated", "tokens": 0}, "task.params.tokens"),
        ({"data": "generated", "source": "/usr"}, "task.params.source"),
        ({"data": "words"}, "task.params.data"),
        ({"vocab": 512}, "task.params.vocab"),
        ({"data": "bytes", "tokens": 1000}, "task.params.tokens"),
        ({"seed": 1}, "task.params.seed"),
        ({"dim": 130}, "task.params.dim"),  # not a multiple of the 4 heads
        ({"max_tokens": 8, "max_len": 64}, "task.params.max_tokens"),
        ({"dropout": 1.0}, "task.params.dropout"),
    ],
)
def test_bad_data_params_are_refused_naming_the_key(params, key):
    with pytest.raises(ConfigError) as info:  # exit code 2 from the CLI, before Ray starts
        build_task("lm", params)
    assert info.value.key == key


def test_a_source_that_is_not_a_directory_is_refused_on_the_driver_naming_the_key(tmp_path):
    task = build_task("lm", {"source": str(tmp_path / "missing")})
    with pytest.raises(ConfigError) as info:
        task.prepare(tmp_path / "data")
    assert info.value.key == "task.params.source" and "is not a directory" in str(info.value)


def _write_source(root: Path) -> None:
    """Six small .py files (two fall in validation at val_percent=20), each with a line longer
    than max_len."""
    for k, name in enumerate(["a.py", "b.py", "c.py", "d.py", "e.py", "pkg/f.py"]):
        lines = [f"v{k}_{i} = {i * i}  # {'-' * ((i * 7 + k) % 45)}\n" for i in range(60 + 25 * k)]
        lines.insert(10, "s = '" + "y" * 80 + "'\n")
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("".join(lines))


def test_bytes_stay_as_they_were_rows_stats_and_cache_directory(tmp_path):
    # Digests taken from the task before generated data existed: the bytes path and its cache
    # directory must not move (existing caches stay valid, runs stay comparable).
    _write_source(tmp_path / "src")
    task = LMTask(dim=8, layers=1, heads=1, max_len=48, max_tokens=192, val_percent=20.0, source=str(tmp_path / "src"))
    task.prepare(tmp_path / "data")
    base = task.data_subdir(tmp_path / "data")
    rows = {s: pq.read_table(base / f"{s}.parquet").to_pydict() for s in ("train", "valid")}
    blob = json.dumps(
        {s: [[t.hex(), ls] for t, ls in zip(r["tokens"], r["lengths"], strict=True)] for s, r in rows.items()}
    )
    stats = json.loads((base / "stats.json").read_text())
    stats.pop("source")
    assert hashlib.sha256(blob.encode()).hexdigest().startswith("54b4b691f466d40e")
    assert hashlib.sha256(json.dumps(stats, sort_keys=True).encode()).hexdigest().startswith("8757a44d3034d95d")
    fixed = LMTask(source="/srv/corpus/src", max_len=48, max_tokens=192, val_percent=20.0)
    assert fixed.data_subdir(Path("/d")) == Path("/d/lm/src-c249a996ce")
