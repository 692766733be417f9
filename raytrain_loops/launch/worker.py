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
from raytrain_loops.engine.loop import accum_steps, timed_groups
from raytrain_loops.engine.meters import Meters
from raytrain_loops.engine.precision import autocast
from raytrain_loops.engine.rng import seed_everything
from raytrain_loops.launch import storage
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
        shuffle = self.cfg.data.shuffle_buffer if train else 0
        fetched = shard.iter_batches(
            batch_size=size * max(1, -(-FETCH_ROWS // size)),
            batch_format="numpy",
            local_shuffle_buffer_size=shuffle or None,
            local_shuffle_seed=(self.cfg.loop.seed * 100_003 + epoch * 1009 + self.rank) if shuffle else None,
            prefetch_batches=self.cfg.data.prefetch_batches,
        )
        return sliced(fetched, size, self.task.collate, drop_last=train)


def steps_in_epoch(config: Config, batches_per_epoch: int, epoch: int) -> int:
    return batches_per_epoch // accum_steps(config.accum, epoch)


def total_steps(config: Config, batches_per_epoch: int) -> int:
    """The run's length: ``loop.max_steps``, or the steps of ``loop.epochs`` epochs."""
    if any(steps_in_epoch(config, batches_per_epoch, e) == 0 for e in range(config.loop.epochs)):
        raise ValueError(
            f"an epoch holds {batches_per_epoch} batches of data.batch_size={config.data.batch_size} per worker, "
            f"fewer than accum.steps={config.accum.steps}: lower data.batch_size or scaling.num_workers"
        )
    return config.loop.max_steps or sum(steps_in_epoch(config, batches_per_epoch, e) for e in range(config.loop.epochs))


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
    """Writes this worker's part of a checkpoint and reports it; restores from Ray's checkpoint."""

    def __init__(self, engine: Engine, rank: int, world: int):
        self.engine, self.rank, self.world = engine, rank, world
        self.loaded: dict[str, str] | None = None  # what restore() loaded: path and model digest

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
            ckpt_files.write_files(tmp, self.rank, files)
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(tmp),
                checkpoint_dir_name=f"checkpoint_{self.engine.step:08d}",
                checkpoint_upload_mode=async_mode,
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def restore(self, init_checkpoint: str | None = None) -> dict[str, int] | None:
        """Load the latest checkpoint of this run (Ray hands it over after a restart), else
        ``init_checkpoint`` (another run's, e.g. a PBT donor's); return the data position."""
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None and init_checkpoint:
            checkpoint = ray.train.Checkpoint(init_checkpoint)
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as d:
            ckpt_files.verify(d, self.world)
            shared = ckpt_files.read_file(d, ckpt_files.STATE)
            mine = ckpt_files.read_file(d, ckpt_files.rank_file(self.rank))
        self.engine.load_state_dict({**shared, "rng": mine["rng"]})
        self.loaded = {"checkpoint": checkpoint.path, "model_sha256": ckpt_files.digest(shared["model"])}
        return mine["data"]


def train_loop_per_worker(payload: dict[str, Any]) -> None:
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
    total = total_steps(config, batches.batches_per_epoch)
    engine = Engine(model, task.criterion, config, total_steps=total, task_param_groups=groups)
    checkpointer = Checkpointer(engine, rank, world)
    position = checkpointer.restore(payload.get("init_checkpoint")) or {"epoch": 0, "batches": 0}
    if rank == 0 and checkpointer.loaded:
        storage.write_text(storage.join(payload["run_dir"], "init.json"), json.dumps(checkpointer.loaded) + "\n")
    log = RunLog(payload["run_dir"], rank, total, config.run.progress, engine.step)
    run_loop(engine, task, batches, config, total, position, checkpointer, log)
    log.close()


def run_loop(engine, task, batches, config, total, position, checkpointer, log) -> None:
    """Epochs of steps until ``total``; evaluation, reports and checkpoints on schedule, and once
    more at the end through the same path. Every worker reaches every collective and report."""
    cfg = config
    metrics: dict[str, float] = {}
    last_eval: dict[str, float] = {}
    calls = 0

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
        k = accum_steps(cfg.accum, epoch)
        steps_this_epoch = steps_in_epoch(cfg, batches.batches_per_epoch, epoch)
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
