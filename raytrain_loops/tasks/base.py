"""What a recipe plugs in: a model, a criterion, data, and an evaluation.

A user's own model needs no change to the library: subclass :class:`Task` and either pass an
instance to ``raytrain_loops.fit(config, task=...)`` or name it in a recipe as
``task.name: package.module:MyTask`` (its ``task.params`` become keyword arguments).
"""

from __future__ import annotations

import importlib
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from raytrain_loops.config import ConfigError
from raytrain_loops.engine import LossOutput, StepContext
from raytrain_loops.engine.update.micro import split_batch
from raytrain_loops.storage import StorePath


@dataclass
class ParquetSplit:
    """A split stored as Parquet: a file, a directory or a URI pyarrow understands, and the
    columns the task reads (checked before training starts)."""

    path: str
    columns: list[str]
    index: Any = None
    """Its :class:`~raytrain_loops.data.parquet.SplitIndex`, set on the driver before training."""


@dataclass
class MapSplit:
    """A split as a map-style ``torch.utils.data.Dataset`` (read through a DataLoader).

    ``batch_sampler`` (train split only): a factory called once per worker as
    ``batch_sampler(batch_size, rank, world, seed)``, returning an object with ``set_epoch(epoch)``,
    ``__iter__`` (this worker's batches of row indices in the epoch set) and ``__len__`` (this
    worker's batches per epoch, the same on every rank); for example
    ``functools.partial(GroupedBatchSampler, groups)``. ``None``: a ``DistributedSampler``
    shuffled by ``loop.seed`` and the epoch, cut into batches of ``data.batch_size``.
    """

    dataset: Any
    collate_fn: Any = None
    batch_sampler: Callable[[int, int, int, int], Any] | None = None


@dataclass
class DatasetSplit:
    """A split as the user's own ``ray.data.Dataset`` (a bare Dataset returned by
    :meth:`Task.splits` is wrapped in one). Trained as Ray Train trains one: the trainer gets it in
    ``datasets=``, each worker reads its shard (``ray.train.get_dataset_shard``, a
    ``streaming_split`` of every epoch) in batches of ``data.batch_size`` and passes them to
    :meth:`Task.collate`. The dataset's own ``map_batches`` are its preprocessing:
    :meth:`Task.preprocess` is not applied to it. ``rows``: its row count, when known, which skips
    the driver's ``count()`` (that executes the dataset's plan once). A resumed epoch starts over
    from the dataset's first rows (docs/data.md, "A Ray Dataset as a split")."""

    dataset: Any
    rows: int | None = None


EvalOutput = dict[str, tuple[torch.Tensor | float, float]]
"""Per evaluation batch: metric name -> (mean over the batch, number of samples)."""


