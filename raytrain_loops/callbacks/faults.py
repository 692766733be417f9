"""Faults injected on purpose (``fault.plan``), to test that runs recover from them.

A loop :class:`~raytrain_loops.engine.loop.Callback`. A fault fires once: the worker that fires
it first writes a marker into the run directory, so the attempt Ray starts after the failure,
which passes the same step again, runs clean.
"""

from __future__ import annotations

import json
import os
import signal

import torch

from raytrain_loops import storage
from raytrain_loops.config import to_dict
from raytrain_loops.config.run import FaultSpec
from raytrain_loops.engine import LossOutput, StepResult
from raytrain_loops.engine.loop import Callback
from raytrain_loops.engine.update.micro import batch_rows


class InjectedFault(RuntimeError):
    """An exception raised by ``fault.plan`` (kind ``raise``); Ray retries it like any crash."""


class Faults(Callback):
    """One worker's share of the fault plan."""

    def __init__(self, plan: list[FaultSpec], rank: int, run_dir: str):
        self.run_dir = run_dir
        mine = [(i, f) for i, f in enumerate(plan) if f.rank == rank]
        self.after = {f.step: (i, f) for i, f in mine if f.kind in ("raise", "kill")}
        self.loss = {f.step: (i, f) for i, f in mine if f.kind in ("nan", "spike")}
        self.memory = [(i, f) for i, f in mine if f.kind == "oom"]
        self.rank = rank

    def _first_time(self, index: int, fault: FaultSpec) -> bool:
        marker = storage.join(self.run_dir, "faults", f"{index}.fired")
        if storage.exists(marker):
            return False
        storage.write_text(marker, json.dumps(to_dict(fault)) + "\n")
        return True

    def wrap_loss(self, loss_fn):
        """The criterion, with this worker's loss faults applied at their steps and its memory
        faults from theirs on (every time: a memory limit, not an event)."""
        if not (self.loss or self.memory):
            return loss_fn

        def criterion(model, batch, ctx) -> LossOutput:
            self._out_of_memory(batch, ctx.step + 1)
            out = loss_fn(model, batch, ctx)
            due = self.loss.get(ctx.step + 1)  # ctx.step counts the updates made before this one
            if due is not None and ctx.micro_index == 0 and self._first_time(*due):
                out.loss = out.loss * (float("nan") if due[1].kind == "nan" else 1000.0)
            return out

        return criterion

    def _out_of_memory(self, batch, step: int) -> None:
        """Raise an out-of-memory error for a micro-batch larger than an ``oom`` fault allows."""
        for index, fault in self.memory:
            if step >= fault.step and (rows := batch_rows(batch, numbers=True)) > fault.micro_batch:
                raise torch.OutOfMemoryError(
                    f"out of memory (fault.plan[{index}]: a micro-batch of {rows} rows on worker {self.rank}, "
                    f"more than {fault.micro_batch})"
                )

    def on_step(self, result: StepResult, step: int, epoch: int) -> None:
        """Fire this worker's crash faults due after ``step`` (an applied update)."""
        due = self.after.get(step) if result.applied else None
        if due is None or not self._first_time(*due):
            return
        index, fault = due
        print(f"fault.plan[{index}]: {fault.kind} worker after step {step}", flush=True)
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFault(f"fault.plan[{index}] after step {step}")
