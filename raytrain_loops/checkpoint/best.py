"""The best checkpoints of a run by ``checkpoint.score_metric``, kept in the run directory's
``best/`` with ``best.json`` ranking them; without Ray. Ray's Train controller runs it after each
checkpoint it registers (:class:`~raytrain_loops.checkpoint.ray_keep_best.KeepBest`), a local run after
each checkpoint it writes."""

from __future__ import annotations

import json
import math
from typing import Any

from raytrain_loops import storage
from raytrain_loops.checkpoint import files as ckpt_files

BEST = "best"


def ranked(entries: list[dict[str, Any]], mode: str, k: int | None) -> list[dict[str, Any]]:
    """The best ``k`` (all when None) of ``entries`` ({checkpoint, step, score}), best first;
    of equal scores the newer first. An entry without a numeric score (the metric was not
    reported yet, or is NaN) is never among them."""
    scored = [e for e in entries if isinstance(e["score"], int | float) and not math.isnan(e["score"])]
    sign = -1.0 if mode == "max" else 1.0
    scored.sort(key=lambda e: (sign * e["score"], -ckpt_files.order_key(e["checkpoint"])[0], e["checkpoint"]))
    return scored if k is None else scored[:k]


class BestCheckpoints:
    """Ranks each new checkpoint by the metric of the same report and, when it is among the best
    ``keep``, links (a local run directory) or copies (an object store, server side) it to
    ``best/<name>``, dropping the copy that fell out. ``best/best.json`` lists them, best first.
    With ``keep=0`` every checkpoint stays where it is and ``best.json`` ranks them in place.
    """

    def __init__(self, run_dir: str, metric: str, mode: str, keep: int):
        self.run_dir, self.metric, self.mode, self.keep = run_dir, metric, mode, keep or None

    def add(self, metrics: dict[str, Any], name: str) -> None:
        """Rank checkpoint ``name`` by ``metrics``, the report it came with."""
        try:
            self._rank(metrics, name)
        except Exception as err:  # the best copies are a convenience: a storage hiccup must not end the run
            print(f"warning: could not update {storage.join(self.run_dir, BEST)}: {err}", flush=True)

    def _rank(self, metrics: dict[str, Any], name: str) -> None:
        score = metrics.get(self.metric)
        if self.metric.startswith("eval_") and metrics.get("evaluated_step") != metrics.get("step"):
            score = None  # the report carries an earlier step's evaluation: these weights were not evaluated
        index = storage.join(self.run_dir, BEST, "best.json")
        before = json.loads(storage.read_text(index) or "[]")
        entry = {"checkpoint": name, "step": ckpt_files.step_of(name), "score": score}
        best = ranked([e for e in before if e["checkpoint"] != name] + [entry], self.mode, self.keep)
        if self.keep is not None:
            kept = {e["checkpoint"] for e in best}
            if name in kept:
                storage.copy_tree(storage.join(self.run_dir, name), storage.join(self.run_dir, BEST, name))
            for old in before:
                if old["checkpoint"] not in kept:
                    storage.delete_tree(storage.join(self.run_dir, BEST, old["checkpoint"]))
        for e in best:
            e["path"] = storage.join(self.run_dir, *([BEST] if self.keep else []), e["checkpoint"])
        storage.write_text(index, json.dumps(best, indent=1) + "\n")
