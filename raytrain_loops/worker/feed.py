"""One Ray Data execution read by a training worker: its blocks taken on a thread, so that every wait
for them is bounded and a starved one says what it waits for (:class:`Starvation`), and ended at
once when the worker is done with it (its tasks cancelled).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from raytrain_loops import ray_private

_DONE = object()

CLOSE_S = 0.5
"""The longest :meth:`Execution.close` waits for the reading thread to end."""

KILL_S = 0.05
"""How long :meth:`Execution.close` waits, after Ray Data's forced shutdown, for the processes of the
tasks it killed to be gone. Ray answers a forced cancel before the task's process exits, and that
process runs on meanwhile: a ``preprocess`` call was seen to start up to 1 ms after the shutdown
returned (2 of 14 closes, 2-core machine). With this wait, none in 50 closes (30 on a quiet
machine, 20 beside two busy processes): the latest started 37 ms before close returned."""


@dataclass
class Starvation:
    """What a wait for preprocessed rows does when it is long: after ``warn_after_s`` one line
    through ``say`` (once per execution), after ``timeout_s`` an error; both name what each
    preprocessing task asks for (``ask``) and what the cluster's nodes offer."""

    ask: dict[str, float]
    warn_after_s: float
    timeout_s: float
    say: Callable[[str], None] = print
    warned: bool = field(default=False, init=False)

    def detail(self, waited: float) -> str:
        asked = ", ".join(f"{k} {v:g}" for k, v in self.ask.items() if v)
        return (
            f"no preprocessed rows for {waited:.0f} s: each preprocessing task asks for {asked or 'nothing'} "
            f"(data.preprocess.num_cpus, num_gpus, resources); the cluster's nodes offer {offered(self.ask)}"
        )


def offered(ask: dict[str, float]) -> str:
    """Each alive node's free and total amounts of the resources in ``ask``."""
    free = _available_by_node()
    lines = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        total, here = node["Resources"], free.get(node["NodeID"], {})
        amounts = ", ".join(f"{k} {here.get(k, 0):g} free of {total.get(k, 0):g}" for k in ask if ask[k] or k == "CPU")
        lines.append(f"{node['NodeManagerAddress']} ({amounts})")
    return "; ".join(lines) or "no alive node"


def _available_by_node() -> dict[str, dict[str, float]]:
    """Each node's available resources, where Ray tells them per node (else none: totals only)."""
    per_node = ray_private.available_resources_per_node()
    try:
        return per_node() if per_node is not None else {}
    except Exception:  # a Ray without it: the line gives the totals and 0 free
        return {}


POLL_S = 0.05
"""How often a wait in :meth:`Execution.next` looks whether it was interrupted."""


class Execution:
    """``dataset``'s blocks (column name -> NumPy array) in order, read by a thread into a queue
    of ``depth`` blocks while the step runs; :meth:`next` waits under ``starvation``'s bounds,
    counted while ``wanted`` is set: always, unless the blocks are taken on a thread that works
    ahead of the loop, which sets it while the loop waits for that thread (a wait of the thread
    while the loop evaluates is not the loop's). :meth:`interrupt` ends a wait at once."""

    def __init__(self, dataset: Any, starvation: Starvation, depth: int = 1):
        self.dataset, self.starvation = dataset, starvation
        self.wanted = threading.Event()
        self.wanted.set()
        self._interrupted = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._read_all = threading.Event()  # every block read: no task left to kill
        self._thread = threading.Thread(target=self._fill, name="preprocess-feed", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            for block in self.dataset.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=0):
                while not self._stop.is_set():
                    try:
                        self._queue.put(block, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._read_all.set()
            self._queue.put(_DONE)
        except BaseException as err:  # handed to the consumer, raised there
            if not self._stop.is_set():
                self._queue.put(err)

    def next(self) -> dict[str, Any] | None:
        """The next block, or None at the execution's end, once it is closed, or once a wait is
        :meth:`interrupt` -ed (the block is then left for the next call)."""
        s, waited, last = self.starvation, 0.0, time.monotonic()
        while True:
            if self._interrupted.is_set() or self._stop.is_set():
                return None
            now = time.monotonic()
            waited += now - last if self.wanted.is_set() else 0.0
            last = now
            if waited >= s.timeout_s:
                self.close()
                raise TimeoutError(f"{s.detail(waited)} (data.preprocess.timeout_s={s.timeout_s:g})")
            if not s.warned and waited >= s.warn_after_s:
                s.warned = True
                s.say(f"preprocessing: {s.detail(waited)}")
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is _DONE:
                return None
            if isinstance(item, BaseException):
                raise item
            return item

    def interrupt(self) -> None:
        """End the wait of a :meth:`next` call now, and of the calls after it until :meth:`resume`
        (a reader that closed its stream while its thread waited for a block)."""
        self._interrupted.set()

    def resume(self) -> None:
        """Let :meth:`next` wait again (a new stream of the same execution)."""
        self._interrupted.clear()

    def close(self) -> None:
        """End the execution now: its tasks cancelled, the thread ended."""
        if self._stop.is_set():
            return
        self._stop.set()
        executor = ray_private.current_executor(self.dataset)  # Ray Data's, once it started
        if executor is not None:
            with contextlib.suppress(Exception):  # already shut down, or a Ray Data that shuts down otherwise
                executor.shutdown(force=True)
            if not self._read_all.is_set():  # tasks were killed: time for their processes to end
                time.sleep(KILL_S)
        # The thread ends once the executor is down; one blocked in a wait that the shutdown does
        # not wake (no block ever came) is left behind (a daemon): this returns within a second.
        deadline = time.monotonic() + CLOSE_S
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(0.05)
