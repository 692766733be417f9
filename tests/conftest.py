"""Shared fixtures: one local Ray instance for the whole session (starting Ray costs seconds)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with 4 logical CPUs: two 1-CPU training workers and room for Ray Data."""
    import ray

    # Workers import test and example modules by name.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    ray.init(address="local", num_cpus=4, dashboard_host="127.0.0.1", log_to_driver=True)
    yield ray
    ray.shutdown()
