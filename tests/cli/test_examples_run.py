"""The examples run as their docs say, at reduced sizes (no Ray: local mode). The others run
inside tests that already start what they need: ``examples/custom_task.py`` (tests/cli/test_local_mode.py
and others), ``examples/ray_dataset.py`` (tests/data/test_user_ray_dataset.py, on the suite's Ray),
``examples/finetune_hf.yaml`` (tests/recipes/test_hf_lm_task.py), ``examples/sweep.yaml``
(tests/ray/test_tune_sweeps.py's Optuna sweep), ``examples/job/`` (tests/ray/test_job_submit.py, on the two-node
test bed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from examples.parquet_task import TableTask, main, statistics
from raytrain_loops.data.parquet import ROW_SEED
from tests.support.runfiles import records


def test_the_parquet_example_makes_its_table_preprocesses_each_row_from_its_seed_and_trains_locally(tmp_path, capsys):
    data = tmp_path / "my_data"
    assert main(["--make-data", str(data)]) is None
    assert (data / "train" / "part-0.parquet").is_file() and (data / "eval" / "part-0.parquet").is_file()

    mean, std = statistics(str(data))
    task = TableTask(str(data), mean, std, noise=0.1)
    import pyarrow.parquet as pq

    table = pq.read_table(data / "train").slice(0, 256)
    batch = {"features": np.stack(table["features"].to_pylist()), "label": table["label"].to_numpy()}
    batch[ROW_SEED] = np.arange(256, dtype=np.uint64)
    plain = task.preprocess({**batch}, train=False)
    assert abs(plain["features"].mean()) < 0.2 and abs(plain["features"].std() - 1) < 0.2  # standardised
    noisy, again = task.preprocess({**batch}, train=True), task.preprocess({**batch}, train=True)
    assert np.array_equal(noisy["features"], again["features"])  # each row's noise from its seed
    assert 0.05 < np.abs(noisy["features"] - plain["features"]).mean() < 0.15

    result = main(["--data", str(data), "--local", "--epochs", "2", "--storage-path", str(tmp_path / "runs")])
    assert result.metrics["eval_accuracy"] > 0.95 and "accuracy" in capsys.readouterr().out
    steps = [r["step"] for r in records(Path(result.run_dir) / "metrics.jsonl")]
    assert steps == list(range(1, 2 * 4096 // 64 + 1))  # every row of 2 epochs, 64 a step
