"""``raytrain-loops export <checkpoint> <dir> --format hf``: a checkpoint of a run of the ``hf_lm``
task as a directory that ``transformers`` loads (``AutoModelForCausalLM.from_pretrained``,
``AutoTokenizer.from_pretrained``). The run's ``config.yaml`` (beside the checkpoint, or one level
up for a copy in ``best/``) names the task; the tokenizer is the run's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raytrain_loops.config import ConfigError, load_config
from raytrain_loops.engine.checkpoint import whole_model
from raytrain_loops.tasks import build_task


def run_config_path(checkpoint: Path) -> Path:
    for directory in (checkpoint.parent, checkpoint.parent.parent):
        if (directory / "config.yaml").exists():
            return directory / "config.yaml"
    raise FileNotFoundError(f"no config.yaml of the run beside {checkpoint} or one level up")


def export_hf(checkpoint: str | Path, out: str | Path, ema: bool = False) -> dict[str, Any]:
    """Write ``out`` from ``checkpoint`` (its EMA's weights with ``ema``); returns the counters."""
    checkpoint = Path(checkpoint).expanduser().resolve()
    config = load_config(str(run_config_path(checkpoint)))
    task = build_task(config.task.name, config.task.params)
    if not hasattr(task, "export_pretrained"):
        raise ConfigError("task.name", f"{config.task.name!r} has no Hugging Face export (--format hf is hf_lm's)")
    task.load_tokenizer(task.tokenizer_at(Path(config.data.dir).expanduser().resolve()))
    written = whole_model(checkpoint)
    weights = written["ema"] if ema else written["model"]
    if weights is None:
        raise ConfigError("ema.enabled", f"{checkpoint} holds no EMA weights")
    task.export_pretrained(weights, out)
    return written["counters"]
