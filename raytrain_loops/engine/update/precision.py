"""Autocast, the fp16 loss scaler, and ``precision.dtype=auto``: the dtype that suits the device.

``auto`` resolves on the device the run trains on (:func:`decide`): bf16 on a GPU that computes
it (``torch.cuda.is_bf16_supported`` without emulation: Ampere and newer), fp16 with the loss
scaler on an older GPU, bf16 on a CPU with native bf16 matrix units (AVX512-BF16 or AMX on x86,
the BF16 extension on Arm), fp32 on any other CPU, where bf16 is emulated and an order of
magnitude slower than fp32. Rank 0 decides and every worker takes its decision, so a group never
mixes dtypes.
"""

from __future__ import annotations

import contextlib
import platform
from dataclasses import dataclass

import torch

from raytrain_loops.config.engine import PrecisionConfig
from raytrain_loops.engine.distributed import collectives

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
RESOLVED = ("fp32", "bf16", "fp16")  # what ``auto`` becomes: the order is the code broadcast by decide()

# What bf16 costs where it is emulated, as the warning says it (docs/benchmarks.md, "The engine's
# step": scripts/bench_step.py on a CPU without native bf16).
EMULATED_SLOWDOWN = "7-18x slower than fp32 as measured on AVX2 CPUs"


def autocast(cfg: PrecisionConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast context for forward passes (a no-op in fp32)."""
    if _resolved(cfg) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[cfg.dtype])


def grad_scaler(cfg: PrecisionConfig, device: torch.device) -> torch.amp.GradScaler:
    """A dynamic loss scaler, enabled only for fp16."""
    return torch.amp.GradScaler(
        device.type,
        init_scale=cfg.init_scale,
        growth_interval=cfg.growth_interval,
        enabled=_resolved(cfg) == "fp16",
    )


def _resolved(cfg: PrecisionConfig) -> str:
    if cfg.dtype == "auto":
        raise ValueError("precision.dtype=auto must be resolved (precision.decide) before the engine is built")
    return cfg.dtype


@dataclass(frozen=True)
class Hardware:
    """What the precision rule reads of a device: its kind (``cuda``, ``cpu``, ...), a name for
    the console (the GPU's, or the CPU's vector capability) and whether it computes bf16
    natively."""

    kind: str
    name: str
    native_bf16: bool


def cpu_native_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions: AVX512-BF16 or AMX tiles on x86 (torch's own
    checks; ``get_cpu_capability()`` says AVX512 for CPUs without bf16 too), the BF16 extension on
    Arm (oneDNN's bf16 support, which on Arm requires it)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686", "x86"):
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    if machine in ("aarch64", "arm64"):
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def hardware(device: torch.device) -> Hardware:
    """The :class:`Hardware` of ``device``, read from torch."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        # Without including_emulation=False, torch says True for GPUs older than Ampere too.
        return Hardware("cuda", name, bool(torch.cuda.is_bf16_supported(including_emulation=False)))
    if device.type == "cpu":
        return Hardware("cpu", f"CPU {torch.backends.cpu.get_cpu_capability()}", cpu_native_bf16())
    return Hardware(device.type, device.type, False)


def resolve(requested: str, hw: Hardware) -> tuple[str, str]:
    """The dtype for ``requested`` on ``hw``, and why: ``auto`` by the rule above, an explicit
    dtype as configured."""
    if requested != "auto":
        return requested, "as configured"
    if hw.kind == "cuda":
        if hw.native_bf16:
            return "bf16", f"{hw.name} computes bf16"
        return "fp16", f"{hw.name} has no bf16: fp16 with the loss scaler"
    if hw.kind == "cpu":
        if hw.native_bf16:
            return "bf16", f"{hw.name} with native bf16 (AVX512-BF16, AMX or Arm BF16)"
        return "fp32", f"{hw.name} without native bf16: bf16 would be emulated, {EMULATED_SLOWDOWN}"
    return "fp32", f"no bf16 rule for {hw.kind} devices"


def emulated_warning(hw: Hardware) -> str:
    """The warning for an explicit bf16 on a CPU that emulates it."""
    return (
        f"warning: precision.dtype=bf16 on a {hw.name} without native bf16 (no AVX512-BF16, AMX or Arm BF16): "
        f"bf16 is emulated there, {EMULATED_SLOWDOWN}; training as asked "
        "(precision.dtype=auto or fp32 trains at full speed)"
    )


def decide(requested: str, device: torch.device, recorded: str | None = None) -> tuple[str, str]:
    """Resolve ``requested`` for the whole process group: rank 0 decides (from ``recorded``, the
    dtype an earlier start of the run resolved ``auto`` to, else from its own device) and every
    worker takes rank 0's decision in one all-reduce. Call on every worker; returns the dtype and
    rank 0's reason (other ranks: ``"rank 0's decision"``)."""
    if requested != "auto":
        return requested, "as configured"
    code = torch.zeros(1, dtype=torch.float32, device=collectives.collective_device())
    reason = "rank 0's decision"
    if collectives.rank() == 0:
        if recorded is not None:
            if recorded not in RESOLVED:
                raise ValueError(f"the run's recorded precision {recorded!r} is not one of {RESOLVED}")
            dtype, reason = recorded, "the dtype this run resolved auto to at its first start"
        else:
            dtype, reason = resolve(requested, hardware(device))
        code += RESOLVED.index(dtype) + 1
    collectives.all_reduce_sum(code)
    return RESOLVED[int(code.item()) - 1], reason
