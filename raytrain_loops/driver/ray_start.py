"""Ray start-up; runs on the driver: join the cluster in ``RAY_ADDRESS`` (as under ``ray job
submit``) or start a local Ray instance sized for the run, with a CPU for preprocessing beside the workers.
"""

from __future__ import annotations

import math
import os
from typing import Any

from raytrain_loops.config import Config


def ensure_ray(config: Config, num_cpus: float = 0) -> None:
    """Join the cluster in ``RAY_ADDRESS`` (as under ``ray job submit``), or start a local one
    with CPU left over for preprocessing tasks beside the training workers (``num_cpus``: at least this
    many logical CPUs)."""
    import ray

    # One line per print on the driver (Ray Train otherwise also logs every print).
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
        return
    s = config.scaling
    needed = max(num_cpus, s.num_workers * s.cpus_per_worker + 1)  # + 1 for the preprocessing tasks
    store = {"object_store_memory": int(s.object_store_gb * 1e9)} if s.object_store_gb else {}
    start_local_ray(max(os.cpu_count() or 1, math.ceil(needed)), **store)



def start_local_ray(num_cpus: int, **kwargs: Any) -> None:
    """A new local Ray instance whose dashboard (on 127.0.0.1) every process of it can find, with
    its workers at the priority of its own services (``RAY_worker_niceness``, 0 unless set) and
    Ray Train's controller polling its workers every 0.5 s (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``).

    Ray Train cleans up after a controller that died (a stopped Tune trial, a killed driver)
    through the State API, which it finds through the dashboard's address. Without
    ``RAY_API_SERVER_ADDRESS`` it would look for the cluster ``ray start`` last recorded on this
    machine, which is not this instance (or no longer exists), and the dead controller's
    placement groups would hold their CPUs forever.
    """
    import socket

    import ray

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Set before ray.init: the raylet and every worker inherit the driver's environment.
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    # Ray starts its workers at nice 15, below its own services. On a machine that this run has
    # to itself, the training workers are the work: at nice 15 every wake-up of a Ray service
    # preempts them (docs/benchmarks.md, "Ray's overhead and local mode").
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Ray Train's controller takes one report per poll of its workers, every 2 s by default; a run
    # that reports more often than that (every epoch of a small recipe) ends waiting for the
    # backlog (docs/benchmarks.md, "The default recipe").
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    # The raylet deletes the objects nobody holds any more in batches, once a second by default:
    # blocks a training worker has read then wait up to a second in the object store, beside the
    # preprocessing budget (data.preprocess.memory_gb). Every 20 ms, they leave with their step.
    os.environ.setdefault("RAY_free_objects_period_milliseconds", "20")
    ray.init(
        address="local",  # a new instance, even when `ray start` left one running on this machine
        num_cpus=num_cpus,
        dashboard_host="127.0.0.1",
        dashboard_port=port,
        log_to_driver=True,
        **kwargs,
    )
