"""``precision.dtype=auto``: the rule for each device class, rank 0's decision taken by every
worker, a recorded dtype kept, and the warning before an emulated bf16."""

from __future__ import annotations

import platform

import pytest
import torch

from raytrain_loops.config import load_config
from raytrain_loops.engine.update import precision
from raytrain_loops.engine.update.precision import Hardware, resolve
from tests.support.gloo import run_gloo

CPU_NATIVE = Hardware("cpu", "CPU AVX512", True)
CPU_EMULATED = Hardware("cpu", "CPU AVX2", False)
AMPERE = Hardware("cuda", "NVIDIA A100-SXM4-80GB", True)
VOLTA = Hardware("cuda", "Tesla V100-SXM2-16GB", False)


@pytest.mark.parametrize(
    ("hw", "dtype"),
    [(CPU_NATIVE, "bf16"), (CPU_EMULATED, "fp32"), (AMPERE, "bf16"), (VOLTA, "fp16"), (Hardware("mps", "mps", False), "fp32")],
)
def test_auto_resolves_by_the_device_class(hw, dtype):
    got, why = resolve("auto", hw)
    assert got == dtype
    assert hw.name in why or hw.kind in why  # the console names the device it decided for


@pytest.mark.parametrize("explicit", ["fp32", "bf16", "fp16"])
def test_an_explicit_dtype_is_kept_on_any_device(explicit):
    for hw in (CPU_NATIVE, CPU_EMULATED, AMPERE, VOLTA):
        assert resolve(explicit, hw) == (explicit, "as configured")


def test_this_cpu_is_read_with_torchs_bf16_checks_not_its_vector_capability():
    hw = precision.hardware(torch.device("cpu"))
    assert hw.kind == "cpu" and hw.name == f"CPU {torch.backends.cpu.get_cpu_capability()}"
    if platform.machine().lower() in ("x86_64", "amd64"):
        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        assert hw.native_bf16 == native


def test_the_engine_refuses_an_unresolved_auto():
    config = load_config({"precision": {"dtype": "auto"}}).engine
    with pytest.raises(ValueError, match="precision.dtype=auto must be resolved"):
        precision.grad_scaler(config.precision, torch.device("cpu"))
    with pytest.raises(ValueError, match="precision.dtype=auto must be resolved"):
        precision.autocast(config.precision, torch.device("cpu"))


def _decide(rank: int, world: int, recorded_on_rank0: str | None) -> tuple[str, str]:
    # Only rank 0 is told of a recorded dtype: the others must take its decision, not their own.
    return precision.decide("auto", torch.device("cpu"), recorded_on_rank0 if rank == 0 else None)


def test_every_worker_takes_rank_0s_decision_and_a_recorded_dtype_wins():
    outcomes = run_gloo(2, _decide, "fp16")
    assert [o.error for o in outcomes] == [None, None], outcomes[0].message + outcomes[1].message
    assert [o.value[0] for o in outcomes] == ["fp16", "fp16"]
    assert "first start" in outcomes[0].value[1]

    outcomes = run_gloo(2, _decide, None)
    own = resolve("auto", precision.hardware(torch.device("cpu")))[0]
    assert [o.value[0] for o in outcomes] == [own, own]


def test_a_recorded_dtype_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="recorded precision 'fp8'"):
        precision.decide("auto", torch.device("cpu"), "fp8")


def test_an_explicit_bf16_on_an_emulating_cpu_warns_once_before_a_local_ray(monkeypatch, capsys):
    from raytrain_loops.driver.preflight import warn_emulated_bf16

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(precision, "hardware", lambda device: CPU_EMULATED)
    assert warn_emulated_bf16(load_config({"precision": {"dtype": "bf16"}}))
    err = capsys.readouterr().err
    assert "precision.dtype=bf16 on a CPU AVX2 without native bf16" in err and "7-18x slower" in err
    # Not for auto or fp32, not for GPU workers, not when the workers run on a cluster's machines.
    assert not warn_emulated_bf16(load_config({"precision": {"dtype": "auto"}}))
    assert not warn_emulated_bf16(load_config({"precision": {"dtype": "bf16"}, "scaling": {"use_gpu": True}}))
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    assert not warn_emulated_bf16(load_config({"precision": {"dtype": "bf16"}}))
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(precision, "hardware", lambda device: CPU_NATIVE)
    assert not warn_emulated_bf16(load_config({"precision": {"dtype": "bf16"}}))
    assert capsys.readouterr().err == ""
