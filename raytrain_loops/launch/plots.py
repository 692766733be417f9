"""A PNG of a run's curves: training loss, learning rate and evaluation metrics against the step."""

from __future__ import annotations

import json
import os


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_run(run_dir: str) -> str | None:
    """Write ``curves.png`` from ``metrics.jsonl`` and ``eval.jsonl``; return its path."""
    steps = [r for r in _read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if r.get("applied")]
    evals = _read_jsonl(os.path.join(run_dir, "eval.jsonl"))
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    x = [r["step"] for r in steps]
    axes[0].plot(x, [r["loss"] for r in steps], lw=0.8)
    axes[0].set(title="training loss", xlabel="step", yscale="log")
    axes[1].plot(x, [r["lr"] for r in steps])
    axes[1].set(title="learning rate", xlabel="step")
    names = sorted({k for r in evals for k in r if k.startswith("eval_")})
    for name in names:
        pts = [(r["step"], r[name]) for r in evals if name in r]
        axes[2].plot(*zip(*pts, strict=True), marker="o", label=name)
    axes[2].set(title="evaluation", xlabel="step")
    if names:
        axes[2].legend(fontsize=8)
    fig.tight_layout()
    out = os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
