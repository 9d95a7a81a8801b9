"""``worker/kernel_builds``: which kernels a CPU builds, and ``prebuild``'s report (a warm cache, a
kernel that fails to compile)."""

from __future__ import annotations

import importlib
import os
import pkgutil
import re

import pytest

import pagedllm
from pagedllm.platforms.cpu_extension import CpuExtension
from pagedllm.worker import kernel_builds
from pagedllm.worker.kernel_builds import KERNELS, KernelEntry, kernels_for, prebuild

EVERY_CPU = {"paged_attention", "fused_ops", "lora_sgmv", "watermark_philox"}
FMA = {"int8_gemm", "f32_gemm", "f32_moe", "bf16_avx2_gemm"}   # AVX2 + FMA
AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}


def labels(entries) -> set[str]:
    return {e.extension().label for e in entries}


def test_every_extension_of_the_package_is_listed_once():
    found = set()
    for info in pkgutil.walk_packages(pagedllm.__path__, "pagedllm."):
        if info.name.startswith(("pagedllm.entrypoints", "pagedllm.benchmarks")):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, CpuExtension) and value.source.is_relative_to(os.path.dirname(pagedllm.__file__)):
                found.add(value.label)
    listed = [e.extension().label for e in KERNELS]
    assert len(listed) == len(set(listed))
    assert set(listed) == found


def test_kernels_follow_the_cpu_flags():
    assert labels(kernels_for(frozenset())) == EVERY_CPU
    assert labels(kernels_for(AVX2)) == EVERY_CPU | FMA
    assert labels(kernels_for(AVX512_BF16)) == EVERY_CPU | FMA | {"bf16_gemm"}
    assert labels(kernels_for(AMX)) == labels(KERNELS)


def test_a_warm_cache_builds_nothing():
    # The parallel tier prebuilt them (tests/conftest.py); in a lone run the first call may build.
    # A kernel this machine cannot build (no compiler, a gcc without -mamx-tile) fails every time.
    first = prebuild()
    again = prebuild()
    assert again.built == () and again.failed == first.failed
    assert set(again.cached) | set(again.failed) == labels(kernels_for())
    assert not set(again.cached) & set(again.failed)


def test_a_kernel_that_does_not_compile_is_reported(tmp_path, monkeypatch):
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++\n")
    (tmp_path / "broken_kernel_module.py").write_text(
        "from pathlib import Path\n"
        "from pagedllm.platforms.cpu_extension import CpuExtension\n"
        f"EXTENSION = CpuExtension('broken', Path({str(source)!r}), 'a broken kernel', 'nothing')\n")
    # The pool's spawned processes import the module by name: from PYTHONPATH.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path))
    result = prebuild([KernelEntry("broken_kernel_module")], jobs=2)
    assert result.failed == ("broken",) and result.built == () and result.cached == ()


def test_cli_reports_and_refuses_zero_jobs(capsys):
    state = prebuild()   # what is built (now, or before) and what fails here
    assert kernel_builds.main([]) == (1 if state.failed else 0)
    built = len(state.cached) + len(state.built)
    assert re.search(rf"^kernels: 0 built \(-\), {built} already built, {len(state.failed)} failed \(", capsys.readouterr().out)
    with pytest.raises(SystemExit) as exc:
        kernel_builds.main(["--jobs", "0"])
    assert exc.value.code == 2
    assert "--jobs must be at least 1" in capsys.readouterr().err
