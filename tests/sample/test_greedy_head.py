"""The exact greedy head (sample/greedy_head.py): the bound holds on every element, the two-pass
argmax equals the float64 argmax of the exact head (near-ties, ulp-level ties, duplicated rows:
lowest index), and a tiny model's greedy tokens are the same with the switch on and off.

Reference: float64 ``x @ W^T`` of the values as stored (float32 / bf16 products are exact in
float64; the float64 sum's error, ~1e-13 relative here, is far below every bound and gap tested,
except in the cancellation tests, which compare exact rationals instead)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from pagedllm.layers.int8_gemm import int8_avx2_unavailable, missing_vnni_flags
from pagedllm.layers.linear import onednn_linear_available
from pagedllm.layers.weight_only import weight_only_available
from pagedllm.layers.bf16_gemm import (AVX2_BF16_FLAGS, AVX2_BF16_PATHS, AVX2_EXTENSION, AVX2_KERNEL, Bf16Linear,
                                       load_avx2_bf16_gemm)
from pagedllm.platforms.cpu_extension import kernel_unavailable
from pagedllm.platforms.cpu import cpu_flags, resolve_cpu_isa
from pagedllm.sample.greedy_head import (GREEDY_HEAD_MAX_ROWS, INT8_AVX2_BF16_MAX_ROWS, MAX_CANDIDATES, ExactGreedyHead,
                                         choose_greedy_head, gamma, greedy_head_max_rows, round_up_to_bf16)

BF16_OK = onednn_linear_available(torch.bfloat16)
INT8_OK = weight_only_available("int8_weight_only")
VNNI_MISSING = missing_vnni_flags()
VNNI_OK = not VNNI_MISSING
AVX2_WHY = int8_avx2_unavailable()
AVX2_OK = AVX2_WHY is None


def _bf16_logit_head_kernel():
    """The AVX2 bf16 GEMM the bf16-logit head re-scores on (with the int8 kernel's AVX2 code), or a
    skip naming what this CPU lacks (looked up in the test: no compile at collection)."""
    why = AVX2_WHY or kernel_unavailable(AVX2_EXTENSION, AVX2_KERNEL, resolve_cpu_isa("auto"), AVX2_BF16_PATHS,
                                         AVX2_BF16_FLAGS, cpu_flags())
    if why:
        pytest.skip(f"the bf16-logit head needs the int8 kernel's AVX2 code and the AVX2 bf16 GEMM: {why}")
    return load_avx2_bf16_gemm()
KINDS = [pytest.param("bf16", marks=pytest.mark.skipif(
             not BF16_OK, reason="no native bf16 oneDNN inner product on this CPU (avx512_bf16 / AMX)")),
         pytest.param("int8", marks=pytest.mark.skipif(
             not INT8_OK, reason="aten._weight_int8pack_mm does not run here")),
         pytest.param("int8_vnni", marks=pytest.mark.skipif(
             not VNNI_OK, reason=f"the VNNI int8 kernel needs the CPU flags {VNNI_MISSING}")),
         pytest.param("int8_avx2", marks=pytest.mark.skipif(
             not AVX2_OK, reason=f"the int8 kernel's AVX2 code does not run here: {AVX2_WHY}"))]
DTYPES = [torch.float32, torch.bfloat16]


def _weights(v: int, k: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of different scales and a few outlier columns, as an embedding has.
    w = torch.randn(v, k, generator=g) * torch.rand(v, 1, generator=g) * 0.1
    w[:, :4] *= 8
    return w.to(dtype)


def _hidden(m: int, k: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (0.5 + 3 * torch.rand(m, 1, generator=g))
    x[:, 7] *= 20  # a massive activation
    return x.to(dtype)


def _planted(w: torch.Tensor, m: int, seed: int, noise: float = 0.05) -> torch.Tensor:
    """[m, K] rows like a language model's last hidden state: a small random part plus three
    planted tokens scoring about 2..2.5 each (their order decided by gaps of the order of the
    cheap error), far above the rest."""
    g = torch.Generator().manual_seed(seed)
    wf = w.float()
    x = torch.randn(m, w.shape[1], generator=g) * noise
    for _ in range(3):
        t = torch.randint(0, w.shape[0], (m,), generator=g)
        wt = wf[t]
        x += wt / (wt.norm(dim=1, keepdim=True) ** 2) * (2.0 + 0.5 * torch.rand(m, 1, generator=g))
    return x.to(w.dtype)


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().t()


def test_gamma_and_round_up():
    assert gamma(640, 2.0 ** -24) == pytest.approx(640 * 2.0 ** -24, rel=1e-4)
    with pytest.raises(ValueError):
        gamma(2 ** 24, 2.0 ** -24)
    t = torch.tensor([1.0, 1.0 + 2 ** -10, 3.3e-5, 0.0])
    up = round_up_to_bf16(t)
    assert torch.equal(up.to(torch.bfloat16).float(), up)        # bf16 values
    assert bool((up >= t).all())
    assert up[1].item() == 1.0 + 2 ** -7                          # the next bf16 above 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bound_holds_on_every_element(kind, dtype):
    """|c - r| <= B on 4,096 rows x 2,048 tokens, K = 640 (and the bound is not vacuous)."""
    w = _weights(2048, 640, dtype, seed=1)
    head = ExactGreedyHead(w, kind, 64)
    worst = 0.0
    for seed in range(64):
        x = _hidden(64, 640, dtype, seed=100 + seed)
        c, bound = head.error_bound(x)
        err = (c.double() - _exact(x, w)).abs()
        assert bool((err <= bound).all()), f"bound violated, seed {seed}: max err/B {float((err / bound).max())}"
        worst = max(worst, float((err / bound).max()))
    assert worst > 1e-3  # measured ~0.1-0.5: the bound is within a few hundred x of the error


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 32, 64])
def test_random_rows_equal_float64_argmax(kind, dtype, m):
    w = _weights(6000, 640, dtype, seed=2)
    head = ExactGreedyHead(w, kind, 64)
    # int8's bound is ~2.5x bf16's (s_j / 2 per weight): a quieter bulk keeps its windows narrow.
    x = _planted(w, m, seed=m, noise=0.05 if kind == "bf16" else 0.01)
    tokens, fallback = head.argmax(x)
    r = _exact(x, w)
    assert torch.equal(tokens[~fallback], r.argmax(dim=1)[~fallback])
    assert bool((tokens[fallback] == -1).all())
    if kind == "bf16":  # int8's wider bound (s_j / 2 per weight) sends some rows to the full head
        assert not bool(fallback.any())


def _near_tie_weights(dtype, delta: float):
    """W whose rows 9 and 4 score within ``delta`` of each other and above every other row
    for x = ones: row 4 = base, row 9 = base with one column raised by ``delta``."""
    w = _weights(3000, 640, torch.float32, seed=3) * 0.1
    base = torch.full((640,), 0.05)
    w[4] = base
    w[9] = base
    w[9, 100] += delta
    return w.to(dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_near_ties_below_the_cheap_error(kind, dtype):
    x = torch.ones(3, 640, dtype=dtype)
    x[1] *= 1.5
    x[2, 100] = 2.0
    # bf16 spacing at 0.05 is 2^-12: raise one column by one ulp of its dtype.
    w = _near_tie_weights(dtype, 2 ** -12 if dtype == torch.bfloat16 else 2 ** -28)
    head = ExactGreedyHead(w, kind, 8)
    c, bound = head.error_bound(x)
    r = _exact(x, w)
    assert bool(((r[:, 9] - r[:, 4]).abs() < bound[:, 9]).all())   # below the cheap pass's resolution
    tokens, fallback = head.argmax(x)
    assert not bool(fallback.any())
    assert tokens.tolist() == [9, 9, 9] == r.argmax(dim=1).tolist()
    # The other direction: row 9 lowered by the same amount -> row 4 wins.
    w2 = w.clone()
    w2[9, 100] = w2[4, 100] - (w[9, 100] - w[4, 100])
    tokens2, _ = ExactGreedyHead(w2, kind, 8).argmax(x)
    assert tokens2.tolist() == [4, 4, 4] == _exact(x, w2).argmax(dim=1).tolist()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_duplicated_rows_take_the_lowest_index(kind, dtype):
    w = _weights(3000, 640, torch.float32, seed=4) * 0.1
    top = torch.full((640,), 0.05)
    for j in (2900, 17, 1234):
        w[j] = top
    w = w.to(dtype)
    x = torch.ones(2, 640, dtype=dtype)
    tokens, fallback = ExactGreedyHead(w, kind, 8).argmax(x)
    assert not bool(fallback.any())
    assert tokens.tolist() == [17, 17] == _exact(x, w).argmax(dim=1).tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_cancellation_decided_exactly(kind):
    """Scores that float64 cannot order (|x|_1 ~ 2^61, gap 2^-53): the fsum path decides, and
    exact ties among them take the lowest index."""
    k, v = 640, 16
    x = torch.zeros(1, k)
    x[0, 0], x[0, 1], x[0, 2] = 2.0 ** 60, -(2.0 ** 60), 2.0 ** -30
    w = torch.full((v, k), 0.25)
    w[:, 2] = 0.5
    w[11, 2] = 0.5 + 2 ** -24          # exact score 2^-31 (1 + 2^-23): the largest
    w[3, 0] = w[3, 1] = 0.5            # r_3 = 2^-31, as every other row: ties
    head = ExactGreedyHead(w, kind, 1)
    tokens, fallback = head.argmax(x)
    exact = [sum(Fraction(a) * Fraction(b) for a, b in zip(x[0].tolist(), w[j].tolist())) for j in range(v)]
    assert not bool(fallback.any())
    assert tokens.tolist() == [max(range(v), key=lambda j: (exact[j], -j))] == [11]
    w[11, 2] = 0.5                     # now all tie exactly: lowest index
    tokens, _ = ExactGreedyHead(w, kind, 1).argmax(x)
    assert tokens.tolist() == [0]


@pytest.mark.parametrize("kind", KINDS)
def test_non_finite_and_wide_rows_fall_back(kind):
    w = _weights(4096, 64, torch.float32, seed=5)
    head = ExactGreedyHead(w, kind, 4)
    x = _hidden(3, 64, torch.float32, seed=6)
    x[1, 0] = float("nan")
    x[2] = 0.0                                        # every token scores 0: a 4096-way tie
    tokens, fallback = head.argmax(x)
    if head.max_candidates < 4096:                    # bf16, int8: too many candidates
        assert fallback.tolist() == [False, True, True]
        assert head.num_fallback_rows == 2
    else:                                             # int8_vnni takes up to 4096: the exact tie, lowest id
        assert fallback.tolist() == [False, True, False] and tokens[2].item() == 0
        assert head.num_fallback_rows == 1
    assert tokens[0].item() == _exact(x[:1], w).argmax().item()
    assert head.num_rows == 3
    assert MAX_CANDIDATES < 4096


def test_choose_greedy_head_rules():
    cpu = torch.device("cpu")
    assert choose_greedy_head("off", torch.float32, cpu, 1, None)[0] is None
    # A bfloat16 model keeps its bf16 head's argmax (ties included), on every CPU.
    assert choose_greedy_head("auto", torch.bfloat16, cpu, 1, None)[0] is None
    assert choose_greedy_head("auto", torch.bfloat16, cpu, 1, None, cpu_isa="avx2")[0] is None
    assert choose_greedy_head("auto", torch.float16, cpu, 1, None)[0] is None
    assert choose_greedy_head("auto", torch.float32, cpu, 2, None)[0] is None
    assert choose_greedy_head("auto", torch.float32, cpu, 1, "int8")[0] is None
    assert choose_greedy_head("auto", torch.float32, cpu, 1, None, is_last_stage=False)[0] is None
    kind, why = choose_greedy_head("auto", torch.float32, cpu, 1, None)
    want = "int8_vnni" if VNNI_OK else ("bf16" if BF16_OK else None)
    assert kind == want and why
    assert kind is None or GREEDY_HEAD_MAX_ROWS[kind] > 0
    if VNNI_OK:   # a forced path below avx512 leaves the VNNI kernel out: the bf16 pass (where native bf16)
        forced = choose_greedy_head("auto", torch.float32, cpu, 1, None, cpu_isa="avx2")[0]
        assert forced == ("bf16" if BF16_OK else None)
    # With the head's hidden size known, a CPU without VNNI or native bf16 takes the AVX2 int8 pass
    # (hidden sizes that are multiples of 16, up to 1024).
    fits = choose_greedy_head("auto", torch.float32, cpu, 1, None, hidden_size=640)[0]
    assert fits == (kind if kind is not None else ("int8_avx2" if AVX2_OK else None))
    if AVX2_OK:
        assert GREEDY_HEAD_MAX_ROWS["int8_avx2"] > 0
        for hidden in (2048, 650):
            kind2, why2 = choose_greedy_head("auto", torch.float32, cpu, 1, None, hidden_size=hidden)
            assert kind2 is None and str(hidden) in why2
        kind2, why2 = choose_greedy_head("auto", torch.float32, cpu, 1, None, cpu_isa="portable", hidden_size=640)
        assert kind2 is None and "portable" in why2
    assert choose_greedy_head("auto", torch.float32, cpu, 1, "gguf")[0] == kind  # dequantized: as None
    with pytest.raises(ValueError, match="exact_greedy_head"):
        choose_greedy_head("on", torch.float32, cpu, 1, None)


def _generate(path, mode, params, prompts, dtype="float32", **kwargs):
    from pagedllm import LLM

    llm = LLM(path, dtype=dtype, max_model_len=128, seed=0, kv_cache_memory_bytes=64 << 20,
              exact_greedy_head=mode, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    return outs, runner.greedy_head


@pytest.mark.skipif(not (BF16_OK or VNNI_OK or AVX2_OK), reason=f"the exact greedy head's auto rule needs native "
                    f"bf16 (avx512_bf16 / AMX), the VNNI int8 kernel or its AVX2 code ({AVX2_WHY})")
@pytest.mark.parametrize("arch", ["gemma3", "llama", "qwen2"])
def test_tiny_model_tokens_same_on_and_off(arch, make_tiny_checkpoint):
    """Greedy tokens with the switch on equal those with it off (and those are transformers'
    in tests/models/test_hf_parity.py); mixed batches keep every row's output."""
    from pagedllm import SamplingParams

    path = make_tiny_checkpoint(arch)
    prompts = [[5 + (7 * i + 3 * j) % 300 for j in range(3 + 5 * i)] for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    mixed = [greedy,
             SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=10, min_tokens=5),
             SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
             greedy]
    # At most as many rows per step as every kind's head takes (the AVX2 kind's 4), so the
    # head runs on each CPU kind rather than every step falling back to the full head.
    rows = min(GREEDY_HEAD_MAX_ROWS.values())
    for params in (greedy, mixed):
        on, head = _generate(path, "auto", params, prompts, max_num_seqs=rows)
        off, none = _generate(path, "off", params, prompts, max_num_seqs=rows)
        assert none is None and head is not None and head.num_rows > 0
        assert head.num_fallback_rows == 0
        for a, b in zip(on, off):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob
            if b.outputs[0].logprobs is not None:
                assert [list(d) for d in a.outputs[0].logprobs] == [list(d) for d in b.outputs[0].logprobs]
    # n > 1 greedy forks read their parent's row.
    on, _ = _generate(path, "auto", SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True), prompts[:2])
    off, _ = _generate(path, "off", SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True), prompts[:2])
    assert [[c.token_ids for c in o.outputs] for o in on] == [[c.token_ids for c in o.outputs] for o in off]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_whole_row_bound_path(kind, dtype, monkeypatch):
    """Rows whose window reaches more than MAX_HIT_BLOCKS blocks take the whole-row bound: forced
    here for every row (MAX_HIT_BLOCKS = 0), the tokens still equal the float64 argmax."""
    import pagedllm.sample.greedy_head as greedy_head

    w = _weights(3000, 640, dtype, seed=7)
    x = _planted(w, 9, seed=8, noise=0.05 if kind == "bf16" else 0.01)
    expected = ExactGreedyHead(w, kind, 16).argmax(x)
    monkeypatch.setattr(greedy_head, "MAX_HIT_BLOCKS", 0)
    tokens, fallback = ExactGreedyHead(w, kind, 16).argmax(x)
    assert torch.equal(fallback, expected[1])
    assert torch.equal(tokens, expected[0])
    assert torch.equal(tokens[~fallback], _exact(x, w).argmax(dim=1)[~fallback])
    if kind == "bf16":
        assert not bool(fallback.any())


