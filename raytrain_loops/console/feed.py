"""The console's feed: the actor that rank 0 and the Train controller send events to, and the
sender they hold. Only the standard library here: the feed is an actor process of its own,
started for every run, and importing torch or Ray Train in it would cost seconds of start-up."""

from __future__ import annotations

from typing import Any

__all__ = ["Feed", "Sender"]


class Feed:
    """The actor between the processes that send events (rank 0, the Train controller) and the
    driver that shows them. Events are dicts with ``kind`` and ``text``."""

    def __init__(self) -> None:
        self._events: list[dict[str, Any]] = []

    def put(self, event: dict[str, Any]) -> None:
        self._events.append(event)

    def take(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events


class Sender:
    """What a worker or the controller holds: sends events to the driver's feed without waiting
    for them, or prints them when there is no feed (a run without a driver display)."""

    def __init__(self, feed: Any | None):
        self.feed = feed
        self._last = None

    def send(self, kind: str, text: str, **data: Any) -> None:
        if self.feed is None:
            print(text, flush=True)
            return
        self._last = self.feed.put.remote({"kind": kind, "text": text, **data})

    def checkpoint(self, step: Any, path: str) -> None:
        """The line for a checkpoint saved (by Ray's controller, or by a local run)."""
        self.send("checkpoint", f"checkpoint at step {step}: {path}")

    def flush(self, timeout: float = 5.0) -> None:
        """Wait (up to ``timeout``) until the driver's feed holds every event sent: a process
        that ends right after sending would otherwise lose the last ones."""
        if self._last is not None:
            import ray

            ray.wait([self._last], timeout=timeout)

    def __getstate__(self) -> dict[str, Any]:
        return {"feed": self.feed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["feed"])
