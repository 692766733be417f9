"""A training worker's death, as a user reads it: which worker, on which node, how it died (killed
or crashed, out of memory, its node gone) in one short line; Ray's full text goes to ``ray.log``.

Ray reports a death in text only: the Train controller's failed health check
(``WorkerHealthCheckFailedError``: "Worker info: Worker(... ActorMetadata(node_id=..., node_ip=...,
pid=...))" and the ``ActorDiedError`` it caught, whose text holds the GCS's death cause, "Worker exit
type: SYSTEM_ERROR Worker exit detail: ..."), and the raylet's message to the driver for a worker
that died running a task. The shapes parsed here are Ray 2.60's: a kill, an exit, the memory
monitor's kill and a node's end as ``tests/support/fixtures/ray_deaths.json`` keeps them (captured from
Ray), the rest as Ray's source words them; a shape not recognised is shown by its first line,
shortened, with the pointer to ``ray.log``. Ray-free: the errors are told by their class
names, as :mod:`raytrain_loops.errors` tells ``RayTaskError``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_FIRST_LINE = 120

# Where Ray's texts name a node: the controller's worker metadata, the actor's death cause, the
# memory monitor's "Memory on the node (IP: ..., ID: ...)".
_NODE_ID = re.compile(r"node_id='(?P<id>[0-9a-f]+)'|Node I[Dd]: (?P<id2>[0-9a-f]+)|\(IP: [^,\s]+, ID: (?P<id3>[0-9a-f]+)\)")
_NODE_IP = re.compile(r"node_ip='(?P<ip>[^']+)'|^\s*ip: (?P<ip2>\S+)$|\(IP: (?P<ip3>[^,\s]+), ID: ", re.MULTILINE)
_EXIT_CODE = re.compile(r"Worker exits with an exit code (\d+)")
_MEMORY = re.compile(r"was ([\d.]+)GB used / ([\d.]+)GB limit")
_NODE_GONE = re.compile(r"the actor's node was (.+)$", re.MULTILINE)
_HANGING = re.compile(r"health check has been hanging for ([\d.]+) seconds")
RAYLET_DEATH = "A worker died or was killed while executing a task"
"""The start of the raylet's message for a worker that died running a task: a training worker's
death is the controller's line; a preprocessing task's is retried by Ray (and named in the run's
error if it fails for good), so this message goes to ``ray.log`` only."""

SUDDEN = "its process ended at once: a signal such as SIGKILL or SIGSEGV"
"""Ray's words for a process that ended without a word to its raylet do not tell a signal from a
crash (nor which signal): the line says both."""

DEATHS = {"RayActorError", "OutOfMemoryError", "NodeDiedError"}
"""Ray's errors for a call on an actor that died: ``ActorDiedError`` (a ``RayActorError``), or,
for the call the memory monitor's kill ended, ``OutOfMemoryError``; ``NodeDiedError`` for its node."""

# What the GCS's death cause says, in order, and what the line says of it.
_CAUSES = (
    ("NODE_OUT_OF_MEMORY", "ran out of memory (the raylet killed it{memory})"),
    ("running low on memory", "ran out of memory (the raylet killed it{memory})"),
    ("Worker exits with an exit code", "exited with code {code}"),
    ("unexpectedly exits with a connection error code", f"was killed or crashed ({SUDDEN})"),
    ("its node has died", "was lost with its node ({node})"),
    ("killed by `ray.kill`", "was stopped by ray.kill"),
    ("its owner has died", "was lost with its owner (the Train controller)"),
    ("Worker exits by an user request", "exited (code 0) while training"),
    ("is unavailable: ", "could not be reached (Ray holds it unavailable)"),
)


@dataclass(frozen=True)
class Death:
    """One worker's death: where and how."""

    node_ip: str
    node_id: str
    how: str
    known: bool  # False: ``how`` is Ray's first line, shortened (a shape this module does not know)

    def line(self, rank: int) -> str:
        """``worker 1 on node 10.0.0.3 (a1b2c3d4) was killed or crashed (...)``."""
        node = f" on node {self.node_ip}" if self.node_ip else ""
        if self.node_id:
            node += f" ({self.node_id[:8]})" if node else f" on node {self.node_id[:8]}"
        return f"worker {rank}{node} {self.how}"


def _class_names(err: BaseException) -> set[str]:
    return {t.__name__ for t in type(err).__mro__}


def death(err: BaseException) -> Death | None:
    """A training worker's death as the Train controller hands it over (a failed or hanging
    health check on a dead actor), or None for an error the worker raised itself."""
    names = _class_names(err)
    if "WorkerHealthCheckTimeoutError" in names:
        hanging = _HANGING.search(str(err))
        seconds = f" for {float(hanging[1]):.0f} s" if hanging else ""
        return _where(str(err), f"stopped answering Ray's health checks{seconds} and was marked dead", True)
    failure = getattr(err, "health_check_failure", None)
    actor_error = failure if isinstance(failure, BaseException) else err
    if not DEATHS & _class_names(actor_error):
        return None
    how, known = _how(str(actor_error))
    return _where(str(err), how, known)


def _how(cause: str) -> tuple[str, bool]:
    """What the GCS's death cause says happened, or its first line (shortened) when unknown."""
    for marker, how in _CAUSES:
        if marker in cause:
            code, memory, gone = _EXIT_CODE.search(cause), _MEMORY.search(cause), _NODE_GONE.search(cause)
            used = f": {float(memory[1]):.1f} of {float(memory[2]):.1f} GB in use on its node" if memory else ""
            node = f"the node was {gone[1].strip()}" if gone else "the node died"
            return how.format(code=code[1] if code else "?", memory=used, node=node), True
    # Ray's first line of an ActorDiedError is always its BASE_ERROR_MSG, then the actor's details
    # (tab-indented): the cause is the first line after them.
    said = [line for line in cause.splitlines() if line.strip() and not line.startswith("\t")]
    said = [line for line in said if line.strip() != "The actor died unexpectedly before finishing this task."]
    return f"died: {first_line(said[0] if said else cause).rstrip('.')}", False


def _where(text: str, how: str, known: bool) -> Death:
    node_id, node_ip = _NODE_ID.search(text), _NODE_IP.search(text)
    return Death(
        node_ip=next((g for g in node_ip.groups() if g), "") if node_ip else "",
        node_id=next((g for g in node_id.groups() if g), "") if node_id else "",
        how=how,
        known=known,
    )


def deaths(worker_exceptions: dict[int, BaseException]) -> dict[int, Death]:
    """The deaths among a failure's worker errors, by rank (the other workers' errors, when a
    worker died, are what losing it caused: a broken collective)."""
    found = {rank: death(err) for rank, err in worker_exceptions.items()}
    return {rank: d for rank, d in sorted(found.items()) if d is not None}


def first_line(text: str) -> str:
    """A message's first non-empty line, cut to :data:`MAX_FIRST_LINE` characters."""
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return line if len(line) <= MAX_FIRST_LINE else line[: MAX_FIRST_LINE - 3] + "..."


def raylet_line(message: str) -> str | None:
    """What the console shows of one of the raylet's messages to the driver: a worker's death,
    nothing (:data:`RAYLET_DEATH`); another message on memory or a kill, its first line (the
    caller adds where the rest is); any other message, nothing."""
    if message.lstrip().startswith(RAYLET_DEATH):
        return None
    if re.search(r"memory|killed", message, re.IGNORECASE):
        return f"(raylet) {first_line(message)}"
    return None