VNNI_ONLY = pytest.mark.skipif(not VNNI_OK, reason=f"the VNNI int8 kernel needs the CPU flags {VNNI_MISSING}")


@VNNI_ONLY
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [4099, 6000])
def test_int8_vnni_fused_pass_equals_the_two_pass_path(dtype, v):
    """The C++ pass (bound, candidates and float64 re-score in one call) gives the torch two-pass
    path's tokens and fallbacks and the float64 argmax, at every row count the engine sends (a
    vocabulary that is not a multiple of 16 masks the last block)."""
    w = _weights(v, 640, dtype, seed=9)
    head = ExactGreedyHead(w, "int8_vnni", 64)
    for m in (1, 7, 12, 13, 40, 100):
        x = _planted(w, m, seed=100 + m, noise=0.01)
        last = w[v - 1].float()
        x[0] = (last / last.norm() ** 2 * 20.0).to(dtype)       # row 0's best token is in the last block
        fused = head._argmax_fused(x)
        two_pass = head._argmax_two_pass(x)
        assert torch.equal(fused[1], two_pass[1]) and torch.equal(fused[0], two_pass[0])
        ref = _exact(x, w).argmax(dim=1)
        assert torch.equal(fused[0][~fused[1]], ref[~fused[1]])
        assert int(fused[1].sum()) == 0
    assert ref[0].item() == v - 1


