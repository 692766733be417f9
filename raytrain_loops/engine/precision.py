"""Autocast and the fp16 loss scaler."""

from __future__ import annotations

import contextlib

import torch

from raytrain_loops.config.engine import PrecisionConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(cfg: PrecisionConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast context for forward passes (a no-op in fp32)."""
    if cfg.dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[cfg.dtype])


def grad_scaler(cfg: PrecisionConfig, device: torch.device) -> torch.amp.GradScaler:
    """A dynamic loss scaler, enabled only for fp16."""
    return torch.amp.GradScaler(
        device.type,
        init_scale=cfg.init_scale,
        growth_interval=cfg.growth_interval,
        enabled=cfg.dtype == "fp16",
    )
