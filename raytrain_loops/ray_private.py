"""Every use of a private part of Ray (``ray._private``, a ``_internal`` package, a ``_``-named
attribute), in one place: Ray may move or drop any of them in a release without notice. A public
part that Ray has deprecated is kept here too, so that the same check names it when it goes.

Each part is a :class:`Private` entry naming the public feature it serves and what a user loses
without it, and has one accessor below returning the object, or None where the installed Ray
lacks it. A part with a fallback (the feature goes on as Ray itself behaves) says so once per
process on the ``raytrain_loops.ray_private`` logger, which the driver's console writes to
``ray.log`` and a worker's output reaches through Ray's forwarding; the cluster lint's parts
have none (the lint reports a problem instead). ``tests/ray/test_ray_private_parts.py`` resolves every
entry against the installed Ray and checks that no other module imports a private part of Ray:
it is the first test to run on a newer Ray (the README's paragraph "Ray.").

Imports of Ray are made where an accessor runs, so importing this module imports no Ray.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

LOGGER = "raytrain_loops.ray_private"
_said: set[str] = set()


@dataclass(frozen=True)
class Private:
    """A private part of Ray: ``module``'s ``attr`` (dotted within the module), and ``needs``, the
    names the project uses on it (attributes, or ones its class's ``__init__`` sets)."""

    module: str
    attr: str
    serves: str  # the public feature of this project it serves
    without: str  # what a user loses where it is missing
    needs: tuple[str, ...] = ()
    fallback: bool = True  # False: nothing stands in for it (the caller reports the error)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}" if self.attr else self.module

    def resolve(self) -> tuple[Any, str | None]:
        """(the object, None), or (None, the dotted name of the first part the installed Ray lacks).
        An attribute that a class's ``__init__`` sets resolves to the class."""
        try:
            found: Any = importlib.import_module(self.module)
        except ImportError:
            return None, self.module
        path = self.module
        for part in filter(None, self.attr.split(".")):
            path = f"{path}.{part}"
            if hasattr(found, part):
                found = getattr(found, part)
            elif hasattr(found, "__path__") and importlib.util.find_spec(path) is not None:
                found = importlib.import_module(path)  # a submodule not yet imported
            elif not _set_in_init(found, part):
                return None, path
        lacking = [need for need in self.needs if not (hasattr(found, need) or _set_in_init(found, need))]
        return (None, f"{path}.{lacking[0]}") if lacking else (found, None)

    def missing(self, what: str) -> str:
        """The words for ``what`` (a dotted name) missing from the installed Ray."""
        import ray

        return f"ray {ray.__version__}: {what} is missing (serves {self.serves})"


def _set_in_init(cls: Any, name: str) -> bool:
    """Whether ``cls`` is a class whose ``__init__`` sets (or reads) ``name``: an instance attribute."""
    code = getattr(getattr(cls, "__init__", None), "__code__", None) if isinstance(cls, type) else None
    return code is not None and name in code.co_names


def get(entry: Private) -> Any:
    """``entry``'s object, or None where the installed Ray lacks it (said once per process for a
    part with a fallback, with what the user loses)."""
    found, lacking = entry.resolve()
    if lacking is not None and entry.fallback and entry.name not in _said:
        _said.add(entry.name)
        logging.getLogger(LOGGER).warning("%s; %s", entry.missing(lacking), entry.without)
    return found


class Missing(RuntimeError):
    """A private part of Ray that nothing stands in for is missing from the installed Ray."""


def require(entry: Private) -> Any:
    """``entry``'s object; :class:`Missing`, naming the Ray version and the part, where it is gone."""
    found, lacking = entry.resolve()
    if lacking is not None:
        raise Missing(entry.missing(lacking))
    return found


# ------------------------------------------------------------------ the console, on the driver

AUTOSCALER_EVENTS = Private(
    "ray._private.worker",
    "filter_autoscaler_events",
    serves="the console's ray.log: the autoscaler's events kept from its status lines",
    without="ray.log gets the autoscaler's whole status every few seconds",
)
STDSTREAM_DISPATCHER = Private(
    "ray._private.ray_logging",
    "global_worker_stdstream_dispatcher",
    serves="the console: the workers' forwarded output moved to ray.log (logging.verbose=false)",
    without="the workers' output is printed on the console as Ray prints it",
    needs=("_lock", "handlers", "add_handler", "remove_handler"),
)
RAYLET_PRINTER = Private(
    "ray._private.worker",
    "print_to_stdstream",
    serves="the console: the raylet's messages moved to ray.log, one line for a kill or low memory",
    without="the raylet's messages are printed on the console as Ray prints them",
)


def autoscaler_event_filter() -> Any:
    """Ray's filter of the autoscaler's forwarded lines down to its events, which the console
    applies before writing them to ``ray.log``; None: every line is written."""
    return get(AUTOSCALER_EVENTS)


def stdstream_dispatcher() -> Any:
    """Ray's dispatcher of the workers' forwarded output, whose handler the console replaces to
    move that output to ``ray.log`` (Ray's only public switch, ``log_to_driver``, would lose it
    from ``ray.log`` too); None: Ray prints it on the console."""
    return get(STDSTREAM_DISPATCHER)


def raylet_printer() -> Any:
    """The module whose ``print_to_stdstream`` prints the raylet's messages on the driver; the
    console replaces that function to move them to ``ray.log`` and show a kill or low memory in
    one line; None: Ray prints them."""
    if get(RAYLET_PRINTER) is None:
        return None
    return importlib.import_module(RAYLET_PRINTER.module)


# ------------------------------------------------------------------ Ray Train, driver and workers

DATASETS_CALLBACK = Private(
    "ray.train.v2._internal.callbacks.datasets",
    "DatasetsCallback",
    serves="a run given no Ray Dataset starts no Ray Data actor",
    without="every run starts Ray Train's DatasetManager actor, one more process importing Ray Data",
)
TRAIN_CONTEXT = Private(
    "ray.train.v2._internal.execution.context",
    "get_train_context",
    serves="run.coalesce_reports: a periodic report skipped while this worker's last is in flight",
    without="every periodic report goes out, even while the one before is still uploading or queued",
)
REPORT_INDICES = Private(
    "ray.train.v2._internal.execution.context",
    "TrainContext",
    serves=TRAIN_CONTEXT.serves,
    without=TRAIN_CONTEXT.without,
    needs=("report_call_index", "current_report_index", "get_result_queue"),
)


def datasets_callback() -> Any:
    """Ray Train's callback that starts its Ray Data actor, which the trainer leaves out when no
    split is a Ray Dataset; None: every run keeps it."""
    return get(DATASETS_CALLBACK)


def report_in_flight() -> bool | None:
    """Whether a report of this worker's is not yet taken by Ray Train's controller (uploading,
    waiting for its turn, or in the worker's result queue), which ``run.coalesce_reports`` reads;
    None where the training context cannot tell (outside a Train worker, or another Ray)."""
    get_context = get(TRAIN_CONTEXT)
    if get_context is None or get(REPORT_INDICES) is None:
        return None
    try:
        context = get_context()
        made, queued = context.report_call_index, context.current_report_index
        return made > queued or context.get_result_queue().qsize() > 0
    except (AttributeError, RuntimeError):
        return None


# ------------------------------------------------------------------ Ray Data and the cluster's state

NODE_RESOURCES = Private(
    "ray._private.state",
    "available_resources_per_node",
    serves="data.preprocess.timeout_s's message: each node's free resources beside its totals",
    without="the message gives each node's totals with 0 free",
)
DATASET_EXECUTOR = Private(
    "ray.data.dataset",
    "Dataset._current_executor",
    serves="a preprocessing execution ended early (a stop, an error, its epoch cut) cancels its tasks",
    without="its Ray Data tasks run on to their end, holding their CPUs and object store",
)


DATA_PLACEMENT = Private(
    "ray.data.context",
    "DataContext",
    serves="preprocessing tasks placed on their worker's node first, where its blocks are read, not fetched",
    without="Ray Data places the preprocessing tasks itself; a worker's blocks may come from other nodes",
    # Public, but deprecated by Ray 2.60 (to be removed after January 2027): kept here so that the
    # check of a newer Ray names it when it goes.
    needs=("scheduling_strategy", "scheduling_strategy_large_args"),
)


def place_first_on(ctx: Any, strategy: Any) -> None:
    """Ray Data's tasks under ``ctx`` placed by ``strategy`` first (a soft node affinity), where the
    installed Ray still reads ``DataContext.scheduling_strategy``."""
    if get(DATA_PLACEMENT) is not None:
        ctx.scheduling_strategy = ctx.scheduling_strategy_large_args = strategy


def available_resources_per_node() -> Any:
    """Ray's reading of each node's available resources (a function of no argument, node id ->
    resource -> amount); None: the totals only."""
    return get(NODE_RESOURCES)


def current_executor(dataset: Any) -> Any:
    """The executor of ``dataset``'s running execution, which the preprocessing feed shuts down to
    cancel its tasks; None before it starts, or where Ray Data keeps it elsewhere."""
    return getattr(dataset, "_current_executor", None) if get(DATASET_EXECUTOR) is not None else None


# ------------------------------------------------------------------ the cluster lint (no fallback)
# Each accessor raises Missing where the installed Ray lacks its part: the lint reports it.

_LINT = "raytrain-loops check-clusters: a launcher YAML judged as `ray up` fills it in"
_LINT_LOST = "the lint cannot judge the file and reports this as its problem"
PREPARE_CONFIG = Private("ray.autoscaler._private.util", "prepare_config", _LINT, _LINT_LOST, fallback=False)
VALIDATE_CONFIG = Private("ray.autoscaler._private.util", "validate_config", _LINT, _LINT_LOST, fallback=False)
AWS_INTERFACES = Private(
    "ray.autoscaler._private.aws.config", "_configure_from_network_interfaces", _LINT, _LINT_LOST, fallback=False
)
AWS_INBOUND_RULES = Private(
    "ray.autoscaler._private.aws.config", "_create_default_inbound_rules", _LINT, _LINT_LOST, fallback=False
)
GCP_SUBNET = Private("ray.autoscaler._private.gcp.config", "_configure_subnet", _LINT, _LINT_LOST, fallback=False)


def prepare_config() -> Any:
    """Ray's ``prepare_config``: a launcher YAML with every key it leaves out filled in from the
    provider's defaults, as ``ray up`` runs it."""
    return require(PREPARE_CONFIG)


def validate_config() -> Any:
    """Ray's ``validate_config``: what ``ray up`` refuses in a prepared launcher YAML."""
    return require(VALIDATE_CONFIG)


def aws_network_interfaces() -> Any:
    """The offline step of Ray's AWS bootstrap that settles each node type's network interfaces
    and security groups from the file."""
    return require(AWS_INTERFACES)


def aws_default_inbound_rules() -> Any:
    """The inbound rules Ray's AWS bootstrap gives a security group it creates."""
    return require(AWS_INBOUND_RULES)


def gcp_configure_subnet() -> Any:
    """The step of Ray's GCP bootstrap that gives a node type without network interfaces Ray's
    default one (an external IP among them)."""
    return require(GCP_SUBNET)


ENTRIES = (
    AUTOSCALER_EVENTS,
    STDSTREAM_DISPATCHER,
    RAYLET_PRINTER,
    DATASETS_CALLBACK,
    TRAIN_CONTEXT,
    REPORT_INDICES,
    NODE_RESOURCES,
    DATASET_EXECUTOR,
    DATA_PLACEMENT,
    PREPARE_CONFIG,
    VALIDATE_CONFIG,
    AWS_INTERFACES,
    AWS_INBOUND_RULES,
    GCP_SUBNET,
)
