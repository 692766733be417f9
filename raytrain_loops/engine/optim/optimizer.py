"""Parameter groups and the optimizer; learning rate and weight decay are set per step from schedules."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from raytrain_loops.config.engine import EngineConfig, OptimConfig
from raytrain_loops.engine.optim.ema import EMA
from raytrain_loops.engine.update.precision import grad_scaler


def _no_decay(name: str, p: torch.Tensor) -> bool:
    # Biases and 1-D tensors (norm scales and shifts, layer-scale) are not regularised.
    return p.ndim <= 1 or name.endswith(".bias")


def param_groups(
    model: nn.Module, cfg: OptimConfig, task_groups: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Parameter groups in the order weight decay is applied: the first group is the regularised one.

    Each group carries ``lr_scale`` (multiplies the lr schedule), ``decay`` (whether the
    weight-decay schedule applies) and ``param_names`` (for freezing and error messages).
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.param_groups == "task":
        if not task_groups:
            raise ValueError("optim.param_groups=task, but the task returned no param_groups(model)")
        names = {id(p): n for n, p in named}
        groups = []
        for i, g in enumerate(task_groups):
            params = list(g["params"])
            decay = g.get("decay", i == 0 if cfg.weight_decay_groups == "first" else True)
            groups.append(
                {
                    "params": params,
                    "param_names": [names.get(id(p), "?") for p in params],
                    "lr_scale": float(g.get("lr_scale", 1.0)),
                    "decay": bool(decay),
                }
            )
    elif cfg.param_groups == "single":
        groups = [
            {"params": [p for _, p in named], "param_names": [n for n, _ in named], "lr_scale": 1.0, "decay": True}
        ]
    else:
        decay = [(n, p) for n, p in named if not _no_decay(n, p)]
        rest = [(n, p) for n, p in named if _no_decay(n, p)]
        groups = [
            {"params": [p for _, p in part], "param_names": [n for n, _ in part], "lr_scale": 1.0, "decay": i == 0}
            for i, part in enumerate((decay, rest))
            if part
        ]
    if cfg.weight_decay_groups == "all":
        for g in groups:
            g["decay"] = True
    return groups


FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The parameter dtypes torch's fused Adam and AdamW kernels take."""


def adam_kernel(device_types: set[str], dtypes: set[torch.dtype]) -> dict[str, bool]:
    """Adam's and AdamW's implementation for parameters on ``device_types`` of ``dtypes``: the
    fused kernel (one launch for every parameter's update) when all of them are on CUDA in a
    dtype it takes, the multi-tensor ``foreach`` one elsewhere."""
    if device_types == {"cuda"} and dtypes and all(d in FUSED_DTYPES for d in dtypes):
        return {"fused": True, "foreach": False}
    return {"fused": False, "foreach": True}


def kernel_of(groups: list[dict[str, Any]]) -> dict[str, bool]:
    """:func:`adam_kernel` for the parameters of ``groups`` (a sharded parameter by its local shard)."""
    params = [p.to_local() if hasattr(p, "to_local") else p for g in groups for p in g["params"]]
    return adam_kernel({p.device.type for p in params}, {p.dtype for p in params})


def build_optimizer(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer over ``groups``; lr and weight decay start at 0 and are set by :func:`apply_values`.
    Adam and AdamW run fused on CUDA, ``foreach`` elsewhere (:func:`adam_kernel`)."""
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=0.0, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=0.0)
    cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    return cls(groups, lr=0.0, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=0.0, **kernel_of(groups))


def keep_kernel(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict``: Adam's kernel flags back to this device's choice (a checkpoint's
    param groups carry those of the device that wrote it)."""
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        flags = {k: optimizer.defaults[k] for k in ("fused", "foreach")}
        for g in optimizer.param_groups:
            g.update(flags)


def apply_values(optimizer: torch.optim.Optimizer, lr: float, weight_decay: float) -> None:
    """Set this step's learning rate and weight decay on every group."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
        g["weight_decay"] = weight_decay if g.get("decay", True) else 0.0


def frozen_params(module: nn.Module, freeze: Any) -> list[nn.Parameter]:
    """The parameters ``freeze.last_layer_pattern`` matches; none is an error when freezing is on."""
    pattern = re.compile(freeze.last_layer_pattern)
    frozen = [p for n, p in module.named_parameters() if pattern.search(n)]
    if freeze.last_layer_epochs > 0 and not frozen:
        raise ValueError(f"freeze.last_layer_pattern={freeze.last_layer_pattern!r} matches no parameter of the model")
    return frozen


def build_optimizer_scaler_ema(
    module: nn.Module,
    config: EngineConfig,
    device: torch.device,
    *,
    sharded: bool,
    task_param_groups: list[dict[str, Any]] | None,
    ema_module: nn.Module | None,
) -> tuple[torch.optim.Optimizer, torch.amp.GradScaler, EMA | None]:
    """The optimizer over ``module``'s parameter groups, the loss scaler, and the EMA when
    ``ema.enabled`` (of ``ema_module``, the model's copy sharded alike, for a sharded model)."""
    groups = param_groups(module, config.optim, task_param_groups)
    optimizer = build_optimizer(groups, config.optim)
    scaler = grad_scaler(config.precision, device)
    if scaler.is_enabled():
        scaler.scale(torch.ones((), device=device))  # creates the scale: a first step may have no data
    if config.ema.enabled and sharded and ema_module is None:
        raise ValueError(
            "ema.enabled with a sharded model: pass ema_module, a copy of the model sharded the same way "
            "(FSDP modules cannot be deep-copied)"
        )
    ema = EMA(module, config.ema.buffers, ema_module, config.ema.arithmetic) if config.ema.enabled else None
    return optimizer, scaler, ema
