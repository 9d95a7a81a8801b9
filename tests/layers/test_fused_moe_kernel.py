"""The one-call float32 MoE kernel (pagedllm/layers/csrc/f32_moe.cpp) against ``FusedMoE``'s
per-expert path through the same float32 GEMM layers: the same bits at 1, 2, 16 and 37 tokens,
top 2 and top 4 of 8 experts, some experts with no rows, with and without the fused SiLU op;
batch and thread independence; expert parallelism and sliced experts (one rank's share); the AVX2
build against the AVX-512 build; where it does not run (bias, width not a multiple of 16, other
kernels). Runs where the CPU has the float32 GEMM's flags; skipped elsewhere, naming them."""

import dataclasses

import pytest
import torch

from pagedllm.distributed.parallel_state import ParallelContext
from pagedllm.layers.f32_gemm import F32_GEMM_FLAGS, F32Linear, load_f32_gemm
from pagedllm.layers.f32_moe import EXTENSION, load_f32_moe, stack_f32_experts, torch_silu_vector_span
from pagedllm.layers.fused_moe import FusedMoE, parameter_bytes
from pagedllm.layers.linear import PackedLinear
from pagedllm.platforms.cpu import cpu_flags
from pagedllm.platforms.cpu_extension import load_extension
from tests.cpp_build import require_built_extension

MISSING = [f for f in F32_GEMM_FLAGS if f not in cpu_flags()]
MISSING_FOR_AVX512 = [f for f in ("avx512f",) + F32_GEMM_FLAGS if f not in cpu_flags()]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"the float32 GEMM needs the CPU flags {MISSING}")
E, H, I = 8, 80, 48   # H not a multiple of 16: the down GEMM's last block is partial


def _moe(top_k: int = 2, inter: int = I, ctx: ParallelContext | None = None, seed: int = 0) -> FusedMoE:
    """A FusedMoE with random weights, its experts moved into float32 GEMM layers."""
    ext = require_built_extension(load_f32_gemm, "the float32 GEMM")
    require_built_extension(load_f32_moe, "the float32 MoE kernel")
    moe = FusedMoE(E, top_k, H, inter, renormalize=True, ctx=ctx)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        moe.w13_weight.copy_(torch.randn(moe.w13_weight.shape, generator=g) * 0.2)
        moe.w2_weight.copy_(torch.randn(moe.w2_weight.shape, generator=g) * 0.2)
    moe.replace_expert_layers(lambda w, b: F32Linear(w, b, ext))
    return moe


def _routing(tokens: int, top_k: int, seed: int, experts: tuple[int, ...] = tuple(range(E))):
    """Random routing over ``experts`` only (the others get no rows): weights [T, k] float32
    (positive, summing to 1), ids [T, k] int64 (distinct per token)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(experts), generator=g)[:top_k]] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return weights, ids


def _per_expert(moe: FusedMoE, x, weights, ids) -> torch.Tensor:
    """The per-expert path's sorted branch (at one token it has its own shortcut, which rounds the
    second expert's add differently: the token is run twice and its first copy kept)."""
    moe.use_f32_moe = False
    try:
        if x.shape[0] == 1:
            return moe.apply_experts(x.repeat(2, 1), weights.repeat(2, 1), ids.repeat(2, 1))[:1]
        return moe.apply_experts(x, weights, ids)
    finally:
        moe.use_f32_moe = True


@pytest.mark.parametrize("top_k", [2, 4])
@pytest.mark.parametrize("fused_silu", [False, True])
def test_kernel_equals_the_per_expert_path_bit_for_bit(top_k, fused_silu):
    moe = _moe(top_k)
    assert moe.w13_packed is not None and moe.w13_packed.shape == (E, 2 * I // 16, H, 16)
    assert moe.w2_packed.shape == (E, (H + 15) // 16, I, 16)
    moe.use_fused_ops = fused_silu
    for tokens in (1, 2, 16, 37):
        for seed, experts in enumerate([tuple(range(E)), (1, 2, 5, 6)]):   # then 4 experts with no rows
            weights, ids = _routing(tokens, top_k, seed, experts)
            x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens + seed))
            with torch.inference_mode():
                got = moe.apply_experts(x, weights, ids)
                want = _per_expert(moe, x, weights, ids)
            assert got.dtype == torch.float32 and got.shape == (tokens, H)
            assert torch.equal(got, want), (tokens, experts, (got - want).abs().max().item())


def test_forward_routes_then_runs_the_kernel():
    moe = _moe(2)
    g = torch.Generator().manual_seed(3)
    x, logits = torch.randn(5, H, generator=g), torch.randn(5, E, generator=g)
    with torch.inference_mode():
        got = moe(x, logits)
        moe.use_f32_moe = False
        want = moe(x, logits)
    assert torch.equal(got, want)


