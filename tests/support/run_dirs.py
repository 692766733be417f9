"""A run directory as the driver finds it before Ray starts: a config of the custom task example
(one epoch, run ``r`` under a given storage path), the directory an earlier run of a config left
(its config and checkpoints of two workers), and the exception the tests raise where ``fit`` would
start Ray, so that everything before it runs for real."""

from __future__ import annotations

from pathlib import Path

import yaml

from examples.custom_task import CONFIG
from raytrain_loops.checkpoint import files as ckpt
from raytrain_loops.config import load_config


class RayWouldStart(Exception):
    """Raised where fit would start Ray: everything before it ran."""


def spiral_config(tmp_path: Path, **sections) -> dict:
    """The custom task example's config for one epoch, run ``r`` in ``tmp_path``; ``sections``
    update its sections."""
    config = {**CONFIG, "loop": {"epochs": 1}, "run": {"name": "r", "storage_path": str(tmp_path), "progress": False}}
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    return config


def started_run(tmp_path: Path, config: dict, steps: tuple[int, ...] = (8,)) -> Path:
    """A run directory as an earlier run of ``config`` left it: its config and checkpoints."""
    run = tmp_path / "r"
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(yaml.safe_dump(load_config(config).to_dict()))
    for step in steps:
        d = run / f"checkpoint_{step:08d}"
        for rank in range(2):
            files = {ckpt.rank_file(rank): {"data": {"epoch": 0, "batches": step}}}
            if rank == 0:
                files[ckpt.STATE] = {"model": {}}
            ckpt.write_files(d, rank, files, 2)
    return run
