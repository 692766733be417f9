"""A pickle that would run code: an object whose unpickling runs a shell command that creates a
marker file, for the tests that every checkpoint file is read weights-only (the marker stays absent)
and that unrestricted unpickling, the control, would run it."""

from __future__ import annotations

import os


class Exploit:
    """Unpickling this would run a shell command that creates a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))
