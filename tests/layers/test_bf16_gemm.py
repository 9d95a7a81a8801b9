"""The AVX-512 BF16 GEMM (pagedllm/layers/csrc/bf16_gemm.cpp): its packed layout by hand, its
results against a float64 reference (exactly the bf16 rounding of the exact sum wherever the
float32 summation error cannot cross a rounding boundary), batch independence, bias and ragged
shapes, and agreement with oneDNN's bf16 kernel; which kernel ``pack_linear_layers`` picks. Runs
where the CPU has the flags; skipped elsewhere, naming them."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.amx_gemm import AMX_KERNEL
from pagedllm.layers.bf16_gemm import (AVX2_KERNEL, BF16_GEMM_FLAGS, BF16_KERNEL, ONEDNN_KERNEL, Bf16Linear,
                                       bf16_kernel_for, load_bf16_gemm)
from pagedllm.sample.greedy_head import gamma
from pagedllm.layers.linear import PackedLinear, lm_head_logits, onednn_linear_available, pack_linear_layers
from pagedllm.platforms.cpu import cpu_flags
from tests.cpp_build import require_built_extension

MISSING = [f for f in BF16_GEMM_FLAGS if f not in cpu_flags()]
needs_bf16_gemm = pytest.mark.skipif(bool(MISSING), reason=f"the bf16 GEMM needs the CPU flags {MISSING}")
AVX512_BF16 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"})


def _ext():
    return require_built_extension(load_bf16_gemm, "the bf16 GEMM")


def test_kernel_choice_follows_flags_and_cpu_isa():
    # without avx512_bf16 the AVX2 GEMM (tests/layers/test_bf16_gemm_avx2.py) where it builds, else oneDNN
    lower = AVX2_KERNEL if bf16_kernel_for("auto", AVX512_BF16, kernel=AVX2_KERNEL)[0] == AVX2_KERNEL \
        else ONEDNN_KERNEL
    kernel, why = bf16_kernel_for("auto", AVX512_BF16 - {"avx512_bf16"})
    assert kernel == lower and "avx512_bf16" in why                      # the missing path is named
    kernel, why = bf16_kernel_for("auto", AVX512_BF16 - {"avx512vl"})
    assert kernel == lower and "avx512vl" in why                         # the missing flag is named
    kernel, why = bf16_kernel_for("avx512", AVX512_BF16)
    assert kernel == lower and "avx512" in why                           # a forced lower path
    kernel, why = bf16_kernel_for("portable", AVX512_BF16)
    assert kernel == ONEDNN_KERNEL and "portable" in why
    amx = AVX512_BF16 | {"amx_bf16", "amx_tile"}
    if not MISSING and load_bf16_gemm() is not None:   # AMX CPUs: the AMX GEMM, else (no AMX) this one, naming why
        kernel, why = bf16_kernel_for("auto", amx)
        assert kernel in (AMX_KERNEL, BF16_KERNEL) and "AMX" in why
        assert (kernel == AMX_KERNEL) == ("amx_bf16" in cpu_flags() and "amx_tile" in cpu_flags())
        kernel, why = bf16_kernel_for("auto", amx, kernel=BF16_KERNEL)   # forced (comparisons)
        assert kernel == BF16_KERNEL and "cpu_bf16_gemm" in why
    else:   # a CPU without avx512_bf16 builds neither: the next kernel, naming why not the AMX GEMM
        kernel, why = bf16_kernel_for("auto", amx)
        assert kernel == lower and "AMX" in why
    kernel, why = bf16_kernel_for("auto", AVX512_BF16, kernel=ONEDNN_KERNEL)
    assert kernel == ONEDNN_KERNEL and "cpu_bf16_gemm" in why
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_BF16_GEMM"):
        bf16_kernel_for("auto", AVX512_BF16, kernel="mkl")
    kernel, why = bf16_kernel_for("auto", amx, batch_invariant=False)   # the opt-out keeps oneDNN's tiles
    assert kernel == ONEDNN_KERNEL and "AMX" in why
    with pytest.raises(ValueError, match="avx512_bf16"):
        bf16_kernel_for("avx512_bf16", AVX512_BF16 - {"avx512_bf16"})


@needs_bf16_gemm
def test_kernel_is_chosen_where_the_cpu_has_avx512_bf16():
    _ext()
    want = AMX_KERNEL if "amx_bf16" in cpu_flags() and "amx_tile" in cpu_flags() else BF16_KERNEL
    assert bf16_kernel_for("auto")[0] == want   # AMX CPUs: the AMX GEMM (tests/layers/test_amx_gemm.py)


@needs_bf16_gemm
def test_packed_layout_by_hand():
    """18 outputs x 6 columns: blocks of 16 outputs, [K / 2][16 outputs][2 columns] each; outputs 18..31 zero."""
    ext = _ext()
    w = (torch.arange(18 * 6).reshape(18, 6) - 50).to(torch.bfloat16)
    packed = ext.pack_bf16_weight(w)
    assert packed.shape == (2, 3, 32) and packed.dtype == torch.bfloat16
    for row in range(18):
        for col in range(6):
            assert packed[row // 16, col // 2, 2 * (row % 16) + col % 2] == w[row, col]
    assert not packed[1, :, 2 * 2:].any()
    with pytest.raises(RuntimeError, match="even"):
        ext.pack_bf16_weight(torch.zeros(4, 5, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.pack_bf16_weight(torch.zeros(4, 6))


def _bf16_interval(ref, err):
    """The bf16 values a float32 sum within ``err`` of ``ref`` (float64) rounds to: (lo, hi)."""
    return (ref - err).float().bfloat16().double(), (ref + err).float().bfloat16().double()


@needs_bf16_gemm
@pytest.mark.parametrize("n", [50, 40])   # 4 blocks (the last ragged); 3 blocks (an odd last block, ragged)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 40])
def test_results_are_the_bf16_rounding_of_the_exact_sum(m, n):
    """Every element lies between the bf16 roundings of ``exact +- e`` (``e``: Higham's float32
    summation bound over the K products and the bias), and equals the bf16 rounding of the exact
    sum wherever those two agree (most elements): a wrong index or layout fails by O(1)."""
    ext = _ext()
    torch.manual_seed(m)
    k = 96
    w = torch.randn(n, k).bfloat16()
    x = torch.randn(m, k).bfloat16()
    bias = torch.randn(n)
    y = ext.bf16_linear(x, ext.pack_bf16_weight(w), bias, n)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    exact = x.double() @ w.double().t() + bias.double()               # products exact in float64
    err = gamma(k + 1, 2.0 ** -24) * (x.double().abs() @ w.double().abs().t() + bias.double().abs())
    lo, hi = _bf16_interval(exact, err)
    yd = y.double()
    assert bool(((yd >= lo) & (yd <= hi)).all())
    decided = lo == hi
    assert decided.float().mean() > 0.9
    assert torch.equal(yd[decided], lo[decided])
    # without a bias as well
    y0 = ext.bf16_linear(x, ext.pack_bf16_weight(w), None, n).double()
    lo0, hi0 = _bf16_interval(exact - bias.double(), err)
    assert bool(((y0 >= lo0) & (y0 <= hi0)).all())


@needs_bf16_gemm
def test_a_row_does_not_depend_on_the_batch():
    ext = _ext()
    torch.manual_seed(1)
    w = torch.randn(200, 640).bfloat16()
    packed = ext.pack_bf16_weight(w)
    x = torch.randn(40, 640).bfloat16()
    full = ext.bf16_linear(x, packed, None, 200)
    for m in (1, 5, 8, 13, 16, 40):
        part = ext.bf16_linear(x[:m].contiguous(), packed, None, 200)
        assert torch.equal(part, full[:m])
    assert torch.equal(ext.bf16_linear(x[7:8].contiguous(), packed, None, 200), full[7:8])


@needs_bf16_gemm
def test_input_checks():
    ext = _ext()
    packed = ext.pack_bf16_weight(torch.zeros(20, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.bf16_linear(torch.zeros(2, 8), packed, None, 20)
    with pytest.raises(RuntimeError, match="K=6"):
        ext.bf16_linear(torch.zeros(2, 6, dtype=torch.bfloat16), packed, None, 20)
    with pytest.raises(RuntimeError, match="N=40"):
        ext.bf16_linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        ext.bf16_linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, torch.zeros(20).bfloat16(), 20)
    with pytest.raises(ValueError, match="multiple of 2"):
        Bf16Linear(torch.zeros(4, 5), None, ext)


@needs_bf16_gemm
@pytest.mark.skipif(not onednn_linear_available(torch.bfloat16), reason="oneDNN has no bf16 inner product here")
@pytest.mark.parametrize("m", [1, 16, 300])
def test_bf16_linear_agrees_with_onednn(m):
    """The same float32 accumulation and bf16 rounding as oneDNN's kernel, in another order: the
    two differ by at most one bf16 rounding step each side of the exact result."""
    ext = _ext()
    torch.manual_seed(m)
    w, b = torch.randn(96, 640).bfloat16(), torch.randn(96).bfloat16()
    x = torch.randn(2, m, 640).bfloat16()
    y = Bf16Linear(w, b, ext)(x)
    assert y.shape == (2, m, 96) and y.dtype == torch.bfloat16
    ref = PackedLinear(w, b, batch_hint=64)(x)
    want = F.linear(x.double(), w.double(), b.double())
    step = 2.0 ** -7 * want.abs() + 1e-30
    assert bool(((y.double() - ref.double()).abs() <= 2 * step + 1e-3).all())
    assert (y == ref).float().mean() > 0.9


@needs_bf16_gemm
def test_pack_linear_layers_picks_the_kernel_by_cpu_isa(tied_toy):
    """bf16 on an avx512_bf16 CPU without AMX: the kernel for the layers and the tied head (with
    the head's logits as ``F.linear`` to bf16 rounding)."""
    _ext()
    torch.manual_seed(0)
    model = tied_toy(out_features=24, hidden=32).to(torch.bfloat16)
    x = torch.randn(3, 32).bfloat16()
    want = F.linear(x.float(), model.model.embed_tokens.weight.float())
    want_proj = F.linear(x.float(), model.model.proj.weight.float(), model.model.proj.bias.float())
    extra = pack_linear_layers(model, torch.bfloat16, torch.device("cpu"), batch_hint=8)
    expected = Bf16Linear
    assert isinstance(model.model.proj, expected) and isinstance(model.packed_lm_head, expected)
    assert extra == 50 * 32 * 2
    torch.testing.assert_close(lm_head_logits(model, x).float(), want, rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(model.model.proj(x).float(), want_proj, rtol=1.6e-2, atol=2e-2)


def test_cpu_bf16_gemm_setting_is_checked_and_read_from_the_environment(monkeypatch):
    from pagedllm.config import KernelConfig
    from pagedllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="PAGEDLLM_CPU_BF16_GEMM"):
        KernelConfig(cpu_bf16_gemm="mkl")
    assert KernelConfig(cpu_bf16_gemm="onednn").cpu_bf16_gemm == "onednn"
    monkeypatch.setenv("PAGEDLLM_CPU_BF16_GEMM", "AVX512_BF16")
    assert EngineArgs().cpu_bf16_gemm == "avx512_bf16"
