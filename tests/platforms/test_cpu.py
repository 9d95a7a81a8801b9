"""CPU flags -> code path and what dtype="auto" means (platforms/cpu.py, worker/kernel_plan.py choose_dtype)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.platforms.cpu import (CpuIsa, best_cpu_isa, cpu_flags, missing_flags, native_bf16,
                                    read_cpu_flags, resolve_cpu_isa)
from pagedllm.worker.kernel_plan import choose_dtype

ZEN3 = frozenset("fpu sse2 avx avx2 fma bmi2".split())  # AVX2 only (the CI kind of the AMD EPYC)
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}  # AVX-512 with bf16, no AMX
SKYLAKE = ZEN3 | {"avx512f", "avx512bw", "avx512vl"}  # AVX-512 without bf16
SAPPHIRE = ZEN4 | {"amx_bf16", "amx_tile", "amx_int8"}


def test_read_cpu_flags_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\n")
    assert read_cpu_flags(str(info)) == {"fpu", "avx2", "fma", "avx512f", "avx512_bf16"}


def test_read_cpu_flags_without_cpuinfo_asks_torch(tmp_path):
    flags = read_cpu_flags(str(tmp_path / "missing"))
    capability = torch.backends.cpu.get_cpu_capability()
    assert ("avx2" in flags) == (capability in ("AVX2", "AVX512"))
    assert ("avx512f" in flags) == (capability == "AVX512")
    assert ("avx512_bf16" in flags) == torch.cpu._is_avx512_bf16_supported()


@pytest.mark.parametrize("flags, best", [(frozenset(), CpuIsa.PORTABLE), (ZEN3, CpuIsa.AVX2),
                                         (SKYLAKE, CpuIsa.AVX512), (ZEN4, CpuIsa.AVX512_BF16),
                                         (SAPPHIRE, CpuIsa.AVX512_BF16)])
def test_best_path_per_cpu(flags, best):
    assert best_cpu_isa(flags) is best
    assert resolve_cpu_isa("auto", flags) is best


def test_forced_path_needs_its_flags():
    assert resolve_cpu_isa("avx2", ZEN4) is CpuIsa.AVX2
    assert resolve_cpu_isa("PORTABLE", ZEN3) is CpuIsa.PORTABLE
    with pytest.raises(ValueError, match=r"avx512_bf16.*\['avx512f', 'avx512bw', 'avx512_bf16'\]"):
        resolve_cpu_isa("avx512_bf16", ZEN3)
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_ISA"):
        resolve_cpu_isa("sse9", ZEN4)
    assert missing_flags(CpuIsa.AVX512_BF16, SKYLAKE) == ["avx512_bf16"]


@pytest.mark.parametrize("flags, cpu_isa, want", [
    (ZEN3, "auto", False), (SKYLAKE, "auto", False), (ZEN4, "auto", True), (SAPPHIRE, "auto", True),
    (ZEN4, "avx2", False), (SAPPHIRE, "avx512", False), (SAPPHIRE, "avx512_bf16", True),
    (ZEN3 | {"amx_bf16"}, "auto", True)])
def test_native_bf16(flags, cpu_isa, want):
    bf16, why = native_bf16(cpu_isa, flags)
    assert bf16 is want
    assert why  # the log's reason


def test_auto_dtype_on_this_cpu():
    """dtype="auto" on the CPU: bfloat16 exactly where this CPU has avx512_bf16 or AMX, and the
    reason (the kernel plan's dtype row) says which and why; PAGEDLLM_CPU_ISA=avx2 (a path without
    bf16) gives float32 everywhere."""
    native = bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
    got, why = choose_dtype("auto", ModelConfig(), torch.device("cpu"))
    assert got == (torch.bfloat16 if native else torch.float32)
    assert why.startswith("auto on the CPU: ") and "CPU" in why[len("auto on the CPU: "):]
    if "avx2" in cpu_flags():
        assert choose_dtype("auto", ModelConfig(), torch.device("cpu"), "avx2")[0] == torch.float32
    assert choose_dtype("auto", ModelConfig(quantization="int8"), torch.device("cpu"))[0] == torch.float32
    assert choose_dtype("float32", ModelConfig(), torch.device("cpu"))[0] == torch.float32


def test_cpu_isa_env_var(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "AVX2")
    assert EngineArgs().create_engine_config(128).kernel_config.cpu_isa == "avx2"
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "neon")
    with pytest.raises(ValueError, match=r"cpu_isa \(\$PAGEDLLM_CPU_ISA\)"):
        EngineArgs().create_engine_config(128)
    monkeypatch.delenv("PAGEDLLM_CPU_ISA")
    assert EngineArgs().create_engine_config(128).kernel_config.cpu_isa == "auto"
