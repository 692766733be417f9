"""Rank 0's record of a run: per-step JSON lines, per-epoch averages, TensorBoard events and a
progress line.

A loop :class:`~raytrain_loops.engine.loop.Callback`. On every other rank its methods write
nothing, so every worker runs the same loop; every rank keeps the progress line's smoothing
(the interval metrics are the same on every worker), so its state is too.

Each record is in the files once, whatever restarts happen. At every checkpoint rank 0 records
the length of each of its files (the JSON lines and TensorBoard's event files) in its state,
which the checkpoint saves. A run that resumes from that checkpoint cuts every file back to its
recorded length and removes the event files written after it, so exactly the records written
before the checkpoint stay, and the steps it replays are written once more. The lengths, not
the steps, mark the cut: an epoch that ends at the checkpoint's step, and the evaluation that
follows it, are written after that checkpoint and replayed from it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from datetime import timedelta
from typing import Any

from raytrain_loops import storage
from raytrain_loops.callbacks import throughput
from raytrain_loops.callbacks.series import series
from raytrain_loops.config.engine import SmoothingConfig
from raytrain_loops.console.feed import Sender
from raytrain_loops.engine import StepResult
from raytrain_loops.engine.loop import Callback
from raytrain_loops.engine.meters import Smoother

LOGS = ("metrics.jsonl", "eval.jsonl", "epochs.jsonl")
TB = "tb"  # TensorBoard's event files, one per attempt
# Metrics the progress line shows in places of their own, or not at all; the rest are the loss
# and the criterion's terms and logs (a weighted term's ``_unscaled`` copy is left out too).
NOT_TERMS = (
    frozenset(
        ["lr", "grad_norm", "sample_size", "sample_size_per_s", "compute_time", "data_time", "batch_time"]
        + ["step", "epoch", "overflow", "nonfinite", "oom", "loss_scale"]
    )
    | throughput.METRICS
)


def _terms(values: dict[str, float]) -> str:
    """The loss, then every other term and log of the criterion, by name."""
    terms = sorted(
        k for k in values if k not in NOT_TERMS and k != "loss" and not k.endswith("_unscaled") and "/rank" not in k
    )
    return " ".join(f"{k} {values[k]:.4g}" for k in ["loss", *terms] if k in values)


def _throughput(metrics: dict[str, float]) -> str:
    """The interval's samples per second over all workers, and the MFU where it is known."""
    shown = [f"{metrics['samples_per_s']:.0f} samples/s"] if "samples_per_s" in metrics else []
    shown += [f"MFU {metrics['mfu']:.1%}"] if "mfu" in metrics else []
    return "".join(f", {part}" for part in shown)


def kept_files(loaded: dict[str, Any] | None, callback_state: dict[str, Any]) -> dict[str, int] | None:
    """What a run's log keeps of the files its earlier attempts wrote (:class:`RunLog`'s
    ``kept``), given what the restore loaded (``RayReporter.loaded``) and the restored callback
    states: the lengths the run's own checkpoint recorded; nothing (``{}``) when the run starts
    from step 0 (no checkpoint, or every one damaged) or from another run's checkpoint (a PBT
    donor's), since every record in the files then comes again; None (every file kept whole)
    for a checkpoint that recorded no lengths."""
    if not loaded or not loaded["checkpoint"] or loaded.get("init"):
        return {}
    return (callback_state.get(RunLog.__name__) or {}).get("files")


