"""``Announcer``, a Ray Train controller callback; runs in the Train controller's process. It sends
the console one line for each checkpoint Ray registered and for each worker failure, saying
whether the run restarts.
"""

from __future__ import annotations

from typing import Any

from ray.train.v2.api.callback import UserCallback

from raytrain_loops.console.feed import Sender
from raytrain_loops.driver.errors import root_cause


class Announcer(UserCallback):
    """In the Train controller: one line for each checkpoint Ray registered and for each worker
    failure, saying whether the run restarts."""

    def __init__(self, sender: Sender, max_failures: int):
        self.sender, self.max_failures, self.failures = sender, max_failures, 0

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if checkpoint is not None:
            self.sender.checkpoint(metrics[0].get("step"), checkpoint.path)

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        self.failures += 1
        if self.max_failures < 0 or self.failures <= self.max_failures:
            limit = "unlimited" if self.max_failures < 0 else str(self.max_failures)
            then = f"restarting from the newest checkpoint (retry {self.failures} of {limit})"
        else:
            then = "no retries left (run.max_failures)"
        for rank, err in sorted(worker_exceptions.items()):
            self.sender.send("failure", f"worker {rank} failed: {root_cause(err)}; {then}")
