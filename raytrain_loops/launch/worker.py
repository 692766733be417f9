"""The per-worker loop that Ray Train runs: task, model, engine, data, evaluation, reports and
checkpoints. All training math lives in :mod:`raytrain_loops.engine`."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch

from raytrain_loops.config import Config
from raytrain_loops.engine import Engine, to_device
from raytrain_loops.engine import checkpoint as ckpt_files
from raytrain_loops.engine.guards import SpikeDetector, TrainingError
from raytrain_loops.engine.loop import accum_steps, timed_groups
from raytrain_loops.engine.meters import Meters
from raytrain_loops.engine.precision import autocast
from raytrain_loops.engine.rng import seed_everything
from raytrain_loops.launch import storage
from raytrain_loops.launch.faults import Faults
from raytrain_loops.launch.runlog import RunLog
from raytrain_loops.tasks import MapSplit, Task

# Ray Data's iterator costs about a millisecond of Python per batch it hands out, on a thread that
# shares the GIL with training; fetching at least this many rows at a time and slicing them into
# micro-batches here keeps that cost off small-batch runs.
FETCH_ROWS = 512


def sliced(fetched: Iterable[dict[str, Any]], size: int, collate, drop_last: bool) -> Iterable[Any]:
    """Cut NumPy batches into batches of ``size`` rows, each passed through ``collate``; rows
    left over at the end of one fetched batch are joined with the next."""
    import numpy as np

    rest: dict[str, Any] | None = None
    for batch in fetched:
        if rest is not None:
            batch = {k: np.concatenate([rest[k], v]) for k, v in batch.items()}
            rest = None
        n = len(next(iter(batch.values())))
        start = 0
        while n - start >= size:
            yield collate({k: v[start : start + size] for k, v in batch.items()})
            start += size
        if start < n:
            rest = {k: v[start:] for k, v in batch.items()}
    if rest is not None and not drop_last:
        yield collate(rest)


class Batches:
    """This worker's batches of each split, per epoch, from Ray Data shards or a DataLoader."""

    def __init__(self, task: Task, config: Config, splits: dict[str, Any], rows: dict[str, int], rank: int, world: int):
        self.task, self.cfg, self.rank, self.world = task, config, rank, world
        self.scale = config.scaling.num_workers / world  # > 1 when an elastic group runs short
        self.has_eval = "eval" in splits
        self.loaders = {}
        for name, split in splits.items():
            if isinstance(split, MapSplit):
                train = name == "train"
                loader = torch.utils.data.DataLoader(
                    split.dataset,
                    batch_size=config.data.batch_size if train else config.data.eval_batch_size,
                    shuffle=train,
                    drop_last=train,
                    num_workers=config.data.loader_workers,
                    collate_fn=split.collate_fn,
                )
                self.loaders[name] = ray.train.torch.prepare_data_loader(loader, move_to_device=False)
        if "train" in self.loaders:
            self.batches_per_epoch = len(self.loaders["train"])
        else:
            # Ray Data splits the rows equally over workers; the last partial batch is dropped.
            self.batches_per_epoch = rows["train"] // world // config.data.batch_size

    def epoch(self, split: str, epoch: int) -> Iterable[Any]:
        if split in self.loaders:
            loader = self.loaders[split]
            if hasattr(loader.sampler, "set_epoch"):
                loader.sampler.set_epoch(epoch)
            return loader
        shard = ray.train.get_dataset_shard(split)
        train = split == "train"
        size = self.cfg.data.batch_size if train else self.cfg.data.eval_batch_size
        window = self.cfg.data.shuffle_buffer if train else 0
        fetched = shard.iter_batches(
            batch_size=size * max(1, -(-max(FETCH_ROWS, window) // size)),
            batch_format="numpy",
            prefetch_batches=self.cfg.data.prefetch_batches,
        )
        if window:
            fetched = shuffled(fetched, (self.cfg.loop.seed, epoch, self.rank))
        return sliced(fetched, size, self.task.collate, drop_last=train)


def shuffled(fetched: Iterable[dict[str, Any]], seed: tuple[int, ...]) -> Iterable[dict[str, Any]]:
    """Permute the rows of each fetched batch (of data.shuffle_buffer rows or more) with a
    generator seeded by (seed, epoch, rank). The shard arrives in the same order every time
    (Ray Data's preserve_order), so an epoch's batches are a function of the seed alone and a
    run resumed mid-epoch continues with exactly the rows the interrupted attempt had left."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for batch in fetched:
        order = rng.permutation(len(next(iter(batch.values()))))
        yield {k: v[order] for k, v in batch.items()}


def steps_in_epoch(config: Config, batches_per_epoch: int, epoch: int, scale: float = 1.0) -> int:
    return batches_per_epoch // accum_steps(config.accum, epoch, scale)


def total_steps(config: Config, batches_per_epoch: int, scale: float = 1.0) -> int:
    """The run's length: ``loop.max_steps``, or the steps of ``loop.epochs`` epochs."""
    if any(steps_in_epoch(config, batches_per_epoch, e, scale) == 0 for e in range(config.loop.epochs)):
        raise ValueError(
            f"an epoch holds {batches_per_epoch} batches of data.batch_size={config.data.batch_size} per worker, "
            f"fewer than accum.steps={config.accum.steps}: lower data.batch_size or scaling.num_workers"
        )
    return config.loop.max_steps or sum(
        steps_in_epoch(config, batches_per_epoch, e, scale) for e in range(config.loop.epochs)
    )


def evaluate(engine: Engine, task: Task, batches: Batches, config: Config, epoch: int) -> dict[str, float]:
    """Evaluate the model (and its EMA) on this worker's eval shard; means over all workers."""
    models = [("", engine.module)]
    if engine.ema is not None and config.eval.ema:
        models.append(("ema_", engine.ema.module))
    meters = Meters()
    for _, m in models:
        m.eval()
    with torch.no_grad(), autocast(config.precision, engine.device):
        for batch in batches.epoch("eval", epoch):
            batch = to_device(batch, engine.device)
            for prefix, m in models:
                for name, (value, count) in task.evaluate(m, batch).items():
                    meters.add(f"eval_{prefix}{name}", value, count)
    engine.model.train()
    return meters.reduce()


class Checkpointer:
    """Writes this worker's part of a checkpoint and reports it; restores the run's newest intact
    checkpoint."""

    def __init__(self, engine: Engine, rank: int, world: int, run_dir: str):
        self.engine, self.rank, self.world, self.run_dir = engine, rank, world, run_dir
        self.loaded: dict[str, Any] | None = None  # what restore() loaded: path, model digest, skipped

    def _dir_name(self) -> str:
        """``checkpoint_<step>``; with a suffix when that directory exists (written by an attempt
        that failed, or found damaged), so a new checkpoint never merges into an old one. Only
        rank 0's name counts: Ray gives every worker's files the name rank 0 chose."""
        name = f"checkpoint_{self.engine.step:08d}"
        if self.rank != 0:
            return name
        candidate, n = name, 1
        while storage.exists(storage.join(self.run_dir, candidate)):
            n += 1
            candidate = f"{name}-{n}"
        return candidate

    def report(self, metrics: dict[str, Any], position: dict[str, int] | None) -> None:
        """``ray.train.report`` on every worker; with a checkpoint when ``position`` is given.

        Reports are asynchronous: the training thread waits only for the other workers (a
        barrier), while the upload and the hand-over to Ray's controller (which polls every
        couple of seconds) happen on Ray's background thread, which then deletes the local copy.
        The files are written here first, so the checkpoint holds the state of this step.
        """
        async_mode = ray.train.CheckpointUploadMode.ASYNC
        if position is None:
            ray.train.report(metrics, checkpoint_upload_mode=async_mode)
            return
        tmp = tempfile.mkdtemp(prefix="raytrain-ckpt-")
        try:
            state = self.engine.state_dict()
            mine = {
                "rng": state.pop("rng"),
                "data": position,
                "world_size": self.world,
                "node_id": ray.get_runtime_context().get_node_id(),  # where this worker ran
            }
            files = {ckpt_files.rank_file(self.rank): mine}
            if self.rank == 0:
                files[ckpt_files.STATE] = state
            ckpt_files.write_files(tmp, self.rank, files, self.world)
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(tmp),
                checkpoint_dir_name=self._dir_name(),
                checkpoint_upload_mode=async_mode,
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def restore(self, init_checkpoint: str | None = None) -> dict[str, int] | None:
        """Load this run's newest intact checkpoint, else ``init_checkpoint`` (another run's, e.g.
        a PBT donor's); return the data position.

        The candidates are every checkpoint directory of the run, newest first: the one Ray
        registered last, and any newer one a failed attempt finished writing before Ray had
        registered it (reports are asynchronous). A damaged one is skipped with a warning for the
        one before it. Every worker reads the same files, so all pick the same checkpoint.
        """
        paths = [p for p in storage.list_dirs(self.run_dir) if ckpt_files.step_of(os.path.basename(p)) >= 0]
        latest = ray.train.get_checkpoint()
        if latest is not None and os.path.basename(latest.path.rstrip("/")) not in map(os.path.basename, paths):
            paths.append(latest.path)
        paths.sort(key=lambda p: ckpt_files.order_key(os.path.basename(p.rstrip("/"))), reverse=True)
        if not paths:
            return self._load(ray.train.Checkpoint(init_checkpoint), skipped=[]) if init_checkpoint else None
        skipped: list[dict[str, str]] = []
        for path in paths:
            try:
                return self._load(ray.train.Checkpoint(path), skipped)
            except ckpt_files.CheckpointError as err:
                if self.rank == 0:
                    print(f"warning: checkpoint {path} is unusable, trying the one before: {err}", flush=True)
                skipped.append({"checkpoint": path, "reason": str(err)})
        raise ckpt_files.CheckpointError(f"no intact checkpoint in {self.run_dir}; the newest: {skipped[0]['reason']}")

    def _load(self, checkpoint, skipped: list[dict[str, str]]) -> dict[str, int]:
        with checkpoint.as_directory() as d:
            world = ckpt_files.verify(d)
            shared = ckpt_files.read_file(d, ckpt_files.STATE)
            # A group of another size (an elastic resize) takes rank 0's position, rescaled.
            mine = ckpt_files.read_file(d, ckpt_files.rank_file(self.rank if world == self.world else 0))
        state = {**shared, "rng": mine["rng"]} if world == self.world else shared
        self.engine.load_state_dict(state)
        self.loaded = {
            "checkpoint": checkpoint.path,
            "model_sha256": ckpt_files.digest(shared["model"]),
            "world_size": world,
            "skipped": skipped,
        }
        position = dict(mine["data"])
        if world != self.world:
            position["batches"] = position["batches"] * world // self.world
        return position


def train_loop_per_worker(payload: dict[str, Any]) -> dict[str, Any] | None:
    """Ray Train's entry point on every worker."""
    config = Config.from_dict(payload["config"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    threads = config.scaling.threads_per_worker or max(1, int(config.scaling.cpus_per_worker))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)

    task: Task = payload["task"]
    seed_everything(config.loop.seed)  # identical initial weights on every worker
    module = task.build_model()
    groups = task.param_groups(module) if config.optim.param_groups == "task" else None
    model = ray.train.torch.prepare_model(module)
    seed_everything(config.loop.seed + 1 + rank)  # distinct dropout and augmentation per worker

    batches = Batches(task, config, payload["splits"], payload["rows"], rank, world)
    total = total_steps(config, batches.batches_per_epoch, batches.scale)
    faults = Faults(config.fault.plan, rank, payload["run_dir"])
    engine = Engine(model, faults.wrap_loss(task.criterion), config, total_steps=total, task_param_groups=groups)
    checkpointer = Checkpointer(engine, rank, world, payload["run_dir"])
    position = checkpointer.restore(payload.get("init_checkpoint")) or {"epoch": 0, "batches": 0}
    if rank == 0 and checkpointer.loaded:
        storage.write_text(storage.join(payload["run_dir"], "init.json"), json.dumps(checkpointer.loaded) + "\n")
    log = RunLog(payload["run_dir"], rank, total, config.run.progress, engine.step, world)
    if rank == 0 and world != config.scaling.num_workers:
        print(
            f"{world} of {config.scaling.num_workers} workers: {accum_steps(config.accum, engine.epoch, batches.scale)} micro-batches per update",
            flush=True,
        )
    try:
        run_loop(engine, task, batches, config, total, position, checkpointer, log, faults)
    except TrainingError as err:
        # Every worker raises it at the same step (the decision comes from all-reduced values),
        # and a restart would meet it again: end the attempt normally so Ray does not retry, and
        # let the driver raise it (the last checkpoint stays the newest).
        return {"stopped": type(err).__name__, "message": str(err), "step": engine.step}
    finally:
        log.close()
    return None


def run_loop(engine, task, batches, config, total, position, checkpointer, log, faults) -> None:
    """Epochs of steps until ``total``; evaluation, reports and checkpoints on schedule, and once
    more at the end through the same path. Every worker reaches every collective and report."""
    cfg = config
    metrics: dict[str, float] = {}
    last_eval: dict[str, float] = {}
    calls = 0
    spike = SpikeDetector(cfg.spike.factor, cfg.spike.window, cfg.spike.min_steps)

    def due(every: int, step: int) -> bool:
        return every > 0 and step % every == 0

    def checkpoint_and_report(
        step_metrics: dict[str, float], eval_now: bool, ckpt_now: bool, epoch_pos: dict[str, int]
    ):
        if eval_now and batches.has_eval:
            last_eval.update(evaluate(engine, task, batches, cfg, engine.epoch))
            log.evaluation(last_eval, engine.step, engine.epoch)
        # Every report carries the latest evaluation, so a sweep's metric is in each of them.
        out = {**step_metrics, **last_eval, "step": engine.step, "epoch": engine.epoch}
        if ckpt_now:
            log.sync()
        checkpointer.report(out, epoch_pos if ckpt_now else None)

    while engine.step < total:
        epoch = engine.epoch
        k = accum_steps(cfg.accum, epoch, batches.scale)
        steps_this_epoch = steps_in_epoch(cfg, batches.batches_per_epoch, epoch, batches.scale)
        skip = position["batches"] if position["epoch"] == epoch else 0
        stream = iter(batches.epoch("train", epoch))
        for _ in itertools.islice(stream, skip):
            pass
        done = skip // k
        groups = timed_groups(stream, k)
        while done < steps_this_epoch and engine.step < total:
            group, wait = next(groups, ([], 0.0))
            # A worker that ran out of data joins the step with placeholders (zero contribution).
            group = list(group) + [None] * (k - len(group))
            result = engine.train_step(group, data_time=wait)
            done += 1
            calls += 1
            log.step(result, engine.step, epoch)
            if result.applied:
                spike.check(result.loss, engine.step)
                faults.after_step(engine.step)
            if calls % cfg.logging.every_steps == 0:
                metrics = engine.reduce_metrics()
                log.interval(metrics, engine.step)
            if not result.applied or engine.step >= total:
                continue
            eval_now = due(cfg.eval.every_steps, engine.step)
            ckpt_now = due(cfg.checkpoint.every_steps, engine.step)
            if eval_now or ckpt_now or due(cfg.run.report_every_steps, engine.step):
                checkpoint_and_report(metrics, eval_now, ckpt_now, {"epoch": epoch, "batches": done * k})
        if done < steps_this_epoch:
            # Stopped at loop.max_steps inside the epoch: a resumed run continues right here.
            position = {"epoch": epoch, "batches": done * k}
            break
        for _ in stream:  # drain the dropped remainder, so every shard's epoch ends together
            pass
        engine.epoch += 1
        position = {"epoch": engine.epoch, "batches": 0}
        if engine.step < total and (cfg.eval.every_steps == 0 or cfg.checkpoint.every_steps == 0):
            checkpoint_and_report(metrics, cfg.eval.every_steps == 0, cfg.checkpoint.every_steps == 0, position)
    # The final evaluation, checkpoint and report take the same path as the periodic ones.
    metrics.update(engine.reduce_metrics())
    checkpoint_and_report({**metrics, "done": 1.0}, True, True, position)