class RunLog(Callback):
    """Writes ``metrics.jsonl`` (one line per step), ``eval.jsonl`` (one per evaluation),
    ``epochs.jsonl`` (one per finished epoch: its averages over all workers) and ``tb/`` for
    rank 0, and prints the progress line, its values smoothed as ``smoothing`` says.
    TensorBoard's series (:func:`~raytrain_loops.callbacks.series.series`; the system ones with
    ``system_series``) carry the names the files and the console use, each against the step.

    ``kept``: the length in bytes of each file (relative to the run directory) to keep from the
    run's earlier attempts, as the checkpoint the run resumes from recorded it (:func:`kept_files`);
    a file it does not name is removed (a log emptied); None keeps every file whole."""

    # Where the progress and evaluation lines go: the driver's console (set by the worker to the
    # run's :class:`~raytrain_loops.console.feed.Sender`), else this process's stdout.
    sender: Sender | None = None

    def __init__(
        self,
        run_dir: str,
        rank: int,
        total_steps: int,
        progress: bool,
        start_step: int = 0,
        workers: int = 1,
        smoothing: SmoothingConfig | None = None,
        steps_per_interval: int = 1,
        kept: dict[str, int] | None = None,
        system_series: bool = False,
    ):
        self.enabled = rank == 0
        self.system_series = system_series
        self.workers = workers
        self.total_steps = total_steps
        self.progress = progress
        s = smoothing or SmoothingConfig()
        self.smoother = Smoother(s.kind, s.momentum, s.window, steps_per_interval)
        self.smoothed: dict[str, float] = {}
        if not self.enabled:
            return
        self.run_dir = run_dir
        self.remote = storage.is_uri(run_dir)
        self.local_dir = storage.scratch_dir("log") if self.remote else run_dir
        os.makedirs(self.local_dir, exist_ok=True)
        if kept is not None:
            self._cut(kept)
        # Each file's length at the last checkpoint (the state saved with it): the earlier
        # attempts' event files stay as they are; this attempt's files are measured each time.
        tb_dir = storage.join(run_dir, TB)
        self.lengths = {f"{TB}/{n}": size for n, size in storage.file_sizes(tb_dir).items()}
        if self.remote:
            self._continue_remote_logs()
        # Held open for the whole run (one line per step) and closed in close().
        self._steps = open(os.path.join(self.local_dir, "metrics.jsonl"), "a")  # noqa: SIM115
        self._evals = open(os.path.join(self.local_dir, "eval.jsonl"), "a")  # noqa: SIM115
        self._epochs = open(os.path.join(self.local_dir, "epochs.jsonl"), "a")  # noqa: SIM115
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(os.path.join(self.local_dir, TB))
        self._t0 = time.perf_counter()
        self._start_step = start_step
        self._measure()

    def _cut(self, kept: dict[str, int]) -> None:
        """Cut the run directory's files back to the lengths in ``kept``, and remove the event
        files it does not name: each file is cut in one step (:func:`storage.truncate`), so a
        crash here leaves every record written before the checkpoint in place."""
        for name in LOGS:
            storage.truncate(storage.join(self.run_dir, name), kept.get(name, 0))
        tb_dir = storage.join(self.run_dir, TB)
        for name in storage.file_sizes(tb_dir):
            path = storage.join(tb_dir, name)
            if f"{TB}/{name}" in kept:
                storage.truncate(path, kept[f"{TB}/{name}"])
            else:
                storage.delete(path)

    def _continue_remote_logs(self) -> None:
        """Start from the lines an earlier attempt (or run) uploaded, so that the upload at the
        next checkpoint extends the run's log instead of replacing it (as a local run directory's
        files are appended to)."""
        for name in LOGS:
            text = storage.read_text(storage.join(self.run_dir, name))
            if text:
                with open(os.path.join(self.local_dir, name), "w") as f:
                    f.write(text)

    def on_step(self, result: StepResult, step: int, epoch: int) -> None:
        if not self.enabled:
            return
        record = {
            "step": step,
            "epoch": epoch,
            "loss": result.loss if math.isfinite(result.loss) else None,
            "lr": result.lr,
            "grad_norm": result.grad_norm if math.isfinite(result.grad_norm) else None,
            "sample_size": result.sample_size,
            "workers": self.workers,
            "applied": result.applied,
            "skipped": result.skipped,
            "compute_time": result.compute_time,
            "time": time.time(),
        }
        self._steps.write(json.dumps(record) + "\n")

    def state_dict(self) -> dict[str, Any]:
        """The smoother's state; on rank 0 (whose state the checkpoint saves), with the length of
        each file at the last checkpoint (``files``), where a run resumed from it cuts them."""
        state: dict[str, Any] = {"smoother": self.smoother.state_dict()}
        if self.enabled:
            state["files"] = dict(self.lengths)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.smoother.load_state_dict(state.get("smoother") or {})

    def on_interval(self, metrics: dict[str, float], step: int) -> None:
        """Once per logging interval: the smoothing (every rank), TensorBoard scalars and the
        progress line."""
        self.smoothed = self.smoother.update({k: v for k, v in metrics.items() if k not in ("step", "epoch")})
        if not self.enabled:
            return
        self._steps.flush()
        for name, value in series(metrics, self.system_series).items():
            self._tb.add_scalar(name, value, step)
        if self.progress:
            self._show("progress", self.progress_line(metrics, step), step=step, total=self.total_steps)

    def progress_line(self, metrics: dict[str, float], step: int) -> str:
        """One line: the step, the epoch, the loss and every term (smoothed), the lr, the data
        and batch time (smoothed: waiting for data against the whole step), the rates and eta.

        Steps/s and samples/s are measured over one span, the interval's step time (computing
        and waiting for data), so samples/s is steps/s times the global batch; the eta comes from
        the rate since this attempt started (evaluations, checkpoints and logging included),
        shown beside it as ``overall``."""
        elapsed = time.perf_counter() - self._t0
        done = max(step - self._start_step, 1)
        overall = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total_steps - step) / overall if overall > 0 else math.inf
        eta_text = str(timedelta(seconds=int(eta))) if math.isfinite(eta) else "?"
        busy = metrics.get("batch_time", 0.0)  # the interval's mean step time, over all workers
        rates = f"{1 / busy:.1f} steps/s{_throughput(metrics)} (step time) | " if busy > 0 else ""
        smoothed = self.smoothed
        epoch = metrics.get("epoch")
        return (
            f"step {step}/{self.total_steps} ({100 * step / self.total_steps:.0f}%) | "
            f"epoch {int(epoch) if epoch is not None else '?'} | {_terms(smoothed) or 'loss ?'} | "
            f"lr {metrics.get('lr', math.nan):.2e} | data {smoothed.get('data_time', math.nan):.3f}s "
            f"batch {smoothed.get('batch_time', math.nan):.3f}s | {rates}eta {eta_text} ({overall:.1f} steps/s overall)"
        )

    def on_epoch(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        """The epoch's averages over all workers (``train_<name>``): a line of ``epochs.jsonl``,
        TensorBoard scalars at the epoch's last step, and a line on the console."""
        if not self.enabled:
            return
        self._epochs.write(json.dumps({"epoch": epoch, "step": step, **metrics, "time": time.time()}) + "\n")
        self._epochs.flush()
        for name, value in series(metrics, self.system_series).items():
            self._tb.add_scalar(name, value, step)
        if self.progress:
            means = {k.removeprefix("train_"): v for k, v in metrics.items()}
            shown = " | ".join(
                [_terms(means), f"lr {means.get('lr', math.nan):.2e}"]
                + [f"{k} {means[k]:.3f}s" for k in ("data_time", "batch_time") if k in means]
            )
            self._show("epoch", f"epoch {epoch} ended at step {step}, averages over the epoch (train_*): {shown}", step=step)

    def on_eval(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        if not self.enabled:
            return
        self._evals.write(json.dumps({"step": step, "epoch": epoch, **metrics}) + "\n")
        self._evals.flush()
        for name, value in metrics.items():
            self._tb.add_scalar(name, value, step)
        if self.progress:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
            self._show("eval", f"eval at step {step}: {shown}", step=step)

    def _show(self, kind: str, text: str, **data) -> None:
        if self.sender is None:
            print(text, flush=True)
        else:
            self.sender.send(kind, text, **data)

    def before_checkpoint(self) -> None:
        """Flush, record each file's length (for :meth:`state_dict`), and copy the files to the
        run directory when it is remote."""
        if not self.enabled:
            return
        self._measure()
        storage.upload_dir(self.local_dir, self.run_dir)

    def _measure(self) -> None:
        """Flush every file, and record its length."""
        for f in (self._steps, self._evals, self._epochs):
            f.flush()
        self._tb.flush()
        for name in LOGS:
            self.lengths[name] = os.path.getsize(os.path.join(self.local_dir, name))
        for name, size in storage.file_sizes(os.path.join(self.local_dir, TB)).items():
            self.lengths[f"{TB}/{name}"] = size

    def close(self) -> None:
        if not self.enabled:
            return
        self.before_checkpoint()
        if self.sender is not None:
            self.sender.flush()
        self._steps.close()
        self._evals.close()
        self._epochs.close()
        self._tb.close()
        if self.remote:
            storage.upload_dir(self.local_dir, self.run_dir)  # the events the writer flushed on close
            shutil.rmtree(self.local_dir, ignore_errors=True)
