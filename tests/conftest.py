"""Shared fixtures: one local Ray instance for the whole session (starting Ray costs seconds)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The object-store tests talk to a local S3 API (tests/support/s3.py). pyarrow's S3 client signs its
# requests, here and in Ray's workers, which take the environment of the process that starts
# the session's Ray: set before any test runs.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


def pytest_collection_modifyitems(items):
    """A test that uses a Ray fixture is marked ``ray`` even if its author forgot: scripts/test.sh
    runs the Ray tests in a process of their own, and a Ray test left among the others would start
    a second Ray instance there.

    The multi-node tests run last, one after the other: the test bed's head, second node and S3
    server (the session's ``cluster``) start at the first of them and stop with the session, so
    their processes take no CPU from the rest of the suite (on 2 cores, an idle cluster alive for
    the whole Ray part slowed every other test)."""
    for item in items:
        if {"ray_session", "cluster"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ray)
    items.sort(key=lambda item: "cluster" in getattr(item, "fixturenames", ()))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with 4 logical CPUs: two 1-CPU training workers and room for the preprocessing tasks."""
    import ray

    from raytrain_loops.driver.ray_start import start_local_ray

    # Workers import test and example modules by name.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    # Ray's processes take this environment. No run starts a preemption watcher actor (no test
    # covers cloud preemption notices): an actor process fewer per run, ~30 runs. (The controller's
    # 0.5 s poll is start_local_ray's own.)
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    # "accel": a custom resource standing in for a GPU (preprocessing placed where it is advertised).
    start_local_ray(4, resources={"accel": 2})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def cluster():
    """The multi-node test bed (tests/support/multinode.py): a Ray head with token auth and a moto S3
    server, started once for every multi-node test; each test starts, drains and stops the second
    node (its own mount namespace: it sees none of the head's files) as it needs."""
    from tests.support.multinode import running_cluster

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    import ray

    # The multi-node tests run last (see above): the shared local Ray, idle from here on, stops now.
    if ray.is_initialized():
        ray.shutdown()
    with running_cluster() as running:
        yield running
