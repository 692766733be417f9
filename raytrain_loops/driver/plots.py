"""A PNG of a run's curves: training loss, learning rate and evaluation metrics (scores apart
from losses and errors) against the step."""

from __future__ import annotations

import json
import os


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_run(run_dir: str) -> str | None:
    """Write ``curves.png`` from ``metrics.jsonl``, ``epochs.jsonl`` and ``eval.jsonl``; return its path."""
    steps = [r for r in _read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if r.get("applied")]
    evals = _read_jsonl(os.path.join(run_dir, "eval.jsonl"))
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter

    # The model's metrics before its EMA's, so each keeps its colour from panel to panel.
    names = sorted({k for r in evals for k in r if k.startswith("eval_")}, key=lambda n: (n.startswith("eval_ema_"), n))
    series = {n: [(r["step"], r[n]) for r in evals if isinstance(r.get(n), int | float)] for n in names}
    # Scores (accuracy, mAP, IoU: higher is better) apart from losses and errors, whose scale
    # would flatten them.
    lower_is_better = ("loss", "error", "bpb", "bpt")
    others = [n for n in names if series[n] and any(w in n for w in lower_is_better)]
    scores = [n for n in names if series[n] and n not in others]
    panels = [("evaluation: scores", scores), ("evaluation: losses and errors", others)]
    panels = [p for p in panels if p[1]] or [("evaluation", [])]
    fig, axes = plt.subplots(1, 2 + len(panels), figsize=(5 * (2 + len(panels)), 4))
    x = [r["step"] for r in steps]
    axes[0].plot(x, [r["loss"] for r in steps], lw=0.8, label="each step (rank 0)")
    epochs = [e for e in _read_jsonl(os.path.join(run_dir, "epochs.jsonl")) if "train_loss" in e]
    if epochs:
        ends = [e["step"] for e in epochs]
        axes[0].plot(ends, [e["train_loss"] for e in epochs], marker="o", label="epoch average (all workers)")
        axes[0].legend(fontsize=8)
    axes[0].set(title="training loss", xlabel="step", yscale="log")
    # Plain tick labels ("0.5", "2"): matplotlib's default on a log axis typesets each one as TeX
    # ("$10^{-1}$"), which took a third of the figure's time.
    axes[0].yaxis.set_major_formatter(LogFormatter())
    axes[0].yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.4)))
    axes[1].plot(x, [r["lr"] for r in steps])
    axes[1].set(title="learning rate", xlabel="step")
    for ax, (title, group) in zip(axes[2:], panels, strict=True):
        for name in group:
            ax.plot(*zip(*series[name], strict=True), marker="o", label=name)
        ax.set(title=title, xlabel="step")
        if group:
            ax.legend(fontsize=8)
    # Fixed margins: tight_layout measured every tick label's extent, the other half of the time.
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.12, top=0.92, wspace=0.22)
    out = os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
