"""A run directory's logs as the tests read them back: the JSON lines files and TensorBoard's
scalars (through TensorBoard's own reader)."""

from __future__ import annotations

import json
from pathlib import Path


def records(path: Path) -> list[dict]:
    """The records of a JSON lines file, in file order."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def tb_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in the event files of ``log_dir``: its (step, value) pairs as TensorBoard
    loads them, in file order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
