"""Rank 0's record of a run: per-step JSON lines, TensorBoard events and a progress line.

A loop :class:`~raytrain_loops.engine.loop.Callback`. On every other rank its methods do
nothing, so every worker runs the same loop.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from datetime import timedelta

from raytrain_loops.engine import StepResult
from raytrain_loops.engine.loop import Callback
from raytrain_loops.launch import storage
from raytrain_loops.launch.console import Sender


class RunLog(Callback):
    """Writes ``metrics.jsonl`` (one line per step), ``eval.jsonl`` and ``tb/`` for rank 0."""

    # Where the progress and evaluation lines go: the driver's console (set by the worker to the
    # run's :class:`~raytrain_loops.launch.console.Sender`), else this process's stdout.
    sender: Sender | None = None

    def __init__(
        self, run_dir: str, rank: int, total_steps: int, progress: bool, start_step: int = 0, workers: int = 1
    ):
        self.enabled = rank == 0
        self.workers = workers
        self.total_steps = total_steps
        self.progress = progress
        if not self.enabled:
            return
        self.run_dir = run_dir
        self.remote = storage.is_uri(run_dir)
        self.local_dir = storage.scratch_dir("log") if self.remote else run_dir
        os.makedirs(self.local_dir, exist_ok=True)
        if self.remote:
            self._continue_remote_logs()
        # Held open for the whole run (one line per step) and closed in close().
        self._steps = open(os.path.join(self.local_dir, "metrics.jsonl"), "a")  # noqa: SIM115
        self._evals = open(os.path.join(self.local_dir, "eval.jsonl"), "a")  # noqa: SIM115
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(os.path.join(self.local_dir, "tb"))
        self._t0 = time.perf_counter()
        self._start_step = start_step

    def _continue_remote_logs(self) -> None:
        """Start from the lines an earlier attempt (or run) uploaded, so that the upload at the
        next checkpoint extends the run's log instead of replacing it (as a local run directory's
        files are appended to)."""
        for name in ("metrics.jsonl", "eval.jsonl"):
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

    def on_interval(self, metrics: dict[str, float], step: int) -> None:
        """Once per logging interval: TensorBoard scalars and the progress line."""
        if not self.enabled:
            return
        self._steps.flush()
        for name, value in metrics.items():
            self._tb.add_scalar(f"train/{name}", value, step)
        if self.progress:
            self._show("progress", self.progress_line(metrics, step), step=step, total=self.total_steps)

    def progress_line(self, metrics: dict[str, float], step: int) -> str:
        elapsed = time.perf_counter() - self._t0
        done = max(step - self._start_step, 1)
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total_steps - step) / rate if rate > 0 else math.inf
        eta_text = str(timedelta(seconds=int(eta))) if math.isfinite(eta) else "?"
        return (
            f"step {step}/{self.total_steps} ({100 * step / self.total_steps:.0f}%) | {rate:.1f} steps/s | "
            f"loss {metrics.get('loss', math.nan):.4f} | lr {metrics.get('lr', math.nan):.2e} | eta {eta_text}"
        )

    def on_eval(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        if not self.enabled:
            return
        self._evals.write(json.dumps({"step": step, "epoch": epoch, **metrics}) + "\n")
        self._evals.flush()
        for name, value in metrics.items():
            self._tb.add_scalar(name.replace("eval_", "eval/", 1), value, step)
        if self.progress:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
            self._show("eval", f"eval at step {step}: {shown}", step=step)

    def _show(self, kind: str, text: str, **data) -> None:
        if self.sender is None:
            print(text, flush=True)
        else:
            self.sender.send(kind, text, **data)

    def before_checkpoint(self) -> None:
        """Flush, and copy to the run directory when it is remote."""
        if not self.enabled:
            return
        self._steps.flush()
        self._tb.flush()
        storage.upload_dir(self.local_dir, self.run_dir)

    def close(self) -> None:
        if not self.enabled:
            return
        self.before_checkpoint()
        if self.sender is not None:
            self.sender.flush()
        self._steps.close()
        self._evals.close()
        self._tb.close()
        if self.remote:
            storage.upload_dir(self.local_dir, self.run_dir)  # the events the writer flushed on close
            shutil.rmtree(self.local_dir, ignore_errors=True)
