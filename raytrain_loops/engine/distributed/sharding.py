"""A model made ready for its workers, block by block: activation checkpointing, regional
compilation, and FSDP2 sharding (``fully_shard`` on each block, then on the root).

Everything here changes the model in place, so parameter names and state-dict keys stay those of
the plain model (checkpoints load into either). The order is that of torchtitan: checkpointing
wraps a block's forward, compilation traces it, sharding gathers its parameters around it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from raytrain_loops.config.engine import CompileConfig
from raytrain_loops.engine.distributed import collectives

__all__ = ["apply_checkpointing", "compile_blocks", "is_sharded", "local", "lockstep", "prepare_model", "shard"]

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Ops whose outputs selective checkpointing keeps: the costly ones to recompute (matmuls and
# attention); everything else in a block (norms, activations, residual adds) is recomputed.
_SAVED_OPS = tuple(
    op
    for op in (
        getattr(torch.ops.aten, name, None)
        for name in (
            "mm",
            "addmm",
            "bmm",
            "baddbmm",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
        )
    )
    if op is not None
)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` has been applied to ``model`` (its parameters are DTensors)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def local(t: torch.Tensor) -> torch.Tensor:
    """This worker's shard of a DTensor (the same storage: in-place changes reach the DTensor);
    a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _selective_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    saved = getattr(op, "overloadpacket", op) in _SAVED_OPS  # the policy sees overloads (aten.mm.default)
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_selective_policy)


def apply_checkpointing(blocks: Sequence[nn.Module], mode: str) -> None:
    """Activation checkpointing of each block, by forward hooks (no wrapper module, so names stay):
    ``full`` keeps only a block's inputs and recomputes its forward in backward; ``selective``
    also keeps the outputs of its matmuls and attention."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"checkpointing must be none, full or selective; got {mode!r}")
    from torch.distributed._composable import checkpoint

    for block in blocks:
        if mode == "full":
            checkpoint(block)
        else:
            checkpoint(block, context_fn=_selective_contexts)


def compile_blocks(blocks: Sequence[nn.Module], cfg: CompileConfig) -> None:
    """``torch.compile`` each block in place (``nn.Module.compile``): the module keeps its class
    and parameter names, and blocks of one shape share a compiled graph."""
    if not cfg.enabled:
        return
    for block in blocks:
        block.compile(mode=cfg.mode, dynamic=cfg.dynamic, backend=cfg.backend)


def shard(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    device: torch.device,
    dtype: str = "fp32",
    reshard_after_forward: bool = True,
) -> nn.Module:
    """FSDP2: ``fully_shard`` each block, then the root, over all workers of the process group.

    Parameters are kept in fp32 and sharded; for the forward and backward they are gathered in
    ``dtype`` (``precision.dtype``), and gradients are reduce-scattered in fp32, averaged over
    the workers as DDP does. The root's own parameters (embeddings, the head) are not resharded
    after the forward: the backward needs them first.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not collectives.is_distributed():
        raise ValueError("scaling.strategy=fsdp needs a process group (one is started for every Ray worker)")
    mesh = init_device_mesh(device.type, (collectives.world_size(),))
    param_dtype = PARAM_DTYPES[dtype]
    policy = MixedPrecisionPolicy(
        param_dtype=None if param_dtype is torch.float32 else param_dtype, reduce_dtype=torch.float32
    )
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model


def prepare_model(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    *,
    checkpointing: str = "none",
    compile_cfg: CompileConfig | None = None,
) -> None:
    """Checkpointing of each block, then compilation of each block or of the whole model
    (``compile.scope``); the model is changed in place. Asking for either per block with no
    blocks is an error: it would silently do nothing."""
    compile_cfg = compile_cfg or CompileConfig()
    whole = compile_cfg.enabled and compile_cfg.scope == "model"
    per_block = compile_cfg.enabled and not whole
    wanted = [k for k, on in (("checkpointing", checkpointing != "none"), ("compile.enabled", per_block)) if on]
    if wanted and not blocks:
        raise ValueError(
            f"{' and '.join(wanted)} act on the task's blocks, and this task names none: "
            "override Task.blocks(model) to return the model's repeated parts"
        )
    apply_checkpointing(blocks, checkpointing)
    if whole:
        model.compile(mode=compile_cfg.mode, dynamic=compile_cfg.dynamic, backend=compile_cfg.backend)
    else:
        compile_blocks(blocks, compile_cfg)


def lockstep(batches: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """``(batch, True)`` for each of this worker's batches, then ``(first batch, False)`` until
    every worker has run out: under FSDP each forward gathers parameters from all workers, so
    all of them must run as many (an evaluation split is not cut into equal shares). One small
    all-reduce per batch decides, the same on every worker."""
    first, it = None, iter(batches)
    while True:
        batch = next(it, None)
        if first is None:
            first = batch
        flags = torch.tensor([float(batch is not None), float(first is None)], device=collectives.collective_device())
        running, empty = collectives.all_reduce_sum(flags).tolist()
        if running == 0:
            return
        if empty:
            raise RuntimeError(
                f"{int(empty)} worker(s) have no evaluation batch while others have some: under FSDP every "
                "worker must run each forward; lower data.eval_batch_size or give the eval split more rows"
            )
        yield (batch, True) if batch is not None else (first, False)
