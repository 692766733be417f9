"""A console sender that records instead of sending: the events rank 0 and the Train controller
would put on the driver's feed (``raytrain_loops/console/feed.py``), kept in a list for the console
tests to read back, with no feed actor and no Ray."""

from __future__ import annotations

from raytrain_loops.console.feed import Sender


class Recorder(Sender):
    """A sender that keeps the events instead of sending them to a feed."""

    def __init__(self):
        super().__init__(None)
        self.events: list[dict] = []

    def send(self, kind: str, text: str, **data) -> None:
        self.events.append({"kind": kind, "text": text, **data})
