"""A ``torch.profiler`` trace of a few training steps per worker: a loop callback.

``logging.profile`` names the update count at which recording starts and how many calls of the
step it records; the step before them is the profiler's warm-up. Each worker writes
``<run>/profile/rank<r>.<step>.pt.trace.json`` (``<step>``: the update count after the last
recorded step), a Chrome trace that Perfetto (ui.perfetto.dev) and TensorBoard's profiler open.
On an object store the trace is written to a local scratch directory and uploaded.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from typing import Any

import torch
from torch.profiler import ProfilerActivity

from raytrain_loops import storage
from raytrain_loops.config.engine import ProfileConfig
from raytrain_loops.engine import StepResult
from raytrain_loops.engine.loop import Callback


class Profile(Callback):
    """Records the steps ``logging.profile`` names on this worker and writes their trace."""

    def __init__(self, cfg: ProfileConfig, run_dir: str, rank: int, device: torch.device):
        self.cfg, self.run_dir, self.rank, self.device = cfg, run_dir, rank, device
        self.remote = storage.is_uri(run_dir)
        self.traces: list[str] = []  # where this worker's traces went
        self._prof: torch.profiler.profile | None = None
        self._pending = cfg.enabled  # not yet started
        self._step = 0
        self._local_dir: str | None = None

    def before_step(self, step: int, micro_batches: Sequence[Any]) -> None:
        if self._pending:
            self._pending = False
            self._start(step)

    def _start(self, step: int) -> None:
        ahead = self.cfg.start_step - step
        if ahead < 0:
            return  # a resumed run already past the window: no trace
        warmup = min(ahead, 1)
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=ahead - warmup, warmup=warmup, active=self.cfg.steps, repeat=1),
            on_trace_ready=self._write,
        )
        self._prof.start()

    def on_step(self, result: StepResult, step: int, epoch: int) -> None:
        if self._prof is None:
            return
        self._step = step
        self._prof.step()
        if self.traces:  # the window is over
            self._stop()

    def _write(self, prof: torch.profiler.profile) -> None:
        if self._local_dir is None:
            self._local_dir = storage.scratch_dir("profile") if self.remote else storage.join(self.run_dir, "profile")
            os.makedirs(self._local_dir, exist_ok=True)
        name = f"rank{self.rank}.{self._step}.pt.trace.json"
        prof.export_chrome_trace(os.path.join(self._local_dir, name))
        storage.upload_dir(self._local_dir, storage.join(self.run_dir, "profile"))
        self.traces.append(storage.join(self.run_dir, "profile", name))

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.stop()  # inside the window (a run that ended there): writes what was recorded

    def close(self) -> None:
        self._stop()
        if self.remote and self._local_dir is not None:
            shutil.rmtree(self._local_dir, ignore_errors=True)