@VNNI_ONLY
def test_int8_vnni_fused_candidates_and_statuses():
    """The kernel's statuses: more candidates than the limit -> 1 (token -1), a rival within the
    float64 error bounds -> 2 (resolved by the exact path), else 0 with the float64 argmax; the
    candidate count equals the two-pass path's count of c_j + B_j >= max (c - B)."""
    w = _weights(3000, 640, torch.float32, seed=10)
    head = ExactGreedyHead(w, "int8_vnni", 8)
    x = _planted(w, 6, seed=11, noise=0.01)
    xd = x.double()
    n1, xinf = xd.abs().sum(dim=1), xd.abs().amax(dim=1)
    term = head._vnni_row_term(n1, xinf)
    from pagedllm.sample.greedy_head import _float32_up

    def call(limit):
        return head._ext.int8_greedy_argmax(x, head.packed, head.row_sums, head.scales, head.vocab_size,
                                            head._weight_c, head._err2, head._amax2, _float32_up(n1),
                                            _float32_up(term), limit, head.g64)
    tokens, status, counts = call(4096)
    c, bound = head.error_bound(x)
    cd = c.double()
    want = (cd + bound >= (cd - bound).amax(dim=1, keepdim=True)).sum(dim=1)
    # float32 evaluation of the bound may only add candidates at its rounding edge (none here).
    assert counts.tolist() == want.tolist()
    assert status.tolist() == [0] * 6
    assert torch.equal(tokens, _exact(x, w).argmax(dim=1))
    few = int(counts.min()) - 1
    tokens, status, _ = call(few)
    assert [s == 1 for s in status.tolist()] == [cnt > few for cnt in counts.tolist()]
    assert bool((tokens[status == 1] == -1).all())
    # Two identical rows of W at the top: the rival is within the float64 bound -> status 2.
    w2 = w.clone()
    top = int(_exact(x[:1], w).argmax())
    w2[2999] = w2[top]
    head2 = ExactGreedyHead(w2, "int8_vnni", 8)
    _, status2, _ = head2._ext.int8_greedy_argmax(x[:1], head2.packed, head2.row_sums, head2.scales, 3000,
                                                  head2._weight_c, head2._err2, head2._amax2,
                                                  _float32_up(n1[:1]), _float32_up(term[:1]), 4096, head2.g64)
    assert status2.tolist() == [2]
    assert head2.argmax(x[:1])[0].tolist() == [min(top, 2999)]