def test_a_tokens_result_does_not_depend_on_the_batch_or_the_threads():
    moe = _moe(2)
    weights, ids = _routing(37, 2, seed=7)
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(7))
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            alone = torch.cat([moe.apply_experts(x[t:t + 1], weights[t:t + 1], ids[t:t + 1]) for t in range(37)])
            for n_threads in {1, max(2, threads)}:
                torch.set_num_threads(n_threads)
                for m in (2, 13, 24, 37):   # both tile shapes (24 rows of one expert and more)
                    assert torch.equal(moe.apply_experts(x[:m], weights[:m], ids[:m]), alone[:m]), (m, n_threads)
                same = torch.zeros_like(ids)   # every token on expert 0 and 1: 37 rows each
                same[:, 1] = 1
                batch = moe.apply_experts(x, weights, same)
                assert torch.equal(batch[5:6], moe.apply_experts(x[5:6], weights[5:6], same[5:6]))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["whole-experts", "sliced"])
def test_one_ranks_share_equals_its_per_expert_path(expert_parallel):
    """Rank 1 of 2: experts 4-7 whole (tokens routed only to 0-3 get zeros), or every expert at half width."""
    ctx = ParallelContext(rank=1, tp_rank=1, tp_size=2, enable_expert_parallel=expert_parallel)
    moe = _moe(2, inter=2 * I, ctx=ctx)
    assert moe.w13_packed.shape[0] == (4 if expert_parallel else 8)
    weights, ids = _routing(16, 2, seed=11)
    ids[3] = torch.tensor([0, 2])                   # no local expert when whole
    ids[4] = torch.tensor([1, 6])                   # the first slot held elsewhere
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(11))
    with torch.inference_mode():
        got = moe.apply_experts(x, weights, ids)
        want = _per_expert(moe, x, weights, ids)
    assert torch.equal(got, want)
    if expert_parallel:
        assert torch.equal(got[3], torch.zeros(H))


def test_weight_bytes_count_the_stacked_experts_once():
    moe = _moe(2)
    packed = sum(t.numel() * t.element_size() for t in (moe.w13_packed, moe.w2_packed))
    layers = sum(layer.packed_weight.numel() * 4 for pair in moe.expert_layers for layer in pair)
    assert packed == layers                                     # the layers read slices of the stack
    assert moe.expert_layers[3][1].packed_weight.data_ptr() == moe.w2_packed[3].data_ptr()
    assert parameter_bytes(moe) == (packed, packed * 2 // E)


def test_other_layers_keep_the_per_expert_path():
    ext = require_built_extension(load_f32_gemm, "the float32 GEMM")
    w13, w2 = torch.randn(2 * I, H), torch.randn(H, I)
    assert stack_f32_experts([[F32Linear(w13, None, ext), F32Linear(w2, None, ext)]], I) is not None
    odd13, odd2 = torch.randn(2 * 40, H), torch.randn(H, 40)    # width 40: not a multiple of 16
    assert stack_f32_experts([[F32Linear(odd13, None, ext), F32Linear(odd2, None, ext)]], 40) is None
    with_bias = F32Linear(w13, torch.zeros(2 * I), ext)
    assert stack_f32_experts([[with_bias, F32Linear(w2, None, ext)]], I) is None
    assert stack_f32_experts([[PackedLinear(w13, None, 16), PackedLinear(w2, None, 16)]], I) is None
    moe = _moe(2, inter=40)                                     # runs, through the per-expert layers
    weights, ids = _routing(3, 2, seed=2)
    x = torch.randn(3, H)
    assert moe.w13_packed is None and moe.apply_experts(x, weights, ids).shape == (3, H)


@pytest.mark.skipif(bool(MISSING_FOR_AVX512),
                    reason=f"comparing the AVX2 code with the AVX-512 code needs the CPU flags {MISSING_FOR_AVX512}")
def test_avx2_code_gives_the_avx512_codes_bits():
    moe = _moe(2)
    flags = tuple(f for f in EXTENSION.extra_cflags if f != "-march=native") + ("-march=native", "-mno-avx512f")
    avx2 = require_built_extension(lambda: load_extension(dataclasses.replace(EXTENSION, label="f32_moe_avx2",
                                                                              extra_cflags=flags)),
                                   "the float32 MoE kernel's AVX2 build")
    assert load_f32_moe().compiled_isas() == ["avx512"] and avx2.compiled_isas() == ["avx2"]
    for tokens in (1, 16, 37):
        weights, ids = _routing(tokens, 2, seed=tokens)
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
        with torch.inference_mode():
            want = moe.apply_experts(x, weights, ids)
            got = avx2.f32_moe(x, weights, ids, moe.w13_packed, moe.w2_packed, 0, I - I % torch_silu_vector_span())
        assert torch.equal(got, want), tokens
