"""The console's display; runs on the driver (or in the calling process). Ray-free: a bar redrawn
in place on a terminal, plain lines elsewhere, fed with the events rank 0 and the Train
controller send (``progress``, ``epoch``, ``eval``, ``checkpoint``, ``failure``, ``start``).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, TextIO


def _tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False



class Display:
    """Shows events: on a terminal, a progress bar holding rank 0's progress line, redrawn in
    place, with every other event as a line above it; elsewhere (CI, a job's log) every event as
    a plain line, the progress line once per ``logging.every_steps``."""

    def __init__(self, stream: TextIO | None = None, live: bool | None = None):
        self.stream = stream or sys.stdout
        self.live = _tty(self.stream) if live is None else live
        self.bar = None
        # The feed's thread, Ray's log thread (a forwarded warning) and the driver all show lines.
        self._lock = threading.RLock()

    def show(self, event: dict[str, Any]) -> None:
        with self._lock:
            if event.get("kind") == "progress" and self.live:
                self._progress(event)
            else:
                self.line(event["text"])

    def _progress(self, event: dict[str, Any]) -> None:
        from tqdm import tqdm

        total = int(event.get("total") or 0) or None
        if self.bar is None:
            self.bar = tqdm(total=total, file=self.stream, bar_format="{bar:16}| {desc}", dynamic_ncols=True)
        self.bar.total = total
        self.bar.n = int(event.get("step") or 0)
        self.bar.set_description_str(event["text"], refresh=False)
        self.bar.refresh()

    def line(self, text: str) -> None:
        with self._lock:
            if self.bar is not None:
                self.bar.write(text, file=self.stream)
            else:
                print(text, file=self.stream, flush=True)

    def close(self) -> None:
        with self._lock:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
