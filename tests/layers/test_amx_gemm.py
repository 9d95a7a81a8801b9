"""The AMX bf16 GEMM (pagedllm/layers/csrc/amx_gemm.cpp): results against a float64 reference
(within the bf16 rounding of the exact sum +- the float32 summation bound), bitwise batch
independence at the default model's shapes (each row alone == the same row in a batch of
M = 1..40, 64, 512), bias and ragged N, agreement with the AVX-512 BF16 GEMM, the K check, and
that ``pack_linear_layers`` runs it on AMX CPUs. Runs where the CPU has the AMX flags; skipped
elsewhere, naming the missing ones."""

import pytest
import torch

from pagedllm.layers.amx_gemm import AMX_GEMM_FLAGS, AMX_KERNEL, load_amx_gemm
from pagedllm.layers.bf16_gemm import BF16_GEMM_FLAGS, Bf16Linear, load_bf16_gemm
from pagedllm.sample.greedy_head import gamma
from pagedllm.platforms.cpu import cpu_flags
from tests.cpp_build import require_built_extension

MISSING = [f for f in AMX_GEMM_FLAGS if f not in cpu_flags()]
needs_amx = pytest.mark.skipif(bool(MISSING), reason=f"the AMX GEMM needs the CPU flags {MISSING}")
# (N, K) of the default model's linear layers (Gemma 3 270M: q/k/v, o, gate/up, down).
MODEL_SHAPES = [(1536, 640), (640, 1024), (4096, 640), (640, 2048)]


def _ext():
    ext = require_built_extension(load_amx_gemm, "the AMX GEMM")
    why = ext.amx_unavailable()
    if why:
        pytest.skip(f"Linux refused the AMX tile state: {why}")
    return ext


def _bf16_interval(ref, err):
    """The bf16 values a float32 sum within ``err`` of ``ref`` (float64) rounds to: (lo, hi)."""
    return (ref - err).float().bfloat16().double(), (ref + err).float().bfloat16().double()


@needs_amx
@pytest.mark.parametrize("n", [50, 40, 16, 1])   # ragged last block / odd last block / one block / one output
@pytest.mark.parametrize("m", [1, 3, 16, 17, 33, 40])
def test_results_are_the_bf16_rounding_of_the_exact_sum(m, n):
    """Every element lies between the bf16 roundings of ``exact +- e`` (``e``: Higham's float32
    bound over the K products and the bias), and equals the bf16 rounding of the exact sum
    wherever those two agree: a wrong index, layout or padding fails by O(1)."""
    ext = _ext()
    torch.manual_seed(m * 100 + n)
    k = 96
    w = torch.randn(n, k).bfloat16()
    x = torch.randn(m, k).bfloat16()
    bias = torch.randn(n)
    packed = ext.pack_bf16_weight(w)
    y = ext.bf16_linear(x, packed, bias, n)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    exact = x.double() @ w.double().t() + bias.double()
    err = gamma(k + 1, 2.0 ** -24) * (x.double().abs() @ w.double().abs().t() + bias.double().abs())
    lo, hi = _bf16_interval(exact, err)
    yd = y.double()
    assert bool(((yd >= lo) & (yd <= hi)).all())
    decided = lo == hi
    assert decided.sum() >= 0.75 * decided.numel() - 1   # most elements (a few shapes here are tiny)
    assert torch.equal(yd[decided], lo[decided])
    y0 = ext.bf16_linear(x, packed, None, n).double()
    lo0, hi0 = _bf16_interval(exact - bias.double(), err)
    assert bool(((y0 >= lo0) & (y0 <= hi0)).all())


