"""The driver's checks before Ray starts; runs on the driver. The task built and prepared, its
splits and every Parquet file and column checked, a train split's batch sampler built and read as
rank 0's, the run's length planned, the run's name, and the warning for a bf16 this CPU emulates:
what fails here fails in seconds, naming the key, file or column, before anything is started.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
from pathlib import Path
from typing import Any

from raytrain_loops import storage
from raytrain_loops.config import Config, ConfigError, to_dict
from raytrain_loops.driver.run_checks import flatten, meta_model
from raytrain_loops.engine.length import batches_per_epoch, total_steps
from raytrain_loops.engine.update.micro import SplitError, batch_rows
from raytrain_loops.errors import DataError
from raytrain_loops.runtime.batches import first_batch
from raytrain_loops.tasks import DatasetSplit, MapSplit, ParquetSplit, Task, build_task, has_preprocess

# Keys that say where and how a run executes, not what it computes: left out of a hashed run
# name. Scaling (the same recipe is the same run locally and on any number of workers), Ray's
# retries (local mode allows none), where the run directory is, how the run is shown and where
# it is tracked.
UNHASHED = ("scaling", "run.name", "run.storage_path", "run.progress", "run.allow_config_change")
UNHASHED += ("run.max_failures", "run.max_preemptions", "logging.verbose", "logging.mlflow")
UNHASHED += ("accum.micro_batch",)  # how the rows are cut into micro-batches, not the update


def _defaults(config: Config) -> dict[str, Any]:
    """The config every key of ``config`` has at its default, section by section (each section
    its own class's defaults: a section with a key a release added has it at its default)."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(type(value)())
        else:
            out[f.name] = to_dict(f.default_factory() if f.default is dataclasses.MISSING else f.default)
    return out


def hashed_values(config: Config) -> dict[str, Any]:
    """What a hashed run name is a hash of: every dotted key whose value differs from its default
    (a key removed from a default mapping as ``<absent>``), but those of :data:`UNHASHED`. A key
    at its default is left out, so a release that adds a key (at a default that keeps the old
    behaviour) renames no run."""
    values, defaults = flatten(config.to_dict()), flatten(_defaults(config))
    keys = sorted(set(values) | set(defaults))
    kept = [k for k in keys if not any(k == u or k.startswith(u + ".") for u in UNHASHED)]
    return {k: values.get(k, "<absent>") for k in kept if values.get(k, "<absent>") != defaults.get(k, "<absent>")}


def run_name(config: Config, task: Task) -> str:
    """The run's name: ``run.name``, or the task's class name and a hash of the values that shape
    the result and differ from their defaults (:func:`hashed_values`), so the same command maps
    to the same run directory. The run's length is part of the hash: a longer run of the same
    recipe is a new directory (with ``run.name``, the same directory, continued). Scaling and Ray's
    retries are not: the same recipe is the same run locally and on any number of workers."""
    if config.run.name:
        return config.run.name
    text = json.dumps(hashed_values(config), sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    base = type(task).__name__.removesuffix("Task").lower() or "task"
    return f"{base}-{digest}"


def check_parquet(split_name: str, split: ParquetSplit) -> int:
    """Check that the Parquet data exists and has the task's columns, and index its row groups
    into ``split.index`` (:func:`~raytrain_loops.data.parquet.index_split`); return its row count."""
    import pyarrow.dataset as pads

    from raytrain_loops.data.parquet import ROW_SEED, index_split

    path = split.path if storage.is_uri(split.path) else os.path.abspath(os.path.expanduser(split.path))
    split.path = path  # workers run in another directory
    if not storage.is_uri(path) and not os.path.exists(path):
        raise DataError(f"split '{split_name}': no such Parquet file or directory: {path}")
    try:
        ds = pads.dataset(path, format="parquet")
    except Exception as err:
        raise DataError(f"split '{split_name}': cannot read Parquet at {path}: {err}") from None
    if not ds.files:
        raise DataError(f"split '{split_name}': no Parquet files under {path}")
    names = set(ds.schema.names)
    missing = [c for c in split.columns if c not in names]
    if missing:
        raise DataError(
            f"split '{split_name}': column '{missing[0]}' not found in {ds.files[0]} (columns there: {', '.join(sorted(names))})"
        )
    if ROW_SEED in split.columns:
        raise DataError(f"split '{split_name}': column '{ROW_SEED}' is the name preprocess's row seeds take; rename it")
    try:
        split.index = index_split(path, split.columns, ds)
    except Exception as err:
        raise DataError(f"split '{split_name}': cannot read the Parquet footers under {path}: {err}") from None
    return split.index.rows


def check_blocks(config: Config, task: Task) -> None:
    """``compile`` and ``checkpointing`` act on the task's blocks: a task that names none is
    refused here, naming the key, rather than on every worker. The model is built on the meta
    device (no memory, no initialisation); a model that cannot be is left to the workers' check."""
    per_block = config.compile.enabled and config.compile.scope == "blocks"
    wanted = "compile.enabled" if per_block else "checkpointing" if config.checkpointing != "none" else ""
    model = meta_model(task) if wanted else None
    if model is None:  # nothing to check, or a model built from data or files: the workers check it
        return
    try:
        blocks = task.blocks(model)
    except Exception:
        return
    if not blocks:
        raise ConfigError(
            wanted,
            f"acts on the task's blocks, and task {config.task.name!r} names none: override Task.blocks(model) "
            "to return the model's repeated parts (Transformer blocks)",
        )


class _Text(str):
    """An annotation shown as written (``inspect`` shows a string annotation quoted)."""

    def __repr__(self) -> str:
        return str(self)


def _shown(name: str, sig: inspect.Signature) -> str:
    """``name(self, batch: dict[str, np.ndarray], train: bool) -> ...``, annotations unquoted."""

    def plain(a: Any) -> Any:
        return a if a is inspect.Parameter.empty else _Text(a if isinstance(a, str) else inspect.formatannotation(a))

    params = [p.replace(annotation=plain(p.annotation)) for p in sig.parameters.values()]
    return name + str(sig.replace(parameters=params, return_annotation=plain(sig.return_annotation)))


def _overrides(task: Task, name: str) -> bool:
    return inspect.getattr_static(task, name) is not inspect.getattr_static(Task, name)


def _calls(task: Task, name: str, base: inspect.Signature) -> list[tuple[int, tuple[str, ...]]]:
    """How the workers call ``Task.<name>``: (positional arguments, keyword arguments) of each
    call form: the required parameters in order; ``preprocess(batch, train=...)``; and
    ``evaluate(model, batch, metrics=...)`` for a task with :meth:`~Task.eval_metrics`."""
    required = [p.name for p in list(base.parameters.values())[1:] if p.default is inspect.Parameter.empty]
    calls = [(len(required), ())]
    if name == "preprocess":
        calls.append((len(required) - 1, ("train",)))
    if name == "evaluate" and _overrides(task, "eval_metrics"):
        calls.append((len(required), ("metrics",)))
    return calls


def _override(task: Task, name: str) -> tuple[Any, int]:
    """The function overriding ``Task.<name>`` on ``task`` and how many leading arguments its
    binding supplies (``self`` or ``cls``: 1; a static method or a callable attribute: 0)."""
    raw = inspect.getattr_static(task, name)
    if isinstance(raw, staticmethod):
        return raw.__func__, 0
    if isinstance(raw, classmethod):
        return raw.__func__, 1
    if inspect.isfunction(raw) and name not in getattr(task, "__dict__", {}):
        return raw, 1
    return raw, 0


def check_task_methods(task_name: str, task: Task) -> None:
    """Check each :class:`Task` method that ``task`` overrides against the ``Task`` signature: it
    must take every call the workers make (a ``preprocess(self, batch)`` would fail inside a Ray
    Data task, pages of traceback later). Raises :class:`ConfigError` naming ``task.name``, the
    method and the signature expected."""
    for name, base_fn in vars(Task).items():
        if name.startswith("_") or not inspect.isfunction(base_fn) or not _overrides(task, name):
            continue
        fn, lead = _override(task, name)
        where = f"{task_name!r}: {type(task).__name__}.{name}"
        if not callable(fn):
            raise ConfigError("task.name", f"{where} is {type(fn).__name__}, not a method like Task.{name}")
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # a callable whose signature Python cannot read
            continue
        base = inspect.signature(base_fn)
        for positional, keywords in _calls(task, name, base):
            try:
                sig.bind(*[None] * (lead + positional), **dict.fromkeys(keywords))
            except TypeError:
                raise ConfigError(
                    "task.name",
                    f"{where}{_shown('', sig)} cannot take the call Task.{name} receives; expected {_shown(name, base)}",
                ) from None


def data_location(data_dir: str) -> tuple[Path, Path | storage.StorePath]:
    """Where tasks prepare ``data.dir`` and where their splits name it: a local directory twice
    (resolved: workers run in another directory), or, for a URI, the local staging directory
    kept for it (:func:`~raytrain_loops.data.staging.staging_dir`) and the URI. A URI pyarrow
    cannot open is refused, naming the key."""
    try:
        data_dir = storage.local_path(data_dir)
    except ValueError as err:
        raise ConfigError("data.dir", str(err)) from None
    if not storage.is_uri(data_dir):
        local = Path(data_dir).expanduser().resolve()
        return local, local
    import pyarrow.fs as pafs

    from raytrain_loops.data.staging import staging_dir

    try:
        pafs.FileSystem.from_uri(data_dir)
    except Exception as err:  # an unknown scheme, a malformed URI
        raise ConfigError("data.dir", f"{data_dir!r} is not a URI pyarrow can open: {err}") from None
    return staging_dir(data_dir), storage.StorePath(data_dir)


def upload_staged(staged: Path, data_dir: str) -> None:
    """Upload what the task prepared in ``staged`` to the URI ``data_dir`` (what is missing or
    differs there); an unreachable or failing store is refused naming ``data.dir``."""
    from raytrain_loops.data.staging import UploadError, upload_missing

    try:
        upload_missing(staged, data_dir)
    except UploadError as err:
        raise DataError(f"data.dir={data_dir}: cannot upload the prepared data from {staged}: {err}") from None


def prepare(config: Config, task: Task | None) -> tuple[Task, dict[str, Any], dict[str, int]]:
    """Build the task and check its data on the driver, before any Ray work starts."""
    task = task or build_task(config.task.name, config.task.params)
    check_task_methods(config.task.name, task)
    check_blocks(config, task)
    staged, data_dir = data_location(config.data.dir)
    task.prepare(staged)
    if staged != data_dir:
        upload_staged(staged, data_dir)
    splits = task.splits(data_dir)
    if "train" not in splits:
        raise DataError(f"task {config.task.name!r} has no 'train' split (it has: {', '.join(splits) or 'none'})")
    rows = {}
    for name, split in splits.items():
        if isinstance(split, ParquetSplit):
            rows[name] = check_parquet(name, split)
        elif isinstance(split, MapSplit):
            rows[name] = map_rows(name, split)
        elif isinstance(split, DatasetSplit) or _is_dataset(split):
            split = splits[name] = split if isinstance(split, DatasetSplit) else DatasetSplit(split)
            rows[name] = dataset_rows(config, task, name, split)
        else:
            refused = unaccepted(f"split '{name}'", split)
            raise DataError(refused or f"split '{name}': expected ParquetSplit, MapSplit, or a ray.data.Dataset (bare or in DatasetSplit), got {type(split).__name__}")
        if rows[name] == 0:
            raise DataError(f"split '{name}' holds no rows")
        if name != "train" and getattr(split, "batch_sampler", None) is not None:
            raise DataError(f"task {config.task.name!r}, split '{name}': only the train split takes a batch_sampler")
    if getattr(splits["train"], "batch_sampler", None) is not None:
        if config.accum.micro_batch == "auto":
            raise ConfigError(
                "accum.micro_batch",
                f"task {config.task.name!r}'s train split has its own batch sampler, whose batches it sizes and "
                "groups itself: auto would split them into other micro-batches; set accum.micro_batch=fixed",
            )
        check_batch_sampler(config, splits["train"], rows["train"])
    elif rows["train"] // config.scaling.workers < config.data.batch_size:
        raise ConfigError(
            "data.batch_size",
            f"{config.data.batch_size} is more than the {rows['train'] // config.scaling.workers} training rows per worker",
        )
    planned_steps(config, splits, rows)  # an epoch too short for one update fails here, not on the workers
    if config.accum.micro_batch == "auto":
        check_splittable(config, task, splits, rows)
    return task, splits, rows


INDEXED = (
    "the engine shuffles, shards and batches the rows itself, and resumes an epoch exactly where it "
    "stopped by reading rows by their index"
)
ACCEPTED = "(the inputs a split accepts: docs/your-task.md, 'Data')"


def unaccepted(subject: str, data: Any) -> str | None:
    """The refusal of ``data``, a split or a MapSplit's dataset (``subject`` names which), that is a
    DataLoader or an iterable dataset, saying what to pass instead; None for anything else."""
    from torch.utils.data import DataLoader, IterableDataset

    if isinstance(data, DataLoader):
        return (
            f"{subject} is a DataLoader, which a split cannot be: {INDEXED}. Pass the loader's "
            "dataset and collate_fn in a MapSplit: MapSplit(loader.dataset, collate_fn=loader.collate_fn) "
            f"(a batch sampler of its own: MapSplit(..., batch_sampler=...)) {ACCEPTED}"
        )
    if isinstance(data, IterableDataset):
        return (
            f"{subject} is an iterable dataset ({type(data).__name__}), which a split cannot be: {INDEXED}, which an "
            "iterable cannot do. Pass indexable data (a Dataset with __len__ and __getitem__, in a MapSplit), "
            "or write its rows to Parquet once in Task.prepare (e.g. pyarrow.parquet.write_table("
            f"pyarrow.Table.from_pylist(list(iterable)), path)) and return ParquetSplit(path, columns) {ACCEPTED}"
        )
    return None


def _is_dataset(split: Any) -> bool:
    return type(split).__module__.startswith("ray.data") and type(split).__name__ == "Dataset"


def dataset_rows(config: Config, task: Task, name: str, split: DatasetSplit) -> int:
    """The rows of a split that is a Ray Dataset: ``split.rows``, or ``count()``, which executes
    the dataset's plan once here. Refused, naming the split: anything but a Dataset, a task whose
    ``preprocess`` would not be applied to it, and an elastic group (its shards are Ray Train's
    ``streaming_split``, whose epochs a group of another size cannot continue)."""
    where = f"split '{name}'"
    if not _is_dataset(split.dataset):
        raise DataError(f"{where}: DatasetSplit's dataset is {type(split.dataset).__name__}, not a ray.data.Dataset")
    if has_preprocess(task):
        raise DataError(
            f"{where} is a Ray Dataset, to which {type(task).__name__}.preprocess is not applied: its own "
            "map_batches are its preprocessing (docs/data.md, 'A Ray Dataset as a split')"
        )
    if 1 <= config.scaling.min_workers < config.scaling.num_workers:
        raise ConfigError(
            "scaling.min_workers",
            f"{where} is a Ray Dataset, split among a group of a fixed size: an elastic group is not supported "
            "with it; set scaling.min_workers=0 or use a ParquetSplit",
        )
    if split.rows is not None:
        return split.rows
    try:
        return split.dataset.count()
    except Exception as err:  # the user's plan failed: say which split's
        raise DataError(f"{where}: counting the Ray Dataset's rows failed: {type(err).__name__}: {err}") from err


def map_rows(name: str, split: MapSplit) -> int:
    """The rows of a map-style split; refused, saying what to pass instead, when its dataset is
    not indexable (a DataLoader, an iterable)."""
    data = split.dataset
    subject = f"split '{name}': MapSplit's dataset"
    refused = unaccepted(subject, data)
    if refused is None and not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        refused = f"{subject} ({type(data).__name__}) has no __len__ and __getitem__: a MapSplit reads rows by index {ACCEPTED}"
    if refused:
        raise DataError(refused)
    return len(data)


def check_splittable(config: Config, task: Task, splits: dict[str, Any], rows: dict[str, int]) -> None:
    """``accum.micro_batch=auto`` cuts every batch along its rows (``Task.split_batch``): the
    run's first training batch, read and collated here, is cut in two, so that a task whose
    batches cannot be cut is refused before any worker starts, not at the first update on Ray."""
    batch, _ = first_batch(task, config, splits, rows)
    try:
        batch_rows(batch, numbers=True)
        task.split_batch(batch, 2)
    except SplitError as err:
        raise ConfigError(
            "accum.micro_batch",
            f"auto cuts each batch along its rows, and the first training batch of task {config.task.name!r} "
            f"cannot be cut: {err}",
        ) from None


def _rank0_sampler(config: Config, split: MapSplit) -> tuple[Any, int]:
    """Rank 0's batch sampler of the train split with all ``scaling.num_workers`` workers, and its
    ``len`` (the same on every rank, by the sampler's contract). Raises :class:`DataError` naming
    the task and split when the task's sampler fails or gives no batch."""
    where = f"task {config.task.name!r}, split 'train'"
    try:
        sampler = split.batch_sampler(config.data.batch_size, 0, config.scaling.workers, config.loop.seed)
        batches = len(sampler)
    except Exception as err:  # the task's own code: say whose sampler failed
        raise DataError(f"{where}: batch_sampler: {err}") from err
    if batches < 1:
        raise DataError(
            f"{where}: the batch sampler gives no batch per worker with data.batch_size={config.data.batch_size} "
            f"and {config.scaling.workers} workers"
        )
    return sampler, batches


def check_batch_sampler(config: Config, split: MapSplit, rows: int) -> None:
    """Build the train split's batch sampler as rank 0 does and read its first epoch, so a
    sampler that fails or names rows the dataset lacks stops the run before Ray starts."""
    sampler, _ = _rank0_sampler(config, split)
    sampler.set_epoch(0)
    outside = [i for batch in sampler for i in batch if not 0 <= i < rows]
    if outside:
        raise DataError(
            f"task {config.task.name!r}, split 'train': the batch sampler names row {outside[0]}, "
            f"but the dataset holds {rows} rows"
        )


def planned_steps(config: Config, splits: dict[str, Any], rows: dict[str, int]) -> int:
    """The run's length in optimizer steps with all ``scaling.num_workers`` workers, as the loop
    will count it on every worker."""
    train = splits["train"]
    if getattr(train, "batch_sampler", None) is not None:
        per_worker = _rank0_sampler(config, train)[1]
    else:
        per_worker = batches_per_epoch(
            rows["train"], config.scaling.workers, config.data.batch_size, padded=isinstance(train, MapSplit)
        )
    return total_steps(config.loop, config.accum, per_worker)


def warn_emulated_bf16(config: Config) -> bool:
    """Before a local Ray starts (its workers run on this CPU), warn once of an explicit
    ``precision.dtype=bf16`` that this CPU emulates; whether it warned. Joined to a cluster, the
    workers' rank 0 warns instead: this machine's CPU is not theirs."""
    if config.precision.dtype != "bf16" or config.scaling.use_gpu or os.environ.get("RAY_ADDRESS"):
        return False
    import sys

    import torch

    from raytrain_loops.engine.update import precision

    hw = precision.hardware(torch.device("cpu"))
    if hw.native_bf16:
        return False
    print(precision.emulated_warning(hw), file=sys.stderr, flush=True)
    return True
