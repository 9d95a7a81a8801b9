"""Watermarked sampling: the per-token distribution is kept, rows are chosen by vLLM's rules.

Distribution: over many keys the keyed uniforms at one fixed context are independent U(0, 1), so the
Gumbel-max token is a draw from the processed distribution (the trick's guarantee). A chi-square
goodness-of-fit test over ``NUM_KEYS`` keys checks it; false-alarm rate: the test fails when the
p-value is below ``ALPHA`` = 1e-3, so a correct sampler fails one key set in a thousand; the keys
are fixed (0 .. NUM_KEYS-1), so the result is the same on every run. Power: the same counts are
tested against the distribution at another temperature and must be rejected.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import WatermarkConfig
from pagedllm.sample import Sampler, SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.watermarking import GumbelWatermarker
from pagedllm.watermarking.sampling import WatermarkSampler, is_repeated_context, top_k_top_p_mask

ALPHA = 1e-3
NUM_KEYS = 4000
LOGITS = torch.tensor([1.2, 0.4, -0.3, 0.9, -1.5, 0.0, 0.6, -0.8])
CONTEXT = torch.tensor([[17, 3, 250, 9]])


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of ``counts`` against ``probs`` (cells with expected count < 5
    pooled), p = Q(df / 2, stat / 2)."""
    expected = probs.double() * counts.sum()
    big = expected >= 5
    stat = (((counts[big] - expected[big]) ** 2) / expected[big]).sum()
    df = int(big.sum()) - 1
    if (~big).any():
        e, o = expected[~big].sum(), counts[~big].sum()
        stat = stat + (o - e) ** 2 / e
        df += 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _counts(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double()


def test_gumbel_max_keeps_the_distribution_over_keys():
    tokens = [int(GumbelWatermarker(k).sample(LOGITS.unsqueeze(0), CONTEXT)) for k in range(NUM_KEYS)]
    counts = _counts(tokens, len(LOGITS))
    assert chi_square_p_value(counts, torch.softmax(LOGITS, -1)) > ALPHA
    assert chi_square_p_value(counts, torch.softmax(LOGITS / 0.7, -1)) < ALPHA   # power


def test_sampler_watermark_keeps_temperature_top_k_distribution():
    """Through ``Sampler``: temperature 0.7 and top_k 5; expected = the renormalized top 5."""
    params = [SamplingParams(temperature=0.7, top_k=5, watermarking=True)]
    logits = LOGITS.unsqueeze(0)
    sampler = Sampler()
    tokens = []
    for key in range(NUM_KEYS // 2):
        md = SamplingMetadata.build(params, [[17, 3, 250, 9]], [[1, 2]], None, len(LOGITS), "cpu",
                                    watermark=WatermarkSampler(WatermarkConfig(key=key)))
        tokens.append(int(sampler(logits, md).sampled_token_ids[0]))
    probs = torch.softmax(LOGITS / 0.7, -1)
    keep = probs >= probs.topk(5).values[-1]
    probs = torch.where(keep, probs, 0.0) / probs[keep].sum()
    counts = _counts(tokens, len(LOGITS))
    assert counts[~keep].sum() == 0
    assert chi_square_p_value(counts[keep], probs[keep]) > ALPHA
    assert chi_square_p_value(counts[keep], torch.softmax(LOGITS[keep], -1)) < ALPHA   # temperature 1: rejected


def test_watermarked_rows_vectorized_equal_alone_and_opt_outs_untouched():
    torch.manual_seed(0)
    v = 300
    logits = torch.randn(4, v) * 3
    outputs = [[5, 6, 7, 8, 9], [1], [], [4, 4]]
    params = [SamplingParams(temperature=0.8, watermarking=True), SamplingParams(watermarking=True, top_p=0.9),
              SamplingParams(seed=3, watermarking=False), SamplingParams(watermarking=True, min_p=0.05)]
    wm = WatermarkSampler(WatermarkConfig(key=77))
    md = SamplingMetadata.build(params, outputs, [[1]] * 4, None, v, "cpu", watermark=wm)
    assert md.random.watermark.rows.tolist() == [0, 1, 3]
    assert md.random.watermark.contexts.tolist() == [[6, 7, 8, 9], [-1, -1, -1, 1], [-1, -1, 4, 4]]
    batch = Sampler()(logits, md).sampled_token_ids
    for i in (0, 1, 3):
        alone = SamplingMetadata.build([params[i]], [outputs[i]], [[1]], None, v, "cpu", watermark=wm)
        assert int(Sampler()(logits[i:i + 1], alone).sampled_token_ids[0]) == int(batch[i])
    # the opted-out seeded row draws what it draws without any watermark
    from pagedllm.sample import make_generator
    plain = SamplingMetadata.build([params[2]], [outputs[2]], [[1]], [make_generator(3, "cpu")], v, "cpu")
    seeded = SamplingMetadata.build(params, outputs, [[1]] * 4, [None, None, make_generator(3, "cpu"), None], v,
                                    "cpu", watermark=wm)
    assert int(Sampler()(logits, seeded).sampled_token_ids[2]) == int(Sampler()(logits[2:3], plain).sampled_token_ids[0])


def test_unresolved_and_greedy_rows_are_not_watermarked():
    wm = WatermarkSampler(WatermarkConfig(key=1))
    params = [SamplingParams(), SamplingParams(watermarking=False), SamplingParams(temperature=0.0)]
    md = SamplingMetadata.build(params, [[1], [2], [3]], [[0]] * 3, None, 50, "cpu", watermark=wm)
    assert md.random.watermark is None   # None (not resolved by the engine) counts as off here
    cfg = WatermarkConfig(key=1)
    assert cfg.watermarks(SamplingParams()) and cfg.watermarks(SamplingParams(watermarking=True))
    assert not cfg.watermarks(SamplingParams(watermarking=False))
    assert not cfg.watermarks(SamplingParams(temperature=0.0))


def test_repeated_context_rules():
    # history positions' contexts (w=2): (-1,-1) (-1,5) (5,6) (6,7) (7,5)
    h = [5, 6, 7, 5, 6]
    assert is_repeated_context(h, [5, 6], None)            # the context of position 2
    assert not is_repeated_context(h, [6, 5], None)
    assert is_repeated_context(h, [5, 6], 3)               # positions 2..4 searched
    assert not is_repeated_context(h, [5, 6], 2)           # positions 3..4 only
    assert is_repeated_context([9], [-1, -1], None) and not is_repeated_context([], [-1, -1], None)


def test_deduplication_scopes():
    p = SamplingParams(watermarking=True)
    single = WatermarkSampler(WatermarkConfig(key=1, context_width=2))
    everything = WatermarkSampler(WatermarkConfig(key=1, context_width=2, deduplicate_contexts="all"))
    none = WatermarkSampler(WatermarkConfig(key=1, context_width=2, deduplicate_contexts="none"))
    out = [5, 6, 7, 5, 6]   # current context (5, 6) came before
    assert single.rows([p], [out], [[1]], [0], 50, "cpu") is None
    assert none.rows([p], [out], [[1]], [0], 50, "cpu").contexts.tolist() == [[5, 6]]
    # "all": a context from the prompt counts, and the first w generated tokens are not watermarked
    assert single.rows([p], [[8, 9]], [[8, 9, 3]], [0], 50, "cpu") is not None
    assert everything.rows([p], [[8, 9]], [[8, 9, 3]], [0], 50, "cpu") is None
    assert everything.rows([p], [[8]], [[1]], [0], 50, "cpu") is None
    assert everything.rows([p], [[8, 2]], [[1]], [0], 50, "cpu") is not None


def test_top_k_top_p_mask():
    x = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    m = top_k_top_p_mask(x, torch.tensor([3]), torch.tensor([float("inf")], dtype=torch.float64))
    assert torch.isinf(m).tolist() == [[True, False, False, False, True]]
    assert m[0, 1:4].tolist() == [3.0, 1.0, 2.0]
    # top_p: softmax([3, 2, 1, 0, -1]) = .64 .24 .09 .03 .01: 0.8 keeps the first two
    m = top_k_top_p_mask(x, torch.tensor([5]), torch.tensor([0.8], dtype=torch.float64))
    assert (~torch.isinf(m[0])).nonzero().flatten().tolist() == [1, 3]


@pytest.mark.parametrize("bad,field", [
    ({"key": -1}, "key"), ({"key": 2**64}, "key"), ({"key": 1.5}, "key"),
    ({"key": 1, "context_width": 0}, "context_width"), ({"key": 1, "prf": "aes"}, "prf"),
    ({"key": 1, "deduplicate_contexts": "some"}, "deduplicate_contexts"),
    ({"key": 1, "deduplicate_contexts_max_history": 0}, "deduplicate_contexts_max_history"),
    ({"key": 1, "algorithm": "kgw"}, "algorithm"), ({"key": 1, "algorithm": "dual_key_gumbel"}, "dual_key_gumbel"),
    ({"key": 1, "alpha": 2}, "alpha"), ({"key": 1, "contxt_width": 4}, "contxt_width"),
])
def test_bad_config_value_error_names_the_field(bad, field):
    from pagedllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=field):
        EngineArgs(watermark_config=bad).create_watermark_config()


def test_key_stays_out_of_repr_and_errors():
    cfg = WatermarkConfig(key=123456789)
    assert "123456789" not in repr(cfg) and "123456789" not in repr(WatermarkSampler(cfg))
    with pytest.raises(ValueError) as e:
        WatermarkConfig(key=-987654321)
    assert "987654321" not in str(e.value)


def test_speculative_decoding_is_refused():
    from pagedllm.engine.arg_utils import EngineArgs

    args = EngineArgs(watermark_config={"key": 1},
                      speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="watermark_config with speculative_config"):
        args.create_watermark_config()


def test_sampling_params_watermarking_field():
    assert SamplingParams().watermarking is None
    with pytest.raises(ValueError, match="watermarking"):
        SamplingParams(watermarking=1)


def test_top_k_candidates_path_equals_full_vocabulary_argmax():
    from pagedllm.watermarking.sampling import WatermarkRows

    torch.manual_seed(1)
    v = 3000
    x = torch.randn(3, v) * 4
    marker = GumbelWatermarker(5)
    ctx = torch.tensor([[1, 2, 3, 4], [-1, -1, 7, 8], [9, 9, 9, 9]])
    top_k = torch.tensor([50, 7, 200])
    top_p = torch.tensor([float("inf"), 0.9, 0.5], dtype=torch.float64)
    rows = WatermarkRows(torch.arange(3), ctx, top_k, top_p, marker)
    full = marker.sample(top_k_top_p_mask(x, top_k, top_p), ctx)
    assert torch.equal(rows.sample(x), full)
    for key in range(200):   # many draws: the two paths never differ
        m = GumbelWatermarker(key)
        r = WatermarkRows(torch.arange(3), ctx, top_k, top_p, m)
        assert torch.equal(r.sample(x), m.sample(top_k_top_p_mask(x, top_k, top_p), ctx))


def test_fused_kernel_draw_equals_torch_noise_argmax():
    """The C++ one-pass draw (with its logit bound skipping hopeless tokens) picks the token the
    torch noise + argmax picks, over logit scales from flat to peaked and masked rows."""
    from pagedllm.watermarking.philox import load_philox_kernel

    if load_philox_kernel() is None:
        pytest.skip("the C++ Philox kernel did not build here (torch runs instead)")
    gen = torch.Generator().manual_seed(0)
    for key in range(60):
        marker = GumbelWatermarker(key)
        x = torch.randn(3, 5003, generator=gen) * (1 + key % 20)
        x[1, :2500] = float("-inf")
        ctx = torch.randint(-1, 5000, (3, 4), generator=gen)
        assert torch.equal(marker.sample(x, ctx), (marker.gumbel_noise(ctx, 5003).add_(x)).argmax(dim=-1))
    all_masked = torch.full((2, 10), float("-inf"))
    assert GumbelWatermarker(1).sample(all_masked, torch.zeros(2, 4, dtype=torch.int64)).tolist() == [0, 0]
