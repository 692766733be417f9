"""Throughput, model FLOPs, MFU and peak memory per logging interval: a loop callback.

FLOPs are counted once, before the first step that has data, by a forward and backward of the
task's criterion on that step's first micro-batch under
``torch.utils.flop_counter.FlopCounterMode``. The count runs on a copy of the model as the task
built it (before compilation, activation checkpointing and sharding: model FLOPs, not the
recomputed ones, and a sharded model counted whole), never on the live step: under any Python
dispatch mode some of autograd's backward formulas take another branch (``prod``'s, for one,
differs in the last bit), so a counted step would not be the step a run without the counter takes.

The copy is first made on the ``meta`` device, with the micro-batch moved there: shapes only, no
memory, no random numbers drawn. A criterion that needs values (a matching solved on the host, a
branch on a tensor) fails there; the count is then taken again on a real copy on the worker's
device (one more set of weights, gradients and one micro-batch's activations, once; the GPU's
peak-memory statistics are reset after it, every RNG state restored), unless the live model is
sharded. A count that fails both ways only leaves the FLOP metrics out, with a warning. The
counted criterion is the task's own, not the engine's wrapped one (an injected fault must not
fire on the copy). Attention is counted as FLOP counters count a plain softmax(QK^T)V: forward
and the two-fold backward over the whole T x T scores, whatever kernel the live step runs.

Every number that needs all workers rides in the interval's one all-reduce (the engine's
meters): each worker gives its own values under ``name/rank<r>``, and the totals (sums of rates,
the largest memory) are derived from those reduced values, identical on every worker.
"""

from __future__ import annotations

import copy
import re
import resource
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from raytrain_loops.config.engine import ThroughputConfig
from raytrain_loops.engine.api import LossFn, StepContext, StepResult, TaskReturnError
from raytrain_loops.engine.devices import to_device, unwrap
from raytrain_loops.engine.distributed import collectives
from raytrain_loops.engine.loop import Callback
from raytrain_loops.engine.rng import rng_state, set_rng_state
from raytrain_loops.engine.update.guards import is_oom
from raytrain_loops.engine.update.precision import autocast
from raytrain_loops.engine.update.step import Engine

__all__ = ["Throughput", "gpu_peak_tflops", "peak_tflops", "plain_copy"]

GIB = float(1 << 30)
# Every metric this callback adds (each also per worker, as ``<name>/rank<r>``).
METRICS = frozenset(
    ["samples_per_s", "flops_per_sample", "tflops_per_s", "gflops_per_s", "mfu"]
    + ["gpu_max_allocated_gib", "cpu_peak_rss_gib"]
)

# Dense (no 2:4 sparsity) bf16/fp16 tensor-core peaks in TFLOP/s, matched in this order against
# the lower-cased ``torch.cuda.get_device_name()``. NVIDIA's datasheets print the sparse figure,
# twice these, with an asterisk.
_GPU_PEAKS: tuple[tuple[str, float], ...] = (
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): BF16 1,979 (SXM) and 1,671 (NVL) sparse.
    (r"h200.*nvl", 835.0),
    (r"h200", 989.0),
    # NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): BF16 1,979 (SXM, "H100 80GB HBM3"),
    # 1,671 (NVL) and 1,513 (PCIe) sparse.
    (r"h100.*nvl", 835.0),
    (r"h100.*pcie", 756.0),
    (r"h100", 989.0),
    # NVIDIA A100 datasheet: BF16 312 dense, the same for SXM4 and PCIe, 40 and 80 GB.
    (r"a100", 312.0),
    # AWS's A10G has no NVIDIA datasheet; 70 TFLOP/s BF16 dense as tabled in Baseten's "NVIDIA A10
    # vs A10G for ML model inference" (the A10G trades tensor throughput for CUDA-core clocks).
    (r"a10g", 70.0),
    # NVIDIA A10 datasheet: BF16 125 dense (250 sparse).
    (r"\ba10\b", 125.0),
    # NVIDIA L4 datasheet: BF16 242 sparse.
    (r"\bl4\b", 121.0),
    # NVIDIA V100 datasheet (Volta has no bf16): FP16 tensor 130 (V100S PCIe), 112 (PCIe), 125 (SXM2).
    (r"v100s", 130.0),
    (r"v100.*pcie", 112.0),
    (r"v100", 125.0),
)

