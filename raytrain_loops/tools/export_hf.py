"""``raytrain-loops export <checkpoint> <dir> --format hf``: a checkpoint of a run that pinned a
Hugging Face model configuration and tokenizer (the ``hf_lm`` task's ``artefacts/model/`` and
``artefacts/tokenizer/``) as a directory that ``transformers`` loads
(``AutoModelForCausalLM.from_pretrained``, ``AutoTokenizer.from_pretrained``).

Everything comes from the run directory itself (beside the checkpoint, or one level up for a copy
in ``best/``), so a run directory copied to another machine exports without its data. The task is
not built and the module its ``config.yaml`` names is not imported: a run directory is data, and
nothing read from it runs code (the weights are read with ``weights_only``, the configuration as
JSON by ``transformers``' own classes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raytrain_loops.checkpoint import whole_model
from raytrain_loops.config import ConfigError
from raytrain_loops.driver.run_checks import read_pinned
from raytrain_loops.rundir.layout import ARTEFACTS, ARTEFACTS_FILE


def run_dir_of(checkpoint: Path) -> Path:
    """The run directory of ``checkpoint``: the directory beside it or one level up that holds
    the run's pinned artefacts."""
    for directory in (checkpoint.parent, checkpoint.parent.parent):
        if (directory / ARTEFACTS_FILE).exists():
            return directory
    raise FileNotFoundError(
        f"no {ARTEFACTS_FILE} beside {checkpoint} or one level up: the run pinned no artefacts at its first start "
        "(--format hf exports runs of hf_lm started with this version)"
    )


def export_hf(checkpoint: str | Path, out: str | Path, ema: bool = False) -> dict[str, Any]:
    """Write ``out`` from ``checkpoint`` (its EMA's weights with ``ema``) and the run's pinned
    model configuration and tokenizer; returns the checkpoint's counters."""
    from raytrain_loops.tasks.hf_text import model_from

    checkpoint = Path(checkpoint).expanduser().resolve()
    run_dir = str(run_dir_of(checkpoint))
    config_files, tokenizer_files = read_pinned(run_dir, "model/"), read_pinned(run_dir, "tokenizer/")
    for kind, files, needed in (("model", config_files, "config.json"), ("tokenizer", tokenizer_files, "tokenizer.json")):
        if needed not in files:
            raise ConfigError(
                "--format", f"{run_dir} pins no {ARTEFACTS}/{kind}/{needed}: hf exports runs of a Hugging Face model"
            )
    written = whole_model(checkpoint)
    weights = written["ema"] if ema else written["model"]
    if weights is None:
        raise ConfigError("ema.enabled", f"{checkpoint} holds no EMA weights")
    model = model_from(config_files, {})
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or set(missing) - tied:
        raise ValueError(f"the checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(str(out), safe_serialization=True)
    for name, data in {**config_files, **tokenizer_files}.items():  # the pinned files as they were
        (Path(out) / name).write_bytes(data)
    return written["counters"]
