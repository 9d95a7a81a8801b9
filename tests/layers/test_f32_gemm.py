"""The float32 GEMM (pagedllm/layers/csrc/f32_gemm.cpp): its packed layout by hand, its results
bit for bit against the arithmetic its header states (one float32 FMA chain per output in k order,
then the bias), batch and thread independence across both tile shapes, the AVX2 code against the
AVX-512 code (same bits), and which kernel ``pack_linear_layers`` and the kernel plan pick. Runs
where the CPU has the flags; skipped elsewhere, naming them."""

import dataclasses

import pytest
import torch

from pagedllm.config import SUPPORTED_CPU_F32_GEMMS, KernelConfig
from pagedllm.layers.f32_gemm import (EXTENSION, F32_GEMM_FLAGS, F32_KERNEL, F32_KERNELS, ONEDNN_KERNEL, F32Linear,
                                      f32_kernel_for, load_f32_gemm)
from pagedllm.layers.linear import PackedLinear, lm_head_logits, pack_linear_layers
from pagedllm.platforms.cpu import cpu_flags
from pagedllm.platforms.cpu_extension import load_extension
from tests.cpp_build import require_built_extension

MISSING = [f for f in F32_GEMM_FLAGS if f not in cpu_flags()]
MISSING_FOR_AVX512 = [f for f in ("avx512f",) + F32_GEMM_FLAGS if f not in cpu_flags()]
needs_f32_gemm = pytest.mark.skipif(bool(MISSING), reason=f"the float32 GEMM needs the CPU flags {MISSING}")
AVX2 = frozenset({"avx2", "fma"})


def _ext():
    return require_built_extension(load_f32_gemm, "the float32 GEMM")


