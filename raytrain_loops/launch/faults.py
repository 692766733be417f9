"""Faults injected on purpose (``fault.plan``), to test that runs recover from them.

A fault fires once: the worker that fires it first writes a marker into the run directory, so
the attempt Ray starts after the failure, which passes the same step again, runs clean.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

from raytrain_loops.engine import LossOutput
from raytrain_loops.launch import storage


class InjectedFault(RuntimeError):
    """An exception raised by ``fault.plan`` (kind ``raise``); Ray retries it like any crash."""


class Faults:
    """One worker's share of the fault plan."""

    def __init__(self, plan: list[dict[str, Any]], rank: int, run_dir: str):
        self.run_dir = run_dir
        mine = [(i, f) for i, f in enumerate(plan) if f.get("rank", 0) == rank]
        self.after = {f["step"]: (i, f) for i, f in mine if f.get("kind", "raise") in ("raise", "kill")}
        self.loss = {f["step"]: (i, f) for i, f in mine if f.get("kind") in ("nan", "spike")}

    def _first_time(self, index: int, fault: dict[str, Any]) -> bool:
        marker = storage.join(self.run_dir, "faults", f"{index}.fired")
        if storage.exists(marker):
            return False
        storage.write_text(marker, json.dumps(fault) + "\n")
        return True

    def wrap_loss(self, loss_fn):
        """The criterion, with this worker's loss faults applied at their steps."""
        if not self.loss:
            return loss_fn

        def criterion(model, batch, ctx) -> LossOutput:
            out = loss_fn(model, batch, ctx)
            due = self.loss.get(ctx.step + 1)  # ctx.step counts the updates made before this one
            if due is not None and ctx.micro_index == 0 and self._first_time(*due):
                out.loss = out.loss * (float("nan") if due[1]["kind"] == "nan" else 1000.0)
            return out

        return criterion

    def after_step(self, step: int) -> None:
        """Fire this worker's crash faults due after ``step``."""
        due = self.after.get(step)
        if due is None or not self._first_time(*due):
            return
        index, fault = due
        print(f"fault.plan[{index}]: {fault.get('kind', 'raise')} worker after step {step}", flush=True)
        if fault.get("kind", "raise") == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFault(f"fault.plan[{index}] after step {step}")