@VNNI_ONLY
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_vnni_quantization_equals_the_int8_kinds(dtype):
    """``quantize_int8_rows`` (one C++ pass per row) gives the torch int8 kind's codes, scales and
    bound constants: rows with ties at half a step (round to even), a zero row, outlier columns."""
    w = _weights(3000, 640, torch.float32, seed=12)
    w[5] = 0.0
    w[6, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])      # scale 1: codes 127, 0, 2, -2 (to even)
    w[6, 4:] = 0.0
    w = w.to(dtype)
    torch_kind = ExactGreedyHead(w, "int8", 8)
    vnni = ExactGreedyHead(w, "int8_vnni", 8)
    assert torch.equal(vnni._ext.unpack_int8_weight(vnni.packed, 3000), torch_kind.qweight)
    assert torch.equal(vnni.scales, torch_kind.scales.float())
    assert torch.equal(vnni.weight_error, torch_kind.weight_error)
    assert torch.equal(vnni.approx_max, torch_kind.approx_max)
    assert torch_kind.qweight[6, :4].tolist() == [127, 0, 2, -2] and vnni.scales[5].item() == 1.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_rows_equal_float64_argmax_over_the_allowed_tokens(kind, dtype):
    """A grammar's mask (``forbidden``): the answer is the float64 argmax over the allowed tokens,
    also when the unmasked winner is forbidden (each row's top token here) or a single token is
    allowed; a row with nothing allowed falls back."""
    w = _weights(6000, 640, dtype, seed=5)
    head = ExactGreedyHead(w, kind, 64)
    m = 12
    x = _planted(w, m, seed=3, noise=0.05 if kind == "bf16" else 0.01)
    r = _exact(x, w)
    g = torch.Generator().manual_seed(9)
    forbidden = torch.rand(m, w.shape[0], generator=g) < 0.7
    forbidden[torch.arange(m), r.argmax(dim=1)] = True           # the unmasked winner is never allowed
    forbidden[0] = True
    forbidden[0, 4321] = False                                    # one allowed token
    forbidden[1] = True                                           # none allowed
    tokens, fallback = head.argmax(x, forbidden)
    want = r.masked_fill(forbidden, -float("inf")).argmax(dim=1)
    assert bool(fallback[1]) and int(tokens[1]) == -1
    ok = ~fallback
    ok[1] = False
    assert int(tokens[0]) == 4321 and not bool(fallback[0])
    assert torch.equal(tokens[ok], want[ok])
    if kind == "bf16":
        assert int(fallback.sum()) == 1