def fma_chain_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The header's arithmetic, emulated: acc = fl32(x[m, k] * w[n, k] + acc) for k in order (the
    product of two float32 values is exact in float64, and so, but for a double rounding that
    these seeded inputs do not hit, is the float32 rounding of the float64 sum), then + bias."""
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for k in range(x.shape[1]):
        acc = (x[:, k:k + 1].double() * w[:, k].double() + acc.double()).float()
    return acc if bias is None else acc + bias


def test_kernel_choice_follows_flags_and_cpu_isa():
    kernel, why = f32_kernel_for("auto", AVX2 - {"fma"})
    assert kernel == ONEDNN_KERNEL and "'portable'" in why              # no fma: the portable path
    kernel, why = f32_kernel_for("portable", AVX2)
    assert kernel == ONEDNN_KERNEL and "portable" in why                # a forced path without it
    kernel, why = f32_kernel_for("auto", AVX2, kernel=ONEDNN_KERNEL)
    assert kernel == ONEDNN_KERNEL and "cpu_f32_gemm" in why            # forced (comparisons)
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_F32_GEMM"):
        f32_kernel_for("auto", AVX2, kernel="mkl")
    with pytest.raises(ValueError, match="cpu_f32_gemm"):
        KernelConfig(cpu_f32_gemm="mkl")
    assert SUPPORTED_CPU_F32_GEMMS == ("auto",) + F32_KERNELS   # config.py's copy (it imports no torch)


@needs_f32_gemm
def test_kernel_is_chosen_where_the_cpu_has_the_flags():
    ext = _ext()
    kernel, why = f32_kernel_for("auto")
    assert kernel == F32_KERNEL and "batch-invariant" in why
    assert ext.compiled_isas() == ["avx512" if "avx512f" in cpu_flags() else "avx2"]
    assert f32_kernel_for("auto", kernel=F32_KERNEL)[0] == F32_KERNEL


@needs_f32_gemm
def test_packed_layout_by_hand():
    """18 outputs x 5 columns: blocks of 16 outputs, [K][16 outputs] each; outputs 18..31 zero."""
    ext = _ext()
    w = torch.arange(18 * 5, dtype=torch.float32).reshape(18, 5) - 40
    packed = ext.pack_f32_weight(w)
    assert packed.shape == (2, 5, 16) and packed.dtype == torch.float32
    for row in range(18):
        for col in range(5):
            assert packed[row // 16, col, row % 16] == w[row, col]
    assert not packed[1, :, 2:].any()
    # A transposed (non-contiguous) weight packs as its contiguous copy does.
    wt = (torch.arange(5 * 35, dtype=torch.float32).reshape(5, 35) * 0.5).t()
    assert torch.equal(ext.pack_f32_weight(wt), ext.pack_f32_weight(wt.contiguous()))
    assert torch.equal(ext.pack_f32_weight(wt)[2, :, :3], wt[32:35].t())
    with pytest.raises(RuntimeError, match="float32"):
        ext.pack_f32_weight(w.double())


@needs_f32_gemm
@pytest.mark.parametrize("rows", [1, 3, 12, 13, 23, 24, 31])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bits_equal_the_fma_chain(rows, with_bias):
    """Both tiles (2 x 12 below 24 rows, 4 x 6 from 24), ragged outputs (70: a partial tile and a
    partial block), with and without a bias: the exact bits of the stated arithmetic."""
    ext = _ext()
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 40, generator=g)
    w = torch.randn(70, 40, generator=g)
    bias = torch.randn(70, generator=g) if with_bias else None
    y = F32Linear(w, bias, ext)(x)
    assert torch.equal(y, fma_chain_reference(x, w, bias))
    assert (y.double() - (x.double() @ w.double().T + (0 if bias is None else bias.double()))).abs().max() < 1e-4


@needs_f32_gemm
def test_a_rows_result_does_not_depend_on_the_batch_or_the_threads():
    ext = _ext()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 2048, generator=g) * 0.05
    layer = F32Linear(w, None, ext)
    x = torch.randn(40, 2048, generator=g)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(40)])
    threads = torch.get_num_threads()
    try:
        for n_threads in {1, max(2, threads)}:
            torch.set_num_threads(n_threads)
            for m in (2, 9, 12, 16, 24, 25, 40):
                assert torch.equal(layer(x[:m]), alone[:m]), (m, n_threads)
            assert torch.equal(layer(x[7:30]), alone[7:30])   # other neighbours
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(bool(MISSING_FOR_AVX512),
                    reason=f"comparing the AVX2 code with the AVX-512 code needs the CPU flags {MISSING_FOR_AVX512}")
def test_avx2_code_gives_the_avx512_codes_bits():
    ext = _ext()
    flags = tuple(f for f in EXTENSION.extra_cflags if f != "-march=native") + ("-march=native", "-mno-avx512f")
    avx2 = require_built_extension(lambda: load_extension(dataclasses.replace(EXTENSION, label="f32_gemm_avx2",
                                                                              extra_cflags=flags)),
                                   "the float32 GEMM's AVX2 build")
    assert ext.compiled_isas() == ["avx512"] and avx2.compiled_isas() == ["avx2"]
    g = torch.Generator().manual_seed(1)
    w, bias = torch.randn(100, 640, generator=g), torch.randn(100, generator=g)
    for rows in (1, 5, 24, 50):
        x = torch.randn(rows, 640, generator=g)
        assert torch.equal(F32Linear(w, bias, ext)(x), F32Linear(w, bias, avx2)(x)), rows


@needs_f32_gemm
def test_pack_linear_layers_runs_it_for_float32_and_the_tied_head(tied_toy):
    _ext()
    torch.manual_seed(0)
    model = tied_toy(out_features=48, hidden=32)
    x = torch.randn(5, 32)
    want_proj, want_head = model.model.proj(x), x @ model.model.embed_tokens.weight.T
    pack_linear_layers(model, torch.float32, torch.device("cpu"), 8)
    assert isinstance(model.model.proj, F32Linear) and isinstance(model.packed_lm_head, F32Linear)
    torch.testing.assert_close(model.model.proj(x), want_proj, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lm_head_logits(model, x), want_head, rtol=1e-5, atol=1e-5)
    forced = tied_toy()
    pack_linear_layers(forced, torch.float32, torch.device("cpu"), 8, cpu_f32_gemm=ONEDNN_KERNEL)
    assert isinstance(forced.model.proj, PackedLinear)
