"""The errors a run stops with, and a failure's root cause as a user reads it: Ray's wrapped worker
failures turned back into the error a user can act on."""

from __future__ import annotations

import re
from dataclasses import dataclass

HINTS = ("Failed to apply UDF transform", "To change retry attempts")
"""The lines Ray Data appends to a failed task's own message (its retry count and how to
configure retries), left out of the cause shown."""
_WHERE = re.compile(r"ray::(?P<fn>[^\s(]+(?:\([^)]*\))?)\S*\s*\(pid=(?P<pid>\d+), ip=(?P<ip>[^,)\s]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
MAX_MESSAGE = 1000


def root_cause(err: BaseException) -> str:
    """The innermost meaningful error of a (possibly Ray-wrapped) training failure: its type and
    its own message (without the retry hints Ray Data appends), and, when it was raised in a Ray
    task or actor (a Ray Data preprocessing or read task), which one and on which node."""
    err, where = _innermost(err)
    text = f"{root_type(err)}: {own_message(err)}"
    return f"{text} (in {where})" if where else text


def root_type(err: BaseException) -> str:
    """The type's name of :func:`root_cause`'s error (``InjectedFault``, not Ray's
    ``RayTaskError(WorkerGroupError)``)."""
    name = type(_innermost(err)[0]).__name__
    if name.startswith("RayTaskError(") and name.endswith(")"):
        name = name[len("RayTaskError(") : -1]
    return name


def _innermost(err: BaseException) -> tuple[BaseException, str]:
    """The innermost meaningful error of ``err`` and where Ray says it was raised ('' if not)."""
    where = ""
    while True:
        worker_failures = getattr(err, "worker_failures", None)
        if isinstance(worker_failures, dict) and worker_failures:
            err = next(iter(worker_failures.values()))
            continue
        where = _where(err) or where
        cause = getattr(err, "cause", None) or err.__cause__
        if not isinstance(cause, BaseException) or cause is err:
            return err, where
        err = cause


def own_message(err: BaseException) -> str:
    """An exception's message as its raiser wrote it: the lines before the hints Ray Data appends
    (:data:`HINTS`), on one line; a message that holds a traceback, its last line."""
    lines = []
    for line in _ANSI.sub("", str(err)).strip().splitlines():
        if line.startswith(HINTS):
            break
        lines.append(line.strip())
    lines = [line for line in lines if line]
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        lines = lines[-1:]
    text = " ".join(lines)
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def _where(err: BaseException) -> str:
    """For an error Ray raised on behalf of a task or actor (``RayTaskError``): the task and its
    node, as Ray's first line names them (``ray::MapBatches(fn)() (pid=1, ip=10.0.0.2)``)."""
    if not any(t.__name__ == "RayTaskError" for t in type(err).__mro__):
        return ""
    found = _WHERE.search(_ANSI.sub("", str(err)))
    if not found:
        return ""
    return f"Ray task {found['fn']} on node {found['ip']}, pid {found['pid']}"


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


class TrainingError(RuntimeError):
    """A failure that retrying the same run cannot fix (every worker raises it together)."""


class NonFiniteError(TrainingError):
    """A loss or gradient was NaN or infinite."""


class OOMError(TrainingError):
    """Out of memory in forward or backward, beyond what the OOM policy allows."""


class GradSyncError(TrainingError):
    """Workers hold different gradients after DDP's all-reduce: they would drift apart."""


class LossScaleError(TrainingError):
    """The fp16 loss scale fell below its floor: the loss overflows even at a tiny scale."""


class GroupBrokenError(RuntimeError):
    """This worker cannot complete the step's collectives with the others (an OOM while DDP's
    gradient all-reduce was under way): not a :class:`TrainingError`, so Ray restarts the whole
    group from the last checkpoint instead of leaving the others waiting."""


class LossSpikeError(TrainingError):
    """The loss jumped far above its recent mean: the run diverged."""


class ConfigError(ValueError):
    """A configuration value is unknown or invalid. ``key`` is the full dotted key."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.reason = message
        super().__init__(f"{key}: {message}" if key else message)

    def under(self, prefix: str) -> ConfigError:
        """The same error with ``prefix.`` put in front of its key."""
        if not prefix:
            return self
        return ConfigError(f"{prefix}.{self.key}" if self.key else prefix, self.reason)


class EvaluateError(ValueError):
    """What ``evaluate`` was given cannot be evaluated; the message names the path."""


class DataError(ValueError):
    """A data file, directory or column a task needs is missing."""


class SplitError(TrainingError):
    """A batch that cannot be split into micro-batches along its rows (``accum.micro_batch=auto``)."""


class TaskReturnError(TypeError):
    """A task's method returned what the engine cannot take; the message names the method."""


class UploadError(OSError):
    """The store could not be listed or written, or stopped answering."""


class SourceError(ValueError):
    """Bad input in a source, named (the file, the directory, the annotation): nothing was written."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or damaged."""

    refused = False  # set when weights_only refused what the file holds, rather than it being cut or missing
    partial = False  # set when a load failed after it had begun writing into the engine's state


class WeightsError(ValueError):
    """A weights file that cannot be read, or whose tensor does not fit the module (the key named)."""
