"""The AVX2 + FMA bf16 GEMM (pagedllm/layers/csrc/bf16_gemm_avx2.cpp): bit-equality with a torch
float32 reference of vdpbf16ps's order (per column pair: + x[2c+1] w[2c+1], then + x[2c] w[2c], each
one rounding; bias last; bf16 round to nearest even) at ragged shapes and 1-64 rows, and with the
AVX-512 BF16 GEMM where the CPU has it; batch and thread-count invariance; which kernel
``bf16_kernel_for`` / ``packed_kernel_for`` pick per flag set; greedy tokens of tiny random bf16
models alone and concurrent. The kernel tests skip on CPUs without avx2 / fma, naming them."""

import pytest
import torch

from pagedllm.layers.amx_gemm import AMX_KERNEL
from pagedllm.layers.bf16_gemm import (AVX2_BF16_FLAGS, AVX2_KERNEL, BF16_GEMM_FLAGS, BF16_KERNEL, ONEDNN_KERNEL,
                                       Bf16Linear, bf16_kernel_for, load_avx2_bf16_gemm, load_bf16_gemm)
from pagedllm.layers.linear import onednn_linear_available, pack_linear_layers, packed_kernel_for
from pagedllm.platforms.cpu import cpu_flags
from tests.cpp_build import require_built_extension

MISSING = [f for f in AVX2_BF16_FLAGS if f not in cpu_flags()]
needs_avx2 = pytest.mark.skipif(bool(MISSING), reason=f"the AVX2 bf16 GEMM needs the CPU flags {MISSING}")
MISSING_512 = [f for f in BF16_GEMM_FLAGS if f not in cpu_flags()]
AVX2_ONLY = frozenset({"sse2", "avx", "avx2", "fma", "f16c"})
AVX512_BF16 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
AMX = AVX512_BF16 | {"amx_bf16", "amx_tile"}
CPU = torch.device("cpu")


def _ext():
    return require_built_extension(load_avx2_bf16_gemm, "the AVX2 bf16 GEMM")


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """vdpbf16ps's order in torch float32: from +0, per column pair c = 0 .. K/2 - 1 add the exact
    product x[:, 2c+1] w[:, 2c+1] (one rounding: what an FMA gives), then x[:, 2c] w[:, 2c]; then the
    bias (+0 without one); round to bfloat16 to nearest even. x [M, K], w [N, K] bf16 -> [M, N] bf16."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for c in range(x.shape[1] // 2):
        for col in (2 * c + 1, 2 * c):
            acc = acc + xf[:, col:col + 1] * wf[:, col][None, :]   # the product is exact in float32
    acc = acc + (bias if bias is not None else torch.zeros(w.shape[0]))
    return acc.bfloat16()


def _case(m, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    return x, w, torch.randn(n, generator=gen)


@needs_avx2
@pytest.mark.parametrize("m", [1, 2, 3, 7, 16, 33, 64])
@pytest.mark.parametrize("n,k", [(1, 2), (15, 6), (16, 64), (17, 130), (50, 96), (100, 40)])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_bits_equal_the_vdpbf16ps_order_reference(m, n, k, with_bias):
    """N below, at and past a block of 16 (odd block counts for the 2-block tile), K from one pair."""
    ext = _ext()
    x, w, bias = _case(m, n, k, seed=1000 * m + n + k)
    bias = bias if with_bias else None
    y = ext.bf16_linear(x, ext.pack_bf16_weight(w), bias, n)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    want = reference(x, w, bias)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


@needs_avx2
def test_overflow_infinities_and_nan():
    """Sums past bf16's largest finite round to +-inf; inf inputs give inf / NaN as the reference;
    a NaN result is a NaN."""
    ext = _ext()
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[1.0, 1.0, 2.0, -1.0]]).bfloat16()
    w = torch.tensor([[3.0e38] * 4, [-3.0e38] * 4, [1.0, 0.0, 0.0, 0.0], [inf, 0.0, 1.0, 0.0],
                      [nan, 1.0, 1.0, 1.0]]).bfloat16()
    y = ext.bf16_linear(x, ext.pack_bf16_weight(w), None, 5)
    want = reference(x, w, None)
    assert torch.isnan(y[0, 4]) and torch.isnan(want[0, 4])
    assert torch.equal(y[:, :4], want[:, :4])
    assert y[0, 0] == float("inf") and y[0, 1] == float("-inf") and y[0, 3] == float("inf")


@needs_avx2
def test_odd_k_is_refused_and_inputs_are_checked():
    ext = _ext()
    with pytest.raises(RuntimeError, match="even"):
        ext.pack_bf16_weight(torch.zeros(4, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 2"):
        Bf16Linear(torch.zeros(4, 5), None, ext)
    packed = ext.pack_bf16_weight(torch.zeros(20, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.bf16_linear(torch.zeros(2, 8), packed, None, 20)
    with pytest.raises(RuntimeError, match="K=6"):
        ext.bf16_linear(torch.zeros(2, 6, dtype=torch.bfloat16), packed, None, 20)
    with pytest.raises(RuntimeError, match="bias"):
        ext.bf16_linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, torch.zeros(20).bfloat16(), 20)
    assert ext.bf16_linear(torch.zeros(0, 8, dtype=torch.bfloat16), packed, None, 20).shape == (0, 20)
    assert ext.compiled_isas() == [AVX2_KERNEL]


@needs_avx2
def test_a_row_does_not_depend_on_the_batch_or_the_threads():
    """Row 0 alone is row 0 of a batch of 64 (and every prefix of it; both tiles: 1-3 rows and 4+),
    at the default model's o_proj width, and with one thread as with the default."""
    ext = _ext()
    x, w, bias = _case(64, 200, 1024, seed=7)
    packed = ext.pack_bf16_weight(w)
    full = ext.bf16_linear(x, packed, bias, 200)
    assert torch.equal(ext.bf16_linear(x[:1].contiguous(), packed, bias, 200), full[:1])
    for m in (1, 2, 3, 4, 5, 6, 7, 13, 33, 63):
        assert torch.equal(ext.bf16_linear(x[:m].contiguous(), packed, bias, 200), full[:m]), m
    assert torch.equal(ext.bf16_linear(x[37:38].contiguous(), packed, bias, 200), full[37:38])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.bf16_linear(x, packed, bias, 200)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, full)


