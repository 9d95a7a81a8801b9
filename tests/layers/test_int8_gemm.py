"""The int8 weight-only GEMM (pagedllm/layers/csrc/int8_gemm.cpp): its packed layout by hand, its
arithmetic against a float64 reference built the way the C++ header defines it (the activation row
in 16-bit fixed point, exact integer sums), batch independence, and agreement with the portable
torch kernel. The arithmetic tests run on whichever code the CPU compiled (AVX-512 VNNI, or AVX2
without VNNI); the layer tests where the CPU has the VNNI flags. Skipped elsewhere, naming why."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.int8_gemm import (TORCH_KERNEL, VNNI_KERNEL, int8_avx2_unavailable, int8_kernel_for,
                                       load_int8_gemm, missing_vnni_flags)
from pagedllm.layers.weight_only import Int8WeightOnlyLinear, quantize_int8_per_channel

MISSING = missing_vnni_flags()
needs_vnni = pytest.mark.skipif(bool(MISSING), reason=f"the VNNI int8 kernel needs the CPU flags {MISSING}")
AVX2_WHY = int8_avx2_unavailable()
# The arithmetic tests: the VNNI code, or the AVX2 code (same arithmetic, vpmaddwd) where there is no VNNI.
needs_kernel = pytest.mark.skipif(bool(MISSING) and AVX2_WHY is not None,
                                  reason=f"neither the VNNI code (CPU flags {MISSING}) nor the AVX2 code ({AVX2_WHY}) runs here")


def test_kernel_choice_follows_flags_and_cpu_isa():
    avx512 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"})
    kernel, why = int8_kernel_for("auto", avx512)
    assert kernel == TORCH_KERNEL and "avx512_vnni" in why          # the missing flag is named
    kernel, why = int8_kernel_for("avx2", avx512 | {"avx512_vnni"})
    assert kernel == TORCH_KERNEL and "avx2" in why                  # a forced lower path
    with pytest.raises(ValueError, match="avx512_bf16"):
        int8_kernel_for("avx512_bf16", avx512)


@needs_vnni
def test_kernel_is_chosen_where_the_cpu_has_vnni():
    assert int8_kernel_for("auto") == (VNNI_KERNEL, "avx512_vnni")


@needs_kernel
def test_packed_layout_by_hand():
    """18 rows x 8 columns: blocks of 16 rows, [K / 4][16 rows][4 columns] each; rows 18..31 zero."""
    ext = load_int8_gemm()
    q = (torch.arange(18 * 8).reshape(18, 8) % 251 - 125).to(torch.int8)
    packed, row_sums = ext.pack_int8_weight(q)
    assert packed.shape == (2, 2, 64) and row_sums.shape == (32,)
    for row in range(18):
        for col in range(8):
            assert packed[row // 16, col // 4, 4 * (row % 16) + col % 4] == q[row, col]
    assert not packed[1, :, 4 * 2:].any()
    assert row_sums.tolist() == q.int().sum(1).tolist() + [0] * 14
    assert torch.equal(ext.unpack_int8_weight(packed, 18), q)
    with pytest.raises(RuntimeError, match="multiple of 4"):
        ext.pack_int8_weight(torch.zeros(4, 6, dtype=torch.int8))


def _fixed_point_reference(x, q, s, bias):
    """float64 of what the kernel computes before its final float32 steps: per row
    f = float32(32767 / max|x|), X = round_half_even(float32(x * f)), y = (X @ q^T) * s / f + bias."""
    x = x.float()
    amax = x.abs().amax(1, keepdim=True)
    f = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.ones_like(amax))
    xq = torch.round(x * f).clamp(-32767, 32767).double()                  # exact integers
    dot = xq @ q.double().t()                                               # exact (< 2^53)
    y = dot * s.double() / f.double()
    return y + (0 if bias is None else bias.double()), dot


@needs_kernel
@pytest.mark.parametrize("n,k", [(37, 64), (1536, 640), (200, 2048)])
@pytest.mark.parametrize("m", [1, 5, 12, 13, 30])
def test_kernel_matches_the_fixed_point_reference(n, k, m):
    ext = load_int8_gemm()
    torch.manual_seed(n + k + m)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s = torch.rand(n) * 0.01
    bias = torch.randn(n)
    x = torch.randn(m, k) * torch.logspace(-3, 2, m)[:, None]
    x[0, 3] = 40.0                                                          # an outlier column
    packed, row_sums = ext.pack_int8_weight(q)
    y = ext.int8_weight_only_mm(x, packed, row_sums, s, bias, n)
    ref, dot = _fixed_point_reference(x, q, s, bias)
    # A few float32 roundings after the exact integer sum, each relative to an int32 partial sum: VNNI's
    # digit sums (|256 (d1 - 128)| <= |X| + 255), AVX2's lane sums (at most sum |X q| over 1,024 columns).
    absdot = ((x.abs() * (32767 / x.abs().amax(1, keepdim=True))).round() + 256).double() @ q.double().abs().t()
    tol = 4 * 2.0 ** -24 * ((dot.abs() + absdot) * s.double() / (32767 / x.abs().amax(1, keepdim=True).double())
                            + bias.abs().double()) + 1e-30
    assert y.dtype == torch.float32
    assert bool(((y.double() - ref).abs() <= tol).all())
    # And the float product with the same int8 weights within the fixed-point rounding bound.
    w = q.float() * s[:, None]
    bound = x.abs().amax(1, keepdim=True) / 65534 * w.abs().sum(1) + 1e-5 * (1 + (x.abs() @ w.abs().t()))
    assert bool(((y - F.linear(x, w, bias)).abs() <= bound).all())
    # bfloat16 in -> the same float32 result rounded once to bfloat16.
    xb = x.bfloat16()
    yb = ext.int8_weight_only_mm(xb, packed, row_sums, s, bias, n)
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, ext.int8_weight_only_mm(xb.float(), packed, row_sums, s, bias, n).bfloat16())


@needs_kernel
def test_rows_do_not_depend_on_the_batch_and_a_zero_row_gives_the_bias():
    ext = load_int8_gemm()
    torch.manual_seed(1)
    n, k = 100, 128
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s, bias = torch.rand(n) * 0.01, torch.randn(n)
    packed, row_sums = ext.pack_int8_weight(q)
    x = torch.randn(29, k) * torch.logspace(-2, 2, 29)[:, None]
    x[7] = 0.0
    batched = ext.int8_weight_only_mm(x, packed, row_sums, s, bias, n)
    alone = torch.cat([ext.int8_weight_only_mm(x[i:i + 1].contiguous(), packed, row_sums, s, bias, n)
                       for i in range(len(x))])
    assert torch.equal(batched, alone)
    assert torch.equal(batched[7], bias)


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_agrees_with_the_torch_kernel(dtype):
    """Same codes, same scales: the two kernels differ only by how the activation row is rounded."""
    torch.manual_seed(2)
    w, b = torch.randn(80, 64) * 0.05, torch.randn(80)
    vnni = Int8WeightOnlyLinear(w, b, torch.bfloat16, VNNI_KERNEL)
    portable = Int8WeightOnlyLinear(w, b, torch.bfloat16, TORCH_KERNEL)
    assert vnni.kernel == VNNI_KERNEL and vnni.qweight is None
    assert torch.equal(vnni.int8_codes(), quantize_int8_per_channel(w)[0])
    assert torch.equal(vnni.dequantized_weight(), portable.dequantized_weight())
    x = torch.randn(2, 3, 64).to(dtype)
    got, want = vnni(x), portable(x)
    assert got.shape == want.shape == (2, 3, 80) and got.dtype == want.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2e-2)
    exact = F.linear(x.float(), vnni.dequantized_weight(), b)
    assert float((got.float() - exact).abs().max()) <= float((want.float() - exact).abs().max())


@pytest.mark.parametrize("kernel", [TORCH_KERNEL, VNNI_KERNEL])
def test_in_features_not_a_multiple_of_16_is_a_clear_error(kernel):
    """torch 2.13's kernel crashes (SIGSEGV) on 40-column rows; the layer refuses them up front."""
    with pytest.raises(ValueError, match="in_features=40"):
        Int8WeightOnlyLinear(torch.randn(8, 40), None, torch.bfloat16, kernel)