class Task:
    """Base class of tasks. Override what your task needs; everything runs on the workers except
    :meth:`prepare`, which runs once on the driver before training starts."""

    def __init__(self, **params: Any):
        if params:
            raise TypeError(f"{type(self).__name__} takes no task.params; got {sorted(params)}")

    def prepare(self, data_dir: Path) -> None:
        """Write or check data on the driver (idempotent). ``data_dir`` is always a local cache
        directory: ``data.dir`` itself, or, when ``data.dir`` is a URI (``s3://...``), a staging
        directory kept on the driver for that URI, whose files are then uploaded to it (only
        those the store lacks or holds in another version)."""

    def splits(self, data_dir: Path | StorePath) -> dict[str, ParquetSplit | MapSplit]:
        """The data: a ``train`` split and optionally an ``eval`` split, named under ``data_dir``:
        the local ``data.dir``, or a URI ``data.dir`` as a :class:`~raytrain_loops.storage.StorePath`
        (it joins like a ``Path``: ``str(data_dir / "train.parquet")`` is the object's URI). Called
        on the driver; the splits travel to every worker, which reads their paths itself (a
        streamed Parquet split, a map-style dataset that reads files), so on a cluster whose nodes
        share no disk they must name the store, never a path on the driver's disk."""
        raise NotImplementedError

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def preprocess(self, batch: dict[str, np.ndarray], train: bool) -> dict[str, np.ndarray]:
        """Per-row work on Parquet rows before they reach the worker (decode, augment, tokenize):
        runs on Ray Data on the cluster's CPUs (``data.preprocess``), not on the training
        worker; ``train``: a batch of the train split (augment) or of the eval split (do not).
        Column name -> NumPy array in, the same out, **one row out per row in** (positions and the
        run's length count input rows). ``batch["_row_seed"]``
        (:data:`~raytrain_loops.data.parquet.ROW_SEED`) holds each row's seed (``uint64``), the
        same for the same row in the same epoch whatever the group size or a resume: draw random
        augmentation from ``np.random.default_rng(seed)`` per row. Not overridden: rows go
        straight from pyarrow to :meth:`collate` and nothing is paid for it."""
        return batch

    def actor_setup(self) -> None:
        """Build, once per preprocessing process, the state :meth:`preprocess` reads (a tokenizer, a
        model), kept on ``self``. A task that overrides it preprocesses in a pool of Ray actors
        (``data.preprocess.actors``), each calling it once before its first batch; a local run calls
        it once in its own process. Not overridden: preprocessing runs in Ray tasks."""

    def collate(self, batch: dict[str, np.ndarray]) -> Any:
        """Turn a Parquet batch (column name -> NumPy array) into what the criterion takes. It runs
        on a thread of its own, ahead of the loop (``data.prefetch_batches``): draw no random
        numbers here (the loop's own draws would interleave with them); a row's randomness comes
        from its seed, in :meth:`preprocess`."""
        return {k: torch.as_tensor(v) for k, v in batch.items()}

    def criterion(self, model: nn.Module, batch: Any, ctx: StepContext) -> LossOutput:
        raise NotImplementedError

    def evaluate(self, model: nn.Module, batch: Any, metrics: dict[str, Any] | None = None) -> EvalOutput:
        """Metrics of one evaluation batch as (mean, count) pairs; they are averaged over all
        batches and workers weighted by count. Runs under ``torch.no_grad`` and autocast.
        ``metrics``: this evaluation's :meth:`eval_metrics`, when the task declares any."""
        return {}

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]] | None:
        """Parameter groups for ``optim.param_groups=task`` (the first is the regularised one)."""
        return None

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The model's repeated parts (Transformer blocks), each of them a unit of its own for
        ``scaling.strategy=fsdp`` (sharded and gathered one at a time), ``compile`` (compiled
        regionally) and ``checkpointing``. Empty: the whole model is one unit (FSDP shards only
        the root; compile and checkpointing then have nothing to act on)."""
        return []

    count_keys: tuple[str, ...] = ()
    """The names of :meth:`counts`; empty: the task counts nothing and the step runs no extra
    all-reduce."""

    def counts(self, batch: Any) -> dict[str, float]:
        """Counts of one training micro-batch (e.g. ``{"boxes": 7}``), one per name of
        ``count_keys``. The engine sums them over the update's micro-batches and all workers
        (one all-reduce before the forward passes) and hands the totals to the criterion as
        ``ctx.totals``: global normalisers without a collective in the criterion."""
        return {}

    def split_batch(self, batch: Any, parts: int) -> list[Any]:
        """A collated training batch cut along its rows into ``parts`` micro-batches
        (``accum.micro_batch=auto``). The default cuts tensors along their first dimension and
        lists item by item, through tuples and dicts; a task whose batches carry values that
        follow from the rows (a token count) gives its own, or carries them per row (``hf_lm``'s
        lists of tokens and bytes per row). The driver tries it on the run's first batch before any
        worker starts, and refuses ``auto`` for a batch it cannot cut."""
        return split_batch(batch, parts)

    def after_step(self, model: nn.Module, stats: dict[str, torch.Tensor]) -> None:
        """Called after every applied update with the criterion's ``LossOutput.stats`` summed
        over the update's micro-batches and all workers (inside the step's own all-reduce)."""

    def eval_metrics(self) -> dict[str, Any]:
        """Split-level evaluation metrics: fresh ``torchmetrics.Metric`` objects for one
        evaluation of one model. When there are any, :meth:`evaluate` receives them as the
        keyword ``metrics`` and updates them batch by batch; after the split each is computed
        over all workers' batches (a dict result adds its keys, a scalar its name)."""
        return {}

    # ---- what the run pins, and what travels to preprocessing (driver/run_checks.py, worker/preprocessing.py)

    def artefacts(self) -> dict[str, bytes]:
        """Files the model's weights depend on beyond the config (a tokenizer, a model's
        configuration), by name (``tokenizer/tokenizer.json``), after :meth:`prepare`. They are
        copied into the run directory (``artefacts/<name>``) at the run's first start; a resume
        whose files differ is refused, naming them, unless ``run.allow_config_change``."""
        return {}

    def data_digest(self) -> str | None:
        """A digest of the prepared data the run trains on (after :meth:`prepare`), pinned and
        checked at every rerun as :meth:`artefacts` are; None: not checked. Not overridden: each
        split's identity (a Parquet split's files, sizes and row counts; a map-style split's
        dataset type and length), so that a rerun on changed data is refused naming the split."""
        return None

    def preprocessing_copy(self) -> Task:
        """The task shipped to every preprocessing task (:meth:`preprocess`): itself, or a
        copy without what only the training workers need (model weights) or only the driver
        reads (its source paths)."""
        return self


def has_preprocess(task: Task) -> bool:
    """Whether ``task`` overrides :meth:`Task.preprocess`."""
    return type(task).preprocess is not Task.preprocess


def has_actor_setup(task: Task) -> bool:
    """Whether ``task`` overrides :meth:`Task.actor_setup` (its preprocessing then runs in actors)."""
    return getattr(type(task), "actor_setup", Task.actor_setup) is not Task.actor_setup