_warned: set[str] = set()


def gpu_peak_tflops(name: str) -> float | None:
    """The table's bf16/fp16 dense peak for a GPU named ``name`` (as CUDA names it); None, with a
    warning once per name, when the table does not know it."""
    lowered = name.lower()
    for pattern, tflops in _GPU_PEAKS:
        if re.search(pattern, lowered):
            return tflops
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"no peak TFLOP/s known for GPU {name!r}: MFU is not reported; set logging.throughput.peak_tflops",
            stacklevel=2,
        )
    return None


def peak_tflops(override: float, device: torch.device) -> float | None:
    """The peak TFLOP/s that MFU is measured against: ``override`` when set, else the table's
    figure for a CUDA device; None on a CPU and on a GPU the table does not know."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    return gpu_peak_tflops(torch.cuda.get_device_name(device))


def plain_copy(module: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """A deep copy of ``module`` without its compiled forwards (``nn.Module.compile`` binds them to
    the original); on ``device="meta"`` its parameters and buffers are shape-only tensors and the
    copy takes no memory. ``module`` must not be sharded (its parameters would be shards)."""
    memo: dict[int, Any] = {}
    if device is not None and torch.device(device).type == "meta":
        for t in [*module.parameters(), *module.buffers()]:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    clone = copy.deepcopy(module, memo)
    for m in clone.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
    return clone


def _peak_rss_gib() -> float:
    """This process's peak resident memory since it started (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / GIB if sys.platform == "darwin" else peak * 1024 / GIB