@pytest.mark.skipif(not (VNNI_OK or BF16_OK or AVX2_OK), reason=f"the exact greedy head needs the VNNI int8 kernel "
                    f"(missing CPU flags {VNNI_MISSING}), native bf16 (avx512_bf16 / AMX) or the int8 kernel's AVX2 "
                    f"code ({AVX2_WHY})")
def test_constrained_greedy_rows_use_the_exact_head_and_keep_their_tokens(make_tiny_checkpoint):
    """JSON / regex / choice constrained greedy rows, next to plain ones, go through the exact
    greedy head (its masked argmax) and give the tokens of the full head (switch off)."""
    from pagedllm import SamplingParams
    from pagedllm.sampling_params import StructuredOutputsParams

    path = make_tiny_checkpoint("llama")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "s": {"type": "string", "maxLength": 8}}, "required": ["n", "s"]}
    prompts = [[5 + (7 * i + 3 * j) % 300 for j in range(3 + 5 * i)] for i in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(
                  regex=r"[a-f]{3,9}")),
              SamplingParams(n=2, temperature=0.0, max_tokens=6, structured_outputs=StructuredOutputsParams(
                  choice=["alpha", "beta"]))]
    on, head = _generate(path, "auto", params, prompts, max_num_seqs=8)
    off, none = _generate(path, "off", params, prompts, max_num_seqs=8)
    # Every sampled token, constrained or not, was one row of the exact head (none fell back).
    assert none is None and head.num_fallback_rows == 0
    assert head.num_rows == sum(len(c.token_ids) for o in on for c in o.outputs)
    assert [[c.token_ids for c in o.outputs] for o in on] == [[c.token_ids for c in o.outputs] for o in off]