_SET_UP: set[int] = set()
"""The ids of the task instances in this process whose :meth:`Task.actor_setup` ran (not an attribute
of the task: a copy sent to another process must set itself up there)."""


def set_up_once(task: Task) -> None:
    """:meth:`Task.actor_setup` of this instance, the first time only."""
    if has_actor_setup(task) and id(task) not in _SET_UP:
        task.actor_setup()
        _SET_UP.add(id(task))
        weakref.finalize(task, _SET_UP.discard, id(task))


def params_at_least(*checks: tuple[str, float, float]) -> None:
    """Raise ConfigError naming ``task.params.<key>`` for the first ``(key, value, minimum)``
    whose value is below its minimum."""
    for key, value, low in checks:
        if value < low:
            raise ConfigError(f"task.params.{key}", f"must be >= {low}; got {value}")


BUILTIN_PATHS = {
    "digits": ("raytrain_loops.tasks.digits", "DigitsTask"),
    "cvnets": ("raytrain_loops.tasks.cvnets", "CvnetsTask"),
    "dino": ("raytrain_loops.tasks.dino", "DinoTask"),
    "detr": ("raytrain_loops.tasks.detr", "DetrTask"),
    "lm": ("raytrain_loops.tasks.lm", "LMTask"),
    "seamseg": ("raytrain_loops.tasks.converted.seamseg_coco", "build_seamseg"),
    "images": ("raytrain_loops.tasks.images", "ImagesTask"),
    "hf_lm": ("raytrain_loops.tasks.hf_lm", "HFLMTask"),
}
"""name -> (module, class or function) of the built-in tasks, imported when first named."""

BUILTIN_CLASSES = {
    **{cls: module for module, cls in BUILTIN_PATHS.values() if cls[0].isupper()},
    "SeamsegTask": "raytrain_loops.tasks.seamseg",
}
"""The built-in task classes by name -> their module (``from raytrain_loops.tasks import DetrTask``)."""


def builtin(name: str) -> Any:
    """The built-in task called ``name`` (a key of :data:`BUILTIN_PATHS`), imported now: its class,
    or the function that builds it."""
    module, attr = BUILTIN_PATHS[name]
    return getattr(importlib.import_module(module), attr)


def _describe(obj: Any) -> str:
    if isinstance(obj, type):
        return f"class {obj.__module__}.{obj.__qualname__}"
    return type(obj).__name__


def _check_factory(name: str, factory: Any) -> None:
    """Refuse, without calling it, anything but a Task subclass or a function annotated to return one.

    A recipe can name any importable callable; calling first and checking the result after would
    let ``task.name: os:system`` run a shell command before any error is raised.
    """
    if isinstance(factory, type):
        if issubclass(factory, Task):
            return
        raise ConfigError("task.name", f"{name!r} is {_describe(factory)}, not a subclass of raytrain_loops Task")
    if not inspect.isfunction(factory):
        raise ConfigError(
            "task.name", f"{name!r} is a {_describe(factory)}, not a Task subclass or a function returning one"
        )
    try:
        returns = inspect.signature(factory, eval_str=True).return_annotation
    except Exception as err:  # an annotation naming something its module cannot resolve
        raise ConfigError("task.name", f"{name!r}: cannot read its return annotation ({err})") from None
    if not (isinstance(returns, type) and issubclass(returns, Task)):
        found = "none" if returns is inspect.Signature.empty else f"-> {returns!r}"
        raise ConfigError(
            "task.name", f"{name!r} is a function without a Task return annotation (it has {found}); it was not called"
        )


def _resolve(name: str) -> Any:
    if name in BUILTIN_PATHS:
        return builtin(name)
    if ":" not in name:
        raise ConfigError(
            "task.name", f"{name!r}: not a built-in task ({', '.join(sorted(BUILTIN_PATHS))}) nor 'module:callable'"
        )
    module_name, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except ImportError as err:
        top = module_name.split(".")[0]
        raise ConfigError(
            "task.name",
            f"{name!r}: cannot import it ({err}). Python looks for {top!r} on its path: run the command from the "
            f"directory that holds {top}.py (or the {top}/ package), add that directory to PYTHONPATH, or pip "
            "install it; on a cluster, submit it with `raytrain-loops submit --working-dir DIR`",
        ) from None
    except AttributeError as err:
        raise ConfigError("task.name", f"{name!r}: cannot import it ({err})") from None
    _check_factory(name, factory)
    return factory


def build_task(name: str, params: dict[str, Any]) -> Task:
    """A built-in task by name, or ``package.module:callable`` called with ``params``.

    The callable must be a :class:`Task` subclass or a function whose return annotation is one;
    anything else is refused before it is called. Importing the module runs its code, so a recipe
    is trusted input, like a Python file.
    """
    factory = _resolve(name)
    try:
        task = factory(**params)
    except TypeError as err:
        raise ConfigError("task.params", f"for {name!r}: {err}") from None
    if not isinstance(task, Task):
        raise ConfigError("task.name", f"{name!r} returned {type(task).__name__}, not a raytrain_loops Task")
    return task
