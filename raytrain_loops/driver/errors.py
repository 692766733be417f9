"""Turning Ray's wrapped worker failures back into the error a user can act on."""

from __future__ import annotations

from dataclasses import dataclass


def root_cause(err: BaseException) -> str:
    """The innermost meaningful message of a (possibly Ray-wrapped) training failure."""
    worker_failures = getattr(err, "worker_failures", None)
    if isinstance(worker_failures, dict) and worker_failures:
        inner = next(iter(worker_failures.values()))
        return root_cause(inner)
    cause = getattr(err, "cause", None) or err.__cause__
    if isinstance(cause, BaseException) and cause is not err:
        return root_cause(cause)
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[-1] if text else ''}"


def worker_traceback(err: BaseException) -> str | None:
    """The failed workers' tracebacks of a Ray Train failure (its text: Ray groups alike errors
    of several workers, and keeps only the bare exceptions in ``worker_failures``), or None for
    another error."""
    worker_failures = getattr(err, "worker_failures", None)
    if isinstance(worker_failures, dict) and worker_failures:
        return str(err)
    return None


@dataclass
class Stopped:
    """What the workers return when the run stopped on an error that retrying cannot fix."""

    kind: str
    message: str
    step: int


class TrainingStopped(RuntimeError):
    """The run stopped on an error that retrying cannot fix (non-finite values, a loss spike,
    persistent OOM, workers out of sync); Ray did not restart it."""

    def __init__(self, kind: str, message: str, step: int):
        super().__init__(f"{kind} at step {step}: {message}")
        self.kind, self.step = kind, step