@needs_avx2
@pytest.mark.skipif(bool(MISSING_512), reason=f"the AVX-512 BF16 GEMM to compare with needs the CPU flags {MISSING_512}")
@pytest.mark.parametrize("m", [1, 3, 16, 33])
def test_bits_equal_the_avx512_bf16_gemm(m):
    """Where the CPU has vdpbf16ps: the same bits as the AVX-512 kernel on normal-range inputs."""
    ext = _ext()
    avx512 = require_built_extension(load_bf16_gemm, "the AVX-512 BF16 GEMM")
    x, w, bias = _case(m, 100, 640, seed=m)
    packed = ext.pack_bf16_weight(w)
    assert torch.equal(packed, avx512.pack_bf16_weight(w))
    for b in (bias, None):
        assert torch.equal(ext.bf16_linear(x, packed, b, 100).view(torch.int16),
                           avx512.bf16_linear(x, packed, b, 100).view(torch.int16))


@needs_avx2
def test_chooser_per_flag_set():
    """avx2 + fma without avx512_bf16 / AMX: the AVX2 GEMM, naming why not the AVX-512 one; the
    AVX-512 BF16 and AMX choices as before (on a CPU that cannot build them, the next one, naming
    why); cpu_isa "portable" and a CPU without avx2 keep oneDNN; forcing works both ways."""
    _ext()
    kernel, why = bf16_kernel_for("auto", AVX2_ONLY)
    assert kernel == AVX2_KERNEL and "avx512_bf16" in why and "batch-invariant" in why
    kernel, why = bf16_kernel_for("auto", AVX2_ONLY - {"fma"})
    assert kernel == ONEDNN_KERNEL and "AVX2 GEMM" in why            # no avx2 + fma path: portable
    kernel, why = bf16_kernel_for("portable", AVX2_ONLY)
    assert kernel == ONEDNN_KERNEL and "portable" in why
    kernel, why = bf16_kernel_for("auto", AVX512_BF16)
    assert kernel == (BF16_KERNEL if not MISSING_512 else AVX2_KERNEL), why
    if MISSING_512:
        assert "not the AVX-512 GEMM" in why
    kernel, why = bf16_kernel_for("avx512", AVX512_BF16)                 # a forced path below avx512_bf16
    assert kernel == AVX2_KERNEL and "avx512_bf16" in why
    kernel, why = bf16_kernel_for("auto", AVX512_BF16, kernel=AVX2_KERNEL)
    assert kernel == AVX2_KERNEL and "cpu_bf16_gemm" in why
    kernel, why = bf16_kernel_for("auto", AVX2_ONLY, kernel=ONEDNN_KERNEL)
    assert kernel == ONEDNN_KERNEL and "cpu_bf16_gemm" in why
    amx_here = not MISSING_512 and "amx_bf16" in cpu_flags() and "amx_tile" in cpu_flags()
    kernel, why = bf16_kernel_for("auto", AMX)
    assert kernel == (AMX_KERNEL if amx_here else BF16_KERNEL if not MISSING_512 else AVX2_KERNEL), why
    kernel, why = bf16_kernel_for("auto", AMX, batch_invariant=False)
    assert kernel == ONEDNN_KERNEL and "AMX" in why


