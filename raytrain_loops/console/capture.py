"""The run's console; runs on the driver: one live display (:mod:`raytrain_loops.console.display`)
of what rank 0 and the Train controller send, and Ray's own output moved into ``<run>/ray.log``.

Events reach the driver through a small Ray actor that the driver creates (:class:`Feed`):
rank 0's run log and the controller's callback call it without waiting, and a thread of the
driver drains it. It needs nothing but the cluster the run is on, so it works alike for a local
run, a ``ray job submit`` job (whose entrypoint is the driver) and a run directory on an object
store (which rank 0 only uploads at checkpoints, too late to follow).

Everything Ray prints goes to ``ray.log``: the workers' and actors' forwarded output (the
controller's resource requests, each report), Ray's loggers on the
driver, its warnings. A forwarded line starting with ``warning:`` (this project's own warnings,
e.g. a damaged checkpoint skipped) is shown as well. Of the raylet's messages, one on memory or a
kill is shown by its first line and where the rest is; a worker's death is left to the Train
controller's one line (:mod:`raytrain_loops.console.deaths`), and Ray's text of it goes to
``ray.log`` only.
``logging.verbose`` leaves Ray's output as Ray prints it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout, suppress
from typing import Any

from raytrain_loops import ray_private, storage
from raytrain_loops.console.deaths import raylet_line
from raytrain_loops.console.display import Display
from raytrain_loops.console.feed import Feed, Sender
from raytrain_loops.errors import root_cause

RAY_LOGGERS = ("ray", "ray.data", "ray.train", "ray.tune", "ray.air", "ray.serve", ray_private.LOGGER)
DISPATCH_HANDLER = "ray_print_logs"  # the name Ray gives its handler of forwarded output
ANSI = re.compile(r"\x1b\[[0-9;]*m")
POLL_S = 0.3


class RayLog:
    """``ray.log``: a local file, or a scratch copy uploaded to a run directory on a store."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.remote = storage.is_uri(run_dir)
        local_dir = storage.scratch_dir("console") if self.remote else run_dir
        os.makedirs(local_dir, exist_ok=True)
        self.path = os.path.join(local_dir, "ray.log")
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 -- closed in close()
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(ANSI.sub("", text).rstrip("\n") + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()
        if self.remote:
            with open(self.path) as f:
                storage.write_text(storage.join(self.run_dir, "ray.log"), f.read())
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


class _PrintsToRayLog:
    """A stream for ``print``: whole lines to ``ray.log``."""

    def __init__(self, log: RayLog):
        self.log, self._pending = log, ""

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            if line.strip():
                self.log.write(line)
        return len(text)

    def flush(self) -> None:
        if self._pending.strip():
            self.log.write(self._pending)
        self._pending = ""


class _ToRayLog(logging.Handler):
    def __init__(self, log: RayLog):
        super().__init__()
        self.log = log
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s -- %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.log.write(self.format(record))
        except Exception:
            self.handleError(record)


def _autoscaler_events(lines: list[str]) -> list[str]:
    """The events among the autoscaler's lines, as Ray keeps them (all of them when Ray's filter
    is not where this expects)."""
    events = ray_private.autoscaler_event_filter()
    return lines if events is None else list(events(lines))


def _from_ray(category: type, filename: str) -> bool:
    import ray

    return category.__name__ == "RayDeprecationWarning" or filename.startswith(os.path.dirname(ray.__file__))


class Console:
    """The driver's console for one run: the display, its feed, and Ray's output moved to
    ``ray.log`` (unless ``verbose``). ``with Console(...)`` before Ray starts (``ray.init``'s own
    lines go to ``ray.log`` too); :meth:`start` once Ray is up."""

    def __init__(self, run_dir: str, verbose: bool = False, display: Display | None = None):
        self.run_dir, self.verbose = run_dir, verbose
        self.display = display or Display()
        self.log: RayLog | None = None
        self.feed = None
        self._saved_loggers: dict[str, tuple[list, bool]] = {}
        self._dispatcher: Any = None  # Ray's dispatcher of forwarded output, while diverted
        self._saved_print: tuple[Any, Any] | None = None  # Ray's printer of the raylet's messages, while diverted
        self._saved_dispatch: list = []
        self._showwarning: Callable | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Console:
        if not self.verbose:
            self.log = RayLog(self.run_dir)
            self._route_loggers()
            self._route_warnings()
        return self

    def start(self) -> Sender:
        """Once Ray is up: divert the forwarded output, start the feed (an actor on this node);
        returns the sender that rank 0 and the controller use."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.divert_forwarded()
        # On the driver's node: losing any other node (a preemption) never silences the console.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.feed = ray.remote(num_cpus=0, scheduling_strategy=here)(Feed).remote()
        self._thread = threading.Thread(target=self._drain, name="raytrain_loops-console", daemon=True)
        self._thread.start()
        return Sender(self.feed)

    def _drain(self) -> None:
        while not self._stop.wait(POLL_S):
            self._show_pending()

    def _show_pending(self) -> None:
        import ray

        try:
            events = ray.get(self.feed.take.remote(), timeout=30)
        except Exception as err:  # the display must never end the run
            self._to_log(f"console feed: {type(err).__name__}: {err}")
            return
        for event in events:
            self.display.show(self._logged(event))

    def _logged(self, event: dict[str, Any]) -> dict[str, Any]:
        """An event as shown: Ray's text that came with it (a worker's death) written to
        ``ray.log``, and the pointer to it where the line could not say what happened."""
        if event.get("detail"):
            self._to_log(f"{event['text']}\n{event['detail']}")
        if event.get("see_log") and self.log is not None:
            return {**event, "text": f"{event['text']}; {self._details()}"}
        return event

    def _details(self) -> str:
        return f"details in {storage.join(self.run_dir, 'ray.log')}"

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._show_pending()
            import ray

            ray.kill(self.feed)
        self.display.close()
        self._restore()
        if self.log is not None:
            self.log.close()
            if exc[0] is not None:
                self.display.line(f"Ray's output of this run: {storage.join(self.run_dir, 'ray.log')}")

    def _to_log(self, text: str) -> None:
        if self.log is not None:
            self.log.write(text)

    def _route_loggers(self) -> None:
        import ray  # noqa: F401 -- Ray sets its loggers' handlers when imported: routed before, they would be undone

        handler = _ToRayLog(self.log)
        for name in RAY_LOGGERS:
            logger = logging.getLogger(name)
            self._saved_loggers[name] = (list(logger.handlers), logger.propagate)
            logger.handlers = [handler]
            logger.propagate = False

    def _route_warnings(self) -> None:
        shown = warnings.showwarning
        self._showwarning = shown

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if _from_ray(category, filename):
                self._to_log(f"{filename}:{lineno}: {category.__name__}: {message}")
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning

    @contextmanager
    def prints_to_log(self) -> Iterator[None]:
        """What the block prints to ``sys.stdout`` (Ray Tune's own lines on the driver: its box of
        the experiment's configuration, its TensorBoard hint into Ray's temporary directory, its
        status tables) goes to ``ray.log`` (unless ``verbose``). The display keeps the stream it
        was made with."""
        if self.log is None:
            yield
            return
        stream = _PrintsToRayLog(self.log)
        try:
            with redirect_stdout(stream):
                yield
        finally:
            stream.flush()

    def divert_forwarded(self) -> None:
        """Once Ray is up: the workers' forwarded output to ``ray.log`` (unless ``verbose``).

        Ray's handler of the workers' forwarded output is replaced by one writing to
        ``ray.log``. Ray has no public switch for where it goes, only on or off
        (``log_to_driver``), and off would lose it from ``ray.log`` too. The handler lives in a
        private module of Ray (:func:`raytrain_loops.ray_private.stdstream_dispatcher`): when it is
        not where and what this expects (another Ray version), Ray's own handler stays and the
        output is shown as Ray prints it."""
        if self.verbose or self._dispatcher is not None:
            return
        dispatcher = ray_private.stdstream_dispatcher()
        if dispatcher is None:  # said in ray.log by the door
            return
        try:
            with dispatcher._lock:
                before = list(dispatcher.handlers)
                saved = [(name, handler) for name, handler in before if name == DISPATCH_HANDLER]
        except Exception as err:
            self._to_log(f"console: Ray's forwarded output is shown as Ray prints it ({root_cause(err)})")
            return
        try:
            dispatcher.remove_handler(DISPATCH_HANDLER)
            dispatcher.add_handler(DISPATCH_HANDLER, self._forwarded)
        except Exception as err:
            with suppress(Exception), dispatcher._lock:
                dispatcher.handlers = before
            self._to_log(f"console: Ray's forwarded output is shown as Ray prints it ({root_cause(err)})")
            return
        self._dispatcher, self._saved_dispatch = dispatcher, saved
        self._divert_raylet_messages()

    def _divert_raylet_messages(self) -> None:
        """The raylet's messages to the driver (``(raylet) WARNING: 12 PYTHON worker processes
        have been started...``) to ``ray.log`` too: Ray prints them straight to stdout from its
        error listener (:func:`raytrain_loops.ray_private.raylet_printer`), not through the
        dispatcher. Left alone when that function is not where this expects it."""
        ray_worker = ray_private.raylet_printer()
        if ray_worker is None:  # said in ray.log by the door
            return
        original = ray_worker.print_to_stdstream

        def routed(data: dict[str, Any], ignore_prefix: bool) -> None:
            if isinstance(data, dict) and data.get("pid") == "raylet":
                self._raylet_message(data)
            else:
                original(data, ignore_prefix)

        ray_worker.print_to_stdstream = routed
        self._saved_print = (ray_worker, original)

    def _raylet_message(self, data: dict[str, Any]) -> None:
        """Ray's error listener calls this for each of the raylet's messages, in a loop that an
        exception ends (and every later message with it: the out-of-memory kills), so none
        leaves: one that cannot be shown is noted in ``ray.log`` instead."""
        try:
            self._forwarded({**data, "actor_name": "raylet"})
            for message in data.get("lines", []):
                shown = raylet_line(ANSI.sub("", message))  # memory running out: the user's to see
                if shown:
                    self.display.line(f"{shown}; {self._details()}" if self.log is not None else shown)
        except Exception as err:
            with suppress(Exception):
                self._to_log(f"console: a message of the raylet could not be shown ({root_cause(err)}): {data!r:.2000}")

    def _forwarded(self, data: dict[str, Any]) -> None:
        """Ray's log thread calls this for each batch of a process's lines: an exception here
        would end that thread, and all forwarding with it, so none leaves."""
        try:
            self._forward(data)
        except Exception as err:
            with suppress(Exception):
                self._to_log(
                    f"console: a batch of forwarded output could not be shown ({root_cause(err)}): {data!r:.2000}"
                )

    def _forward(self, data: dict[str, Any]) -> None:
        lines = data.get("lines", [])
        if data.get("pid") == "autoscaler":  # its status every few seconds; Ray keeps the events only
            lines = _autoscaler_events(lines)
        source = data.get("actor_name") or data.get("task_name") or "worker"
        prefix = f"({source} pid={data.get('pid')}{', ip=' + str(data.get('ip')) if data.get('ip') else ''})"
        for line in lines:
            self._to_log(f"{prefix} {line}")
            if ANSI.sub("", line).lstrip().startswith("warning:"):
                self.display.line(ANSI.sub("", line).strip())

    @staticmethod
    def _put_back(dispatcher: Any, saved: list) -> None:
        """Ray's own handler back in place of this console's."""
        with suppress(Exception):
            dispatcher.remove_handler(DISPATCH_HANDLER)
            for name, handler in saved:
                dispatcher.add_handler(name, handler)

    def _restore(self) -> None:
        for name, (handlers, propagate) in self._saved_loggers.items():
            logger = logging.getLogger(name)
            logger.handlers, logger.propagate = handlers, propagate
        self._saved_loggers.clear()
        if self._showwarning is not None:
            warnings.showwarning = self._showwarning
            self._showwarning = None
        if self._dispatcher is not None:
            self._put_back(self._dispatcher, self._saved_dispatch)
            self._dispatcher, self._saved_dispatch = None, []
        if self._saved_print is not None:
            module, original = self._saved_print
            module.print_to_stdstream = original
            self._saved_print = None