@needs_amx
@pytest.mark.parametrize("n,k", MODEL_SHAPES + [(200, 640)])
def test_a_row_does_not_depend_on_the_batch(n, k):
    """Row r alone == row r in every batch of M = 1..40, 64 and 512 (bitwise), with a bias."""
    ext = _ext()
    gen = torch.Generator().manual_seed(n + k)
    packed = ext.pack_bf16_weight((torch.randn(n, k, generator=gen) * 0.05).bfloat16())
    bias = torch.randn(n, generator=gen)
    x = torch.randn(512, k, generator=gen).bfloat16()
    alone = torch.cat([ext.bf16_linear(x[r:r + 1].contiguous(), packed, bias, n) for r in range(40)])
    for m in list(range(1, 41)) + [64, 512]:
        y = ext.bf16_linear(x[:m].contiguous(), packed, bias, n)
        bad = [r for r in range(min(m, 40)) if not torch.equal(y[r], alone[r])]
        assert not bad, f"{n}x{k}, M={m}: rows {bad}"
    # a row in the middle of a large batch, beside other rows: the same as alone
    full = ext.bf16_linear(x, packed, bias, n)
    tail = ext.bf16_linear(x[500:].contiguous(), packed, bias, n)
    assert torch.equal(full[500:], tail)


@needs_amx
@pytest.mark.skipif(bool([f for f in BF16_GEMM_FLAGS if f not in cpu_flags()]),
                    reason=f"the AVX-512 GEMM needs the CPU flags {BF16_GEMM_FLAGS}")
@pytest.mark.parametrize("m", [1, 16, 300])
def test_agrees_with_the_avx512_gemm(m):
    """Same packed weight, same float32 accumulation and bf16 rounding, another order of the
    additions: at most one bf16 rounding step apart each side, and mostly the same bits."""
    ext = _ext()
    avx = require_built_extension(load_bf16_gemm, "the bf16 GEMM")
    torch.manual_seed(m)
    w, b = torch.randn(96, 640).bfloat16(), torch.randn(96)
    x = torch.randn(m, 640).bfloat16()
    packed = ext.pack_bf16_weight(w)
    assert torch.equal(packed, avx.pack_bf16_weight(w))   # one layout (csrc/bf16_pack.h)
    y, ref = ext.bf16_linear(x, packed, b, 96), avx.bf16_linear(x, packed, b, 96)
    want = x.double() @ w.double().t() + b.double()
    step = 2.0 ** -7 * want.abs() + 1e-30
    assert bool(((y.double() - ref.double()).abs() <= 2 * step + 1e-3).all())
    assert (y == ref).float().mean() > 0.9


@needs_amx
def test_input_checks():
    ext = _ext()
    packed = ext.pack_bf16_weight(torch.zeros(20, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.bf16_linear(torch.zeros(2, 64), packed, None, 20)
    with pytest.raises(RuntimeError, match="K=32"):
        ext.bf16_linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed, None, 20)
    with pytest.raises(RuntimeError, match="N=40"):
        ext.bf16_linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        ext.bf16_linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, torch.zeros(20).bfloat16(), 20)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ext.bf16_linear(torch.zeros(2, 48, dtype=torch.bfloat16), ext.pack_bf16_weight(torch.zeros(4, 48).bfloat16()),
                        None, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        Bf16Linear(torch.zeros(4, 48), None, ext)
    assert ext.bf16_linear(torch.zeros(0, 64, dtype=torch.bfloat16), packed, None, 20).shape == (0, 20)


@needs_amx
def test_pack_linear_layers_runs_it_and_falls_back_per_layer(tied_toy):
    """On AMX, bf16 layers and the tied head run the AMX GEMM; a layer whose input width is not a
    multiple of 32 runs the AVX-512 GEMM (fixed per layer, not by M)."""
    from pagedllm.layers.linear import pack_linear_layers

    _ext()
    model = tied_toy(out_features=24, hidden=32).to(torch.bfloat16)
    pack_linear_layers(model, torch.bfloat16, torch.device("cpu"), batch_hint=8)
    for layer in (model.model.proj, model.packed_lm_head):
        assert isinstance(layer, Bf16Linear) and AMX_KERNEL in layer._ext.compiled_isas()
    odd = tied_toy(out_features=24, hidden=48).to(torch.bfloat16)
    pack_linear_layers(odd, torch.bfloat16, torch.device("cpu"), batch_hint=8)
    assert isinstance(odd.model.proj, Bf16Linear) and AMX_KERNEL not in odd.model.proj._ext.compiled_isas()