@needs_avx2
def test_packed_kernel_for_and_the_kernel_plan_on_avx2():
    """bf16 linear layers on an AVX2-only flag set: our GEMM, with no "float32 is faster" warning;
    ``cpu_bf16_gemm="onednn"`` there is oneDNN's kernel where it has bf16, else ``F.linear``."""
    from pagedllm.config import KernelConfig, ModelConfig
    from pagedllm.distributed.parallel_state import ParallelContext
    from pagedllm.worker.kernel_plan import choose_kernel_plan

    _ext()
    kind, why = packed_kernel_for(torch.bfloat16, CPU, flags=AVX2_ONLY)
    assert kind == AVX2_KERNEL, why
    kind, why = packed_kernel_for(torch.bfloat16, CPU, flags=AVX2_ONLY, cpu_bf16_gemm="onednn")
    assert kind == ("onednn" if onednn_linear_available(torch.bfloat16) else "torch"), why
    plan = choose_kernel_plan(ModelConfig(dtype="bfloat16"), KernelConfig(), CPU, ParallelContext(), flags=AVX2_ONLY)
    assert plan.linear.kind == AVX2_KERNEL and plan.linear.packed and plan.warnings == ()
    assert "bf16 GEMM (AVX2 + FMA)" in plan.table()


@needs_avx2
@pytest.mark.skipif(bool(not MISSING_512), reason="the CPU has avx512_bf16 (its own GEMM runs by default)")
def test_pack_linear_layers_runs_the_avx2_gemm(tied_toy):
    """Without avx512_bf16 the layers and the tied head run the AVX2 GEMM (the head's logits the
    reference's bits); a layer with an odd input width stays a torch / oneDNN layer."""
    ext = _ext()
    torch.manual_seed(0)
    model = tied_toy(out_features=24, hidden=32).to(torch.bfloat16)
    odd = torch.nn.Linear(7, 5).to(torch.bfloat16)
    model.model.odd = odd
    x = torch.randn(3, 32).bfloat16()
    pack_linear_layers(model, torch.bfloat16, CPU, batch_hint=8)
    assert isinstance(model.model.proj, Bf16Linear) and model.model.proj._ext is ext
    assert isinstance(model.packed_lm_head, Bf16Linear)
    assert torch.equal(model.packed_lm_head(x), reference(x, model.model.embed_tokens.weight, None))
    assert not isinstance(model.model.odd, Bf16Linear)
    xo = torch.randn(2, 7).bfloat16()
    assert torch.equal(model.model.odd(xo), odd(xo))


@needs_avx2
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tiny_bf16_model_greedy_alone_equals_concurrent(make_tiny_checkpoint, arch):
    """A tiny random bf16 Llama / Gemma 3 (untied head) on the AVX2 GEMM: each prompt's greedy
    tokens alone are the same as with all prompts in one batch (mixed prefill and decode steps)."""
    from pagedllm import LLM, SamplingParams

    _ext()
    path = make_tiny_checkpoint(arch, tie_word_embeddings=False)
    llm = LLM(path, dtype="bfloat16", max_model_len=128, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=32,
              enable_prefix_caching=False, cpu_bf16_gemm=AVX2_KERNEL)
    model = llm.llm_engine.executor.driver_worker.model
    layers = [m for m in model.modules() if isinstance(m, Bf16Linear)]
    assert layers and all(m._ext.compiled_isas() == [AVX2_KERNEL] for m in layers)
    prompts = [[5 + (7 * i + 3 * j) % 200 for j in range(n)] for i, n in enumerate([3, 40, 1, 17, 9])]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def tokens(batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    together = tokens(prompts)
    alone = [tokens([p])[0] for p in prompts]
    assert alone == together
