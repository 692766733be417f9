"""The cluster's checks on the driver, once Ray is up and before the trainer starts: every alive node
that can host work opens what it will read (:mod:`raytrain_loops.data.reach`, in a Ray task pinned
to the node, all of them bounded by ``PROBE_TIMEOUT_S``), and a preprocessing task fits somewhere:
its CPUs beside the training workers, its GPUs and custom resources on one node (its tasks would
otherwise wait until a worker's ``data.preprocess.timeout_s``).

Each worker checks its own node again at every attempt (``worker/train.py``): a cluster that scales
from zero adds its nodes then.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_loops.config import Config, ConfigError
from raytrain_loops.data.reach import first_failure, targets, unreachable
from raytrain_loops.driver.preflight import DataError
from raytrain_loops.errors import root_cause
from raytrain_loops.tasks import ParquetSplit, Task, has_preprocess

PROBE_TIMEOUT_S = 60.0


def work_nodes() -> list[dict[str, Any]]:
    """The alive nodes where training workers or preprocessing tasks can land (some CPU or GPU)."""
    return [
        n
        for n in ray.nodes()
        if n.get("Alive") and (n["Resources"].get("CPU", 0) > 0 or n["Resources"].get("GPU", 0) > 0)
    ]


def node_name(node: dict[str, Any]) -> str:
    """A node as the errors name it: its address and the start of its Ray node id."""
    return f"{node['NodeManagerAddress']} (node id {node['NodeID'][:12]})"


@ray.remote(num_cpus=0, max_retries=0)
def _probe(found: list) -> tuple[str, str, str] | None:
    return first_failure(found)


def check_nodes(config: Config, splits: dict[str, Any], held: set[str]) -> None:
    """Every work node opens what the splits make it read (the splits in ``held`` are read by
    none); raises :class:`DataError` naming ``data.dir`` (or the split's own path) and the first
    node that cannot, or that did not answer in ``PROBE_TIMEOUT_S``."""
    found = targets(splits, held)
    if not found:
        return
    refs = {}
    for node in work_nodes():
        strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        refs[_probe.options(scheduling_strategy=strategy).remote(found)] = node
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
    for ref in ready:
        try:
            failed = ray.get(ref)
        except Exception as err:  # the split could not even travel there (a dataset that cannot unpickle)
            failed = (found[0][0], found[0][1], root_cause(err))
        if failed is not None:
            raise DataError(str(unreachable(config.data.dir, node_name(refs[ref]), failed)))
    for ref in pending:
        ray.cancel(ref, force=True)
    if pending:
        raise DataError(
            f"data.dir={config.data.dir}: node {node_name(refs[pending[0]])} did not open the data "
            f"({', '.join(what for _, what, _ in found)}) in {PROBE_TIMEOUT_S:.0f} s"
        )


def check_preprocess_cpus(config: Config, task: Task, splits: dict[str, Any]) -> None:
    """A preprocessing task's ``data.preprocess`` ask must fit: its ``num_cpus`` on one node and in
    what the cluster has left beside the training workers' CPUs, its ``num_gpus`` and
    ``resources`` on one node that has them all (a node that advertises a resource with less than
    asked is refused naming the key). A resource no node advertises yet is said on the console,
    not refused: an autoscaling pool adds its nodes when the work asks for them. A cluster that
    cannot hold the training workers yet is scaling up (its nodes come from zero) and is not judged."""
    p = config.data.preprocess
    if not has_preprocess(task) or not any(isinstance(s, ParquetSplit) for s in splits.values()):
        return
    nodes = [n["Resources"] for n in work_nodes()]
    _check_extra(p.num_gpus, dict(p.resources), nodes)
    need = p.num_cpus
    if need == 0:
        return
    cpus = [float(n.get("CPU", 0)) for n in nodes]
    s = config.scaling
    workers = s.num_workers * s.cpus_per_worker
    if sum(cpus) < workers:
        return
    left = sum(cpus) - workers
    if need > max(cpus, default=0) or need > left:
        raise ConfigError(
            "data.preprocess.num_cpus",
            f"each preprocessing task asks {need:g} CPUs, but the cluster's nodes have {', '.join(f'{c:g}' for c in cpus)} "
            f"CPUs, {left:g} of them left beside the {s.num_workers} training workers of scaling.cpus_per_worker="
            f"{s.cpus_per_worker:g}: the tasks would wait for them. Lower data.preprocess.num_cpus or "
            "scaling.cpus_per_worker, or add CPUs",
        )


def _check_extra(gpus: float, resources: dict[str, float], nodes: list[dict[str, float]]) -> None:
    """The GPUs and custom resources of one preprocessing task, on one node (see above)."""
    ask = {**({"GPU": gpus} if gpus else {}), **resources}
    if not ask or any(all(n.get(k, 0) >= v for k, v in ask.items()) for n in nodes):
        return
    missing = [k for k in ask if not any(n.get(k, 0) > 0 for n in nodes)]
    if missing:
        print(
            f"data.preprocess: no node advertises {', '.join(missing)} yet: the preprocessing waits for one that does "
            "(a node of an autoscaling pool), up to data.preprocess.timeout_s",
            flush=True,
        )
        return
    key = "data.preprocess.num_gpus" if "GPU" in ask else f"data.preprocess.resources.{next(iter(resources))}"
    offered = "; ".join(", ".join(f"{k} {n.get(k, 0):g}" for k in ask) for n in nodes)
    asked = ", ".join(f"{k} {v:g}" for k, v in ask.items())
    raise ConfigError(key, f"each preprocessing task asks {asked} on one node, but the nodes have {offered}")


def check_cluster(config: Config, task: Task, splits: dict[str, Any]) -> None:
    """The CPUs for preprocessing, then every node's reach of the data."""
    from raytrain_loops.driver.trainer import hold_in_memory

    check_preprocess_cpus(config, task, splits)
    held = {n for n, s in splits.items() if isinstance(s, ParquetSplit) and hold_in_memory(s, config)}
    check_nodes(config, splits, held)