class Throughput(Callback):
    """Adds to each interval's metrics (``/rank<r>``: that worker's own value):

    - ``samples_per_s`` (sum over workers) and ``samples_per_s/rank<r>``: units of the
      criterion's ``sample_size`` (samples, or tokens) per second of step time (computing and
      waiting for data);
    - ``flops_per_sample``: model FLOPs (forward and backward) per unit, measured once;
    - ``tflops_per_s`` on a GPU, ``gflops_per_s`` on a CPU (sum, and ``/rank<r>``): achieved;
    - ``mfu``: achieved over peak, the mean over workers whose peak is known;
    - ``gpu_max_allocated_gib`` (``torch.cuda.max_memory_allocated`` over the interval, reset
      after each read) or, on a CPU, ``cpu_peak_rss_gib`` (the process's peak resident memory
      since it started): the largest over workers, and ``/rank<r>``.

    ``criterion`` is the task's; ``counts`` its ``Task.counts`` when it declares any (the copy's
    context gets this micro-batch's counts as its totals). ``plain`` is the model as the task built
    it, taken before compilation, checkpointing and sharding (any device; only its structure is
    used); without it the live model is copied, which a sharded model cannot be.
    """

    def __init__(
        self,
        cfg: ThroughputConfig,
        engine: Engine,
        criterion: LossFn,
        counts: Callable[[Any], dict[str, float]] | None = None,
        plain: nn.Module | None = None,
    ):
        self.enabled = cfg.enabled
        self.engine, self.criterion, self.counts, self.plain = engine, criterion, counts, plain
        self.device = engine.device
        self.rank = collectives.rank()
        self.gpu = self.device.type == "cuda"
        self.peak = peak_tflops(cfg.peak_tflops, self.device) if self.enabled else None
        self.flops_unit, self.flops_scale = ("tflops_per_s", 1e12) if self.gpu else ("gflops_per_s", 1e9)
        self.memory_name = "gpu_max_allocated_gib" if self.gpu else "cpu_peak_rss_gib"
        self.flops_per_sample: float | None = None
        self._measured = not self.enabled
        self._samples: torch.Tensor | float = 0.0
        self._seconds = 0.0

    def before_step(self, step: int, micro_batches: Sequence[Any]) -> None:
        if self._measured:
            return
        batch = next((b for b in micro_batches if b is not None), None)
        if batch is None:
            return  # this worker has no data now: count on a later step
        self._measured = True
        sharded = getattr(self.engine, "sharded", False)
        if sharded and self.plain is None:
            warnings.warn(
                "FLOPs per sample are not counted for a sharded model given without its plain structure "
                "(Throughput(plain=...)): throughput is reported without FLOP/s and MFU",
                stacklevel=2,
            )
            return
        state = rng_state()
        error: BaseException | None = None
        try:
            # On meta first (no memory); on the worker's device when the criterion needs values.
            for device in [torch.device("meta")] + ([] if sharded else [self.device]):
                try:
                    self.flops_per_sample = self._count(batch, device)
                    return
                except TaskReturnError:  # the task's mistake, not the count's: the run stops on it
                    raise
                except Exception as err:
                    error = err
        finally:
            set_rng_state(state)
            if self.gpu:
                torch.cuda.reset_peak_memory_stats(self.device)
            if error is not None and self.flops_per_sample is None:
                self._warn(error)

    def _warn(self, err: BaseException) -> None:
        why = "no room for a copy of the model" if is_oom(err) else f"{type(err).__name__}: {err}"
        warnings.warn(
            f"FLOPs per sample could not be counted ({why}); throughput is reported without FLOP/s and MFU "
            "(logging.throughput.enabled=false turns the count off)",
            stacklevel=3,
        )

    def _count(self, batch: Any, device: torch.device) -> float | None:
        """FLOPs per unit of one forward and backward of the criterion on copies of the model and
        its EMA on ``device``; None when the micro-batch has no units."""
        engine = self.engine
        on_meta = device.type == "meta"
        source = self.plain if on_meta and self.plain is not None else unwrap(engine.module)
        model = plain_copy(source, device if on_meta else None).train()
        ema = None
        if engine.ema is not None:
            ema = plain_copy(source, device) if on_meta else plain_copy(engine.ema.module)
        ctx = StepContext(engine.step, engine.epoch, engine.schedule_values(), ema, measuring=True)
        if self.counts is not None:  # from the values, before the batch goes to meta
            ctx.totals = {k: float(v) for k, v in self.counts(batch).items()}
        batch = to_device(batch, device)
        counter = FlopCounterMode(display=False)
        with counter:
            with autocast(engine.config.precision, self.device):
                out = self.criterion(model, batch, ctx)
            out.loss.backward()
        units = float(out.sample_size)
        return counter.get_total_flops() / units if units > 0 else None

    def on_step(self, result: StepResult, step: int, epoch: int) -> None:
        if not self.enabled:
            return
        self._samples = self._samples + result.local_sample_size
        self._seconds += result.compute_time + result.data_time

    def interval_meters(self) -> dict[str, tuple[Any, float]]:
        if not self.enabled:
            return {}
        r = self.rank
        out: dict[str, tuple[Any, float]] = {f"{self.memory_name}/rank{r}": (self._memory_gib(), 1.0)}
        if self.flops_per_sample is not None:
            out["flops_per_sample"] = (self.flops_per_sample, 1.0)
        if self._seconds > 0:
            rate = self._samples / self._seconds
            out[f"samples_per_s/rank{r}"] = (rate, 1.0)
            if self.flops_per_sample is not None:
                achieved = rate * self.flops_per_sample
                out[f"{self.flops_unit}/rank{r}"] = (achieved / self.flops_scale, 1.0)
                if self.peak is not None:
                    out["mfu"] = (achieved / (self.peak * 1e12), 1.0)
        self._samples, self._seconds = 0.0, 0.0
        return out

    def interval_metrics(self, reduced: dict[str, float]) -> dict[str, float]:
        if not self.enabled:
            return {}
        out = {}
        for name, total in (("samples_per_s", sum), (self.flops_unit, sum), (self.memory_name, max)):
            values = [v for k, v in reduced.items() if k.startswith(f"{name}/rank")]
            if values:
                out[name] = total(values)
        return out

    def _memory_gib(self) -> float:
        if not self.gpu:
            return _peak_rss_gib()
        peak = torch.cuda.max_memory_allocated(self.device) / GIB
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak
