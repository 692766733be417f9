"""The run directory's layout: the names of the files every process that runs a part of the run
reads or writes (the driver, the workers, the Train controller, local mode, the tools). Its
checkpoints are :mod:`raytrain_loops.checkpoint`'s."""

from __future__ import annotations

LOCK = "driver.lock"
CHANGES = "config_changes.jsonl"
ARTEFACTS = "artefacts"  # the task's pinned files: <run>/artefacts/<name>
ARTEFACTS_FILE = "artefacts.json"  # their SHA-256 and the prepared data's digest
SUMMARY = "summary.json"  # a finished run's metrics; removed when the run trains again
PRECISION_FILE = "precision.json"  # the dtype the run trains in (precision.dtype=auto resolved at its first start)
MICRO_BATCH_FILE = "micro_batch.json"  # accum.micro_batch=auto: the splits per batch after the latest OOM
MODEL_FILE = "model.json"  # the task's class and its model's parameter and buffer shapes, recorded at the first start