# -- a bfloat16 model's head: the argmax of the full head's own bf16 logits, ties included --

def _bf16_tied_weights(v: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [V, K] weights with exact ties (40 long rows of the lower half copied into the upper half:
    the lowest id must win) and near ties (20 of those copies moved one bf16 ulp in column 0:
    exact scores a hair apart, bf16 logits mostly equal). Returns (weights, the copied rows)."""
    w = _weights(v, k, torch.bfloat16, seed)
    g = torch.Generator().manual_seed(seed + 1)
    src = w[: v // 2].float().norm(dim=1).topk(40).indices   # long rows: the planted scores stay on top
    dst = v // 2 + torch.randperm(v - v // 2, generator=g)[:40]
    w[dst] = w[src]
    near = dst[:20]
    w[near, 0] = (w[near, 0].view(torch.int16) + 1).view(torch.bfloat16)
    return w, src


def _rows_at(w: torch.Tensor, toks: torch.Tensor, logit: float, seed: int) -> torch.Tensor:
    """[len(toks), K] bf16 rows that score ``toks`` at about ``logit`` (bf16 logit spacing there:
    ``logit`` 2^-8), above the rest, plus noise."""
    g = torch.Generator().manual_seed(seed)
    wt = w[toks].float()
    x = wt / wt.norm(dim=1, keepdim=True) ** 2 * logit + 0.02 * torch.randn(wt.shape, generator=g)
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("m", [1, 2, 3, 7])
def test_bf16_logit_head_equals_the_full_heads_argmax(m):
    """With ``logits_kernel`` the head's token is the full head's (``Bf16Linear`` on the same GEMM):
    the argmax of its bf16 logits, lowest id on their ties, not the exact argmax; on rows aimed at
    exact and near ties, and on random rows."""
    module = _bf16_logit_head_kernel()
    v, k = 4099, 64
    w, src = _bf16_tied_weights(v, k, seed=3)
    full = Bf16Linear(w, None, module)
    head = ExactGreedyHead(w, "int8_avx2", m, max_rows=m, logits_kernel=module)
    x = torch.cat([_rows_at(w, src, 24.0, seed=5), _rows_at(w, src, 3.0, seed=6), _hidden(40, k, torch.bfloat16, 7)])
    logits = full(x).float()
    want = logits.argmax(dim=1)
    got = []
    for i in range(0, x.shape[0], m):
        tokens, fallback = head.argmax(x[i:i + m])
        assert not bool(fallback.any())
        got.append(tokens)
    assert torch.equal(torch.cat(got), want)
    ties = (logits == logits.amax(dim=1, keepdim=True)).sum(dim=1) > 1
    assert int(ties.sum()) >= 20                         # the rows aimed at the copies do tie in bf16 ...
    assert not torch.equal(_exact(x, w).argmax(dim=1), want)   # ... and the exact argmax parts from them


def test_bf16_logit_head_masked_rows_and_errors():
    """Masked rows (a grammar's) take the full head's argmax over the allowed tokens; a row with
    no allowed token falls back; the mode needs a bfloat16 weight and a fixed-point kind."""
    module = _bf16_logit_head_kernel()
    v, k = 4099, 64
    w, src = _bf16_tied_weights(v, k, seed=11)
    full = Bf16Linear(w, None, module)
    head = ExactGreedyHead(w, "int8_avx2", 8, logits_kernel=module)
    x = torch.cat([_rows_at(w, src[:6], 20.0, seed=12), _hidden(2, k, torch.bfloat16, 13)])
    forbidden = torch.rand(x.shape[0], v, generator=torch.Generator().manual_seed(14)) < 0.3
    forbidden[0, src[0]] = True           # the top token of row 0 is not allowed
    forbidden[7] = True                   # nothing allowed: fallback
    tokens, fallback = head.argmax(x, forbidden)
    want = full(x).float().masked_fill(forbidden, float("-inf")).argmax(dim=1)
    assert fallback.tolist() == [False] * 7 + [True]
    assert torch.equal(tokens[:7], want[:7]) and int(tokens[7]) == -1
    with pytest.raises(ValueError, match="logits_kernel"):
        ExactGreedyHead(w.float(), "int8_avx2", 8, logits_kernel=module)


def test_choose_greedy_head_for_bf16_models():
    """A bfloat16 model takes the int8 AVX2 pass only with its head on the AVX2 bf16 GEMM and no
    edit of the logits after it, for ``INT8_AVX2_BF16_MAX_ROWS`` rows."""
    cpu = torch.device("cpu")
    kind, why = choose_greedy_head("auto", torch.bfloat16, cpu, 1, None, hidden_size=640, linear_kind=AVX2_KERNEL)
    assert kind == ("int8_avx2" if AVX2_OK else None), why
    if AVX2_OK:
        assert "bf16 logits" in why and greedy_head_max_rows(kind, torch.bfloat16) == INT8_AVX2_BF16_MAX_ROWS >= 1
        assert greedy_head_max_rows(kind, torch.float32) == GREEDY_HEAD_MAX_ROWS["int8_avx2"]
    assert greedy_head_max_rows(None, torch.bfloat16) == 0
    for linear in ("onednn", "avx512_bf16", "amx_bf16", None):
        off, why_off = choose_greedy_head("auto", torch.bfloat16, cpu, 1, None, hidden_size=640, linear_kind=linear)
        assert off is None and str(linear) in why_off
    off, why_off = choose_greedy_head("auto", torch.bfloat16, cpu, 1, None, hidden_size=640, linear_kind=AVX2_KERNEL,
                                      logits_edit="final logit soft cap 30.0")
    assert off is None and "soft cap" in why_off
    off, why_off = choose_greedy_head("auto", torch.bfloat16, cpu, 1, None, hidden_size=2048, linear_kind=AVX2_KERNEL)
    assert off is None and "2048" in why_off
    assert choose_greedy_head("off", torch.bfloat16, cpu, 1, None, hidden_size=640, linear_kind=AVX2_KERNEL)[0] is None


def test_tiny_bf16_model_tokens_same_on_and_off(make_tiny_checkpoint):
    """A bfloat16 tiny Gemma 3 through the engine: every greedy token of a step with one row goes
    through the bf16-logit head and equals the full head's (switch off)."""
    from pagedllm import SamplingParams
    from pagedllm.layers.bf16_gemm import bf16_kernel_for

    _bf16_logit_head_kernel()
    kernel, why = bf16_kernel_for()
    if kernel != AVX2_KERNEL:
        pytest.skip(f"the bf16 head runs {kernel} here ({why}); the bf16-logit head re-scores on the AVX2 GEMM only")
    path = make_tiny_checkpoint("gemma3")
    prompts = [[5 + (7 * i + 3 * j) % 300 for j in range(3 + 5 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    on, head = _generate(path, "auto", params, prompts, dtype="bfloat16", max_num_seqs=INT8_AVX2_BF16_MAX_ROWS)
    off, none = _generate(path, "off", params, prompts, dtype="bfloat16", max_num_seqs=INT8_AVX2_BF16_MAX_ROWS)
    assert none is None and head is not None and head.logits_kernel is not None
    assert head.num_rows == sum(len(o.outputs[0].token_ids) for o in on) and head.num_fallback_rows == 0
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]


def test_bf16_logit_candidates_are_the_float64_window():
    """The C++ candidate search (a float32 first test over every token, then float64) returns the
    window of ``_argmax_bf16_logits`` computed here in float64: every candidate of the window shrunk
    by 1e-9 relative, none outside it grown by 1e-9; rows with a NaN or nothing finite get none."""
    module = _bf16_logit_head_kernel()
    v, k = 4099, 64
    w, src = _bf16_tied_weights(v, k, seed=21)
    head = ExactGreedyHead(w, "int8_avx2", 8, logits_kernel=module)
    x = torch.cat([_rows_at(w, src[:8], 20.0, seed=22), _hidden(8, k, torch.bfloat16, 23)])
    c, _, norms = head.cheap_pass(x)
    c[0, 5] = float("nan")
    c[1] = float("-inf")
    n1, term = norms["n1"], head._vnni_row_term(norms["n1"], norms["xinf"])
    u_o, tiny = 2.0 ** -8, (k + 1) * 2.0 ** -126
    rows, toks, cmax = head._ext.bf16_logit_candidates(
        c, n1, term, head.weight_error, head.approx_max, head._err_up, head._amax_up, head.weight_error_max,
        head.approx_max_max, head.g32, u_o, tiny)
    got = set(zip(rows.tolist(), toks.tolist()))
    assert torch.isnan(cmax[0]) and cmax[1] == float("-inf") and not {r for r, _ in got} & {0, 1}
    assert torch.equal(cmax[2:], c[2:].double().amax(dim=1))
    e, a = head.weight_error, head.approx_max
    for scale, inside in ((1 - 1e-9, True), (1 + 1e-9, False)):
        window = set()
        for m in range(2, x.shape[0]):
            cd = c[m].double()
            p = 2.0 * ((1.0 + u_o) * (n1[m] * e + a * term[m] + head.g32 * n1[m] * (a + e)) + tiny)
            t = (p + 2.0 * u_o * cd.abs()) * scale
            top = int(c[m].argmax())
            near = cd + t >= cd[top] - t[top]
            sel = near & (cd + t >= (cd - t)[near].max())
            window |= {(m, j) for j in sel.nonzero().flatten().tolist()}
        assert window <= got if inside else got <= window
    assert len(got) > x.shape[0]   # near ties: rows with several candidates
