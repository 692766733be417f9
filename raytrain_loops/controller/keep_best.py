"""``KeepBest``, a Ray Train controller callback; runs in the Train controller's process (on the
driver's node). It keeps the best ``checkpoint.keep`` checkpoints by ``checkpoint.score_metric``
in the run directory's ``best/``, with ``best.json`` ranking them.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ray.train.v2.api.callback import UserCallback

from raytrain_loops import storage
from raytrain_loops.engine import checkpoint as ckpt_files

BEST = "best"



def ranked(entries: list[dict[str, Any]], mode: str, k: int | None) -> list[dict[str, Any]]:
    """The best ``k`` (all when None) of ``entries`` ({checkpoint, step, score}), best first;
    of equal scores the newer first. An entry without a numeric score (the metric was not
    reported yet, or is NaN) is never among them."""
    scored = [e for e in entries if isinstance(e["score"], int | float) and not math.isnan(e["score"])]
    sign = -1.0 if mode == "max" else 1.0
    scored.sort(key=lambda e: (sign * e["score"], -ckpt_files.order_key(e["checkpoint"])[0], e["checkpoint"]))
    return scored if k is None else scored[:k]



class KeepBest(UserCallback):
    """Keeps the best checkpoints by ``checkpoint.score_metric`` in ``<run>/best/``.

    Ray's own retention stays by recency, so the newest checkpoint and the one before it (the
    fallback when the newest is damaged) are always there. After each checkpoint Ray registers
    (in the Train controller), this ranks it by the metric of the same report and, when it is
    among the best ``keep``, links (a local run) or copies (an object store, server side) it to
    ``best/<name>``, dropping the copy that fell out. ``best/best.json`` lists them, best first.
    With ``keep=0`` every checkpoint stays where it is and ``best.json`` ranks them in place.
    """

    def __init__(self, run_dir: str, metric: str, mode: str, keep: int):
        self.run_dir, self.metric, self.mode, self.keep = run_dir, metric, mode, keep or None

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if checkpoint is None:
            return
        try:
            self._rank(metrics[0] if metrics else {}, storage.name(checkpoint.path))
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
