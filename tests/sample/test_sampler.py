"""Sampler: greedy parity, seeded determinism, filters, penalties, masks, logprobs, statistics."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.sample import (TOP_P_CANDIDATE_CAP, Sampler, SamplingMetadata,
                             compute_prompt_logprobs, make_generator)
from pagedllm.sample.sampler import _apply_adjustments
from pagedllm.sampling_params import SamplingParams
from cpp_build import require_built_extension

V = 64


def _build(params, logits=None, outputs=None, prompts=None, generators=None, vocab_size=None):
    n = len(params)
    vocab_size = vocab_size or (logits.shape[1] if logits is not None else V)
    return SamplingMetadata.build(
        params, outputs or [[] for _ in range(n)], prompts or [[] for _ in range(n)],
        generators or [None] * n, vocab_size, "cpu")


def _sample(logits, params, **kw):
    return Sampler()(logits, _build(params, logits, **kw))


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


# Chi-square critical values at p = 0.001 by degrees of freedom (so a fixed-seed run fails only
# on a real mismatch).
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


# ---------------------------------------------------------------- greedy


def test_greedy_equals_argmax_of_raw_logits():
    torch.manual_seed(0)
    logits = torch.randn(5, V)
    out = _sample(logits, [SamplingParams(temperature=0.0) for _ in range(5)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.topk_token_ids is None and out.topk_logprobs is None and out.sampled_ranks is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_greedy_rows_in_the_model_dtype_equal_the_float32_path(dtype):
    """Plain greedy rows take the first maximum of the logits as given (no float32 copy); ties,
    and bfloat16's coarse values (many equal logits), pick the lowest index as float32 argmax."""
    torch.manual_seed(0)
    logits = (torch.randn(6, 4096) * 4).to(dtype)
    logits[1, [7, 300, 4000]] = 100.0                 # a three-way tie: the lowest index wins
    logits[2, :] = 0.0                                # all equal: token 0
    logits[3, [4095]] = float("inf")
    out = _sample(logits, [SamplingParams(temperature=0.0) for _ in range(6)])
    assert out.sampled_token_ids.tolist() == logits.float().argmax(-1).tolist()
    assert out.sampled_token_ids.tolist()[1:4] == [7, 0, 4095]
    assert out.sampled_logprobs.isnan().all()         # nobody asked for them
    # A row asking for logprobs takes the float32 path for the whole batch: same tokens.
    params = [SamplingParams(temperature=0.0, logprobs=2 if i == 0 else None) for i in range(6)]
    assert _sample(logits, params).sampled_token_ids.tolist() == out.sampled_token_ids.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_greedy_rows_through_the_fused_argmax(dtype):
    """The model runner hands the sampler the fused C++ argmax (``layers.fused_ops.greedy_argmax``)
    when the model runs the fused ops: same tokens as torch's path; a non-contiguous batch (the op
    answers None) falls back to torch."""
    from pagedllm.layers.fused_ops import greedy_argmax, load_fused_ops

    require_built_extension(load_fused_ops, "the fused ops (nothing to compare)")
    torch.manual_seed(1)
    logits = (torch.randn(6, 262144) * 4).to(dtype)
    logits[1, [7, 300, 200000]] = 100.0
    logits[2, :] = 0.0
    logits[4, 123456] = float("nan")
    params = [SamplingParams(temperature=0.0) for _ in range(6)]
    calls = []

    def counted(x):
        calls.append(x.shape)
        return greedy_argmax(x)
    fused = Sampler(greedy_argmax=counted)(logits, _build(params, logits))
    assert calls == [logits.shape]
    assert torch.equal(fused.sampled_token_ids, Sampler()(logits, _build(params, logits)).sampled_token_ids)
    assert fused.sampled_token_ids.tolist()[1:3] == [7, 0] and fused.sampled_token_ids[4] == 123456
    wide = torch.cat([logits, logits], dim=1)[:, ::2]   # not contiguous: the op declines, torch runs
    assert greedy_argmax(wide) is None
    assert torch.equal(Sampler(greedy_argmax=greedy_argmax)(wide, _build(params, wide)).sampled_token_ids,
                       wide.max(dim=-1).indices)


def test_all_greedy_builds_no_tensors():
    md = _build([SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, seed=3)])
    assert md.all_greedy and not md.all_random
    assert md.random is None and md.adjustments is None and md.max_num_logprobs is None


def test_sampler_does_not_modify_logits():
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=5, min_p=0.1, repetition_penalty=1.3,
                             logit_bias={1: 3.0}),
              SamplingParams(temperature=0.0, bad_words_token_ids=[2]),
              SamplingParams(temperature=0.5)]
    _sample(logits, params, outputs=[[1, 2], [3], []], prompts=[[4], [5], [6]])
    assert torch.equal(logits, before)


def test_mixed_batch_greedy_rows_are_argmax():
    torch.manual_seed(2)
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    md = _build(params, logits)
    assert not md.all_greedy and not md.all_random
    out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids[0::2], logits[0::2].argmax(-1))
    assert ((out.sampled_token_ids >= 0) & (out.sampled_token_ids < V)).all()


def test_top_k_1_equals_greedy():
    torch.manual_seed(3)
    logits = torch.randn(8, V)
    out = _sample(logits, [SamplingParams(temperature=1.5, top_k=1) for _ in range(8)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_tiny_top_p_is_argmax():
    torch.manual_seed(4)
    logits = torch.randn(8, V)
    out = _sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6) for _ in range(8)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_min_p_one_is_argmax_and_min_p_drops_unlikely_tokens():
    torch.manual_seed(5)
    logits = torch.randn(4, V)
    out = _sample(logits, [SamplingParams(min_p=1.0) for _ in range(4)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))

    # probs ~ [0.5, 0.3, 0.15, 0.05]: min_p = 0.2 keeps p >= 0.1, i.e. tokens 0, 1, 2.
    row = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    logits = row.expand(4000, 4).contiguous()
    out = _sample(logits, [SamplingParams(min_p=0.2) for _ in range(4000)], vocab_size=4)
    counts = torch.bincount(out.sampled_token_ids, minlength=4)
    assert counts[3] == 0 and (counts[:3] > 0).all()


# ---------------------------------------------------------------- seeds


def _run_steps(seed_params, others, steps, seed, position, vocab=V):
    """Sample ``steps`` steps of one seeded row placed at ``position`` among ``others``."""
    gen = make_generator(seed, "cpu")
    other_gens = [make_generator(100 + i, "cpu") if p.seed is not None else None
                  for i, p in enumerate(others)]
    tokens = []
    for step in range(steps):
        torch.manual_seed(1000 + step)  # the logits are the same in every configuration
        logits_seeded = torch.randn(1, vocab) * 2
        logits_others = torch.randn(len(others), vocab) * 2
        torch.manual_seed(7 * step + position + len(others))  # global RNG differs per config
        params = list(others)
        gens = list(other_gens)
        params.insert(position, seed_params)
        gens.insert(position, gen)
        rows = list(logits_others)
        rows.insert(position, logits_seeded[0])
        logits = torch.stack(rows)
        out = _sample(logits, params, generators=gens)
        tokens.append(int(out.sampled_token_ids[position]))
    return tokens


@pytest.mark.parametrize("seeded", [
    SamplingParams(temperature=1.0, seed=42),
    SamplingParams(temperature=0.8, top_k=10, seed=42),
    SamplingParams(temperature=1.2, top_p=0.9, seed=42),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.8, min_p=0.05, seed=42),
])
def test_seeded_row_is_independent_of_batch(seeded):
    alone = _run_steps(seeded, [], 12, 42, 0)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, top_k=50, seed=7),
              SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0, top_k=3, repetition_penalty=1.2)]
    crowded = _run_steps(seeded, others, 12, 42, 2)
    crowded_first = _run_steps(seeded, others[:2], 12, 42, 0)
    assert alone == crowded == crowded_first
    assert len(set(alone)) > 1  # actually random


def test_seeded_top_p_fallback_is_independent_of_batch():
    # 5000 tokens: the top 1024 hold less than 0.95, so this row takes the wider-candidate path.
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=5)
    others = [SamplingParams(top_k=3000, top_p=0.99), SamplingParams(top_p=0.1),
              SamplingParams(temperature=0.0)]
    alone = _run_steps(seeded, [], 6, 5, 0, vocab=5000)
    assert alone == _run_steps(seeded, others, 6, 5, 1, vocab=5000)
    assert len(set(alone)) > 1


def test_same_seed_same_tokens_different_seed_different_tokens():
    torch.manual_seed(6)
    logits = torch.randn(1, 1000)
    def draw(seed):
        gen = make_generator(seed, "cpu")
        return [int(_sample(logits, [SamplingParams(seed=seed)], generators=[gen])
                    .sampled_token_ids[0]) for _ in range(20)]
    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_make_generator_accepts_negative_and_huge_seeds():
    for seed in (-1, 2**70 + 5, 0):
        a = torch.rand(3, generator=make_generator(seed, "cpu"))
        b = torch.rand(3, generator=make_generator(seed, "cpu"))
        assert torch.equal(a, b)


# ---------------------------------------------------------------- statistics


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_frequencies_match_softmax(temperature):
    torch.manual_seed(1234)
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.5])
    n = 40000
    logits = row.expand(n, 8).contiguous()
    out = _sample(logits, [SamplingParams(temperature=temperature) for _ in range(n)],
                  vocab_size=8)
    counts = torch.bincount(out.sampled_token_ids, minlength=8).double()
    probs = torch.softmax(row.double() / temperature, -1)
    assert _chi_square(counts, probs) < _CHI2_999[7]


def test_seeded_rows_sample_the_softmax_too():
    row = torch.tensor([1.0, 0.0, -1.0, 0.5])
    params = SamplingParams(temperature=1.0, seed=9)
    gen = make_generator(9, "cpu")
    counts = torch.zeros(4, dtype=torch.float64)
    md = _build([params], vocab_size=4, generators=[gen])
    for _ in range(4000):
        counts[int(Sampler()(row.unsqueeze(0), md).sampled_token_ids[0])] += 1
    assert _chi_square(counts, torch.softmax(row.double(), -1)) < _CHI2_999[3]


def test_top_k_frequencies_are_renormalized_top_k():
    torch.manual_seed(77)
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.5])
    n = 30000
    logits = row.expand(n, 8).contiguous()
    out = _sample(logits, [SamplingParams(top_k=3) for _ in range(n)], vocab_size=8)
    counts = torch.bincount(out.sampled_token_ids, minlength=8).double()
    keep = torch.tensor([0, 7, 1])
    assert counts.sum() == counts[keep].sum()
    probs = torch.softmax(row[keep].double(), -1)
    assert _chi_square(counts[keep], probs) < _CHI2_999[2]


def test_top_p_applies_to_renormalized_top_k():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().expand(3000, 4).contiguous()
    # top_p alone: keep tokens whose preceding mass < 0.5 -> {0, 1} at 4:3.
    out = _sample(logits, [SamplingParams(top_p=0.5) for _ in range(3000)], vocab_size=4)
    counts = torch.bincount(out.sampled_token_ids, minlength=4).double()
    assert counts[2] == counts[3] == 0
    assert _chi_square(counts[:2], torch.tensor([4 / 7, 3 / 7], dtype=torch.float64)) < _CHI2_999[1]
    # top_k=2 renormalizes to [4/7, 3/7]; top_p=0.5 then keeps only token 0.
    out = _sample(logits, [SamplingParams(top_k=2, top_p=0.5) for _ in range(3000)], vocab_size=4)
    assert (out.sampled_token_ids == 0).all()


# ---------------------------------------------------------------- wide rows


class _TopkSpy:
    """Records the k of every torch.Tensor.topk call and fails on any sort."""

    def __init__(self, monkeypatch):
        self.ks: list[int] = []
        real_topk = torch.Tensor.topk

        def topk(t, k, *args, **kwargs):
            self.ks.append(int(k))
            return real_topk(t, k, *args, **kwargs)

        def no_sort(*args, **kwargs):
            raise AssertionError("full sort")

        monkeypatch.setattr(torch.Tensor, "topk", topk)
        monkeypatch.setattr(torch.Tensor, "sort", no_sort)
        monkeypatch.setattr(torch, "sort", no_sort)


def test_top_p_on_a_262144_wide_row_uses_candidates(monkeypatch):
    vocab = 262144
    torch.manual_seed(11)
    logits = torch.randn(1, vocab).expand(2, vocab).contiguous()
    logits[:, 100] += 16.0  # peaked: the nucleus is a handful of tokens
    logits[:, 200] += 15.0
    exact = torch.softmax(logits[0].double(), -1).sort(descending=True)
    nucleus_size = int(((exact.values.cumsum(0) - exact.values) < 0.9).sum())
    nucleus = set(exact.indices[:nucleus_size].tolist())
    spy = _TopkSpy(monkeypatch)
    for _ in range(5):
        out = _sample(logits, [SamplingParams(top_p=0.9), SamplingParams(top_p=0.9)])
        assert set(out.sampled_token_ids.tolist()) <= nucleus
    assert 2 <= len(nucleus) < 100
    assert max(spy.ks) <= TOP_P_CANDIDATE_CAP


def test_top_p_widens_candidates_before_sorting(monkeypatch):
    vocab = 262144
    # 5000 likely tokens, strictly decreasing: the nucleus (~2500) exceeds the first 1024
    # candidates but fits in the next, wider topk.
    logits = torch.full((1, vocab), -30.0)
    logits[0, :5000] = -torch.arange(5000, dtype=torch.float32) * 1e-4
    probs = torch.softmax(logits[0].double(), -1)
    nucleus_size = int(((probs.cumsum(0) - probs) < 0.5).sum())
    assert TOP_P_CANDIDATE_CAP < nucleus_size < 5000
    spy = _TopkSpy(monkeypatch)
    torch.manual_seed(18)
    draws = _sample(logits.expand(64, vocab).contiguous(),
                    [SamplingParams(top_p=0.5) for _ in range(64)]).sampled_token_ids
    assert (draws < nucleus_size).all() and (draws >= TOP_P_CANDIDATE_CAP).any()
    assert max(spy.ks) < vocab


def test_top_p_falls_back_to_exact_nucleus_on_a_flat_row():
    vocab = 262144
    # Nearly flat and strictly decreasing: the top 1024 tokens hold ~0.4% of the mass.
    logits = (-torch.arange(vocab, dtype=torch.float32) * 1e-5).unsqueeze(0)
    probs = torch.softmax(logits[0].double(), -1)
    nucleus_size = int(((probs.cumsum(0) - probs) < 0.5).sum())
    assert nucleus_size > TOP_P_CANDIDATE_CAP
    torch.manual_seed(12)
    draws = torch.cat([_sample(logits.expand(8, vocab).contiguous(),
                               [SamplingParams(top_p=0.5) for _ in range(8)]).sampled_token_ids
                       for _ in range(4)])
    assert (draws < nucleus_size).all()
    assert (draws >= TOP_P_CANDIDATE_CAP).any()  # not truncated to the candidates


# ---------------------------------------------------------------- penalties and masks


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25)
    md = _build([params], logits, outputs=[[2, 2, 3]], prompts=[[0, 1]])
    got = _apply_adjustments(logits, md.adjustments)
    # repetition on {0, 1, 2, 3}: positive / 2, negative * 2; then on outputs
    # {2: count 2, 3: count 1}: - (0.5 * count + 0.25).
    expected = torch.tensor([[1.0, -2.0, 0.25 - 1.25, -1.0 - 0.75, 1.0, 0.0]])
    assert torch.allclose(got, expected)


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    out = _sample(logits, [SamplingParams(temperature=0.0, frequency_penalty=1.0)],
                  outputs=[[0]], vocab_size=4)
    assert out.sampled_token_ids.tolist() == [1]
    out = _sample(logits, [SamplingParams(temperature=0.0, repetition_penalty=1.1)],
                  prompts=[[0]], vocab_size=4)
    assert out.sampled_token_ids.tolist() == [1]


def test_penalties_only_built_when_used():
    md = _build([SamplingParams(), SamplingParams(temperature=0.0)], outputs=[[1, 2], [3]],
                prompts=[[4], [5]])
    assert md.adjustments is None
    md = _build([SamplingParams(presence_penalty=0.5), SamplingParams()], outputs=[[1, 1], [3]],
                prompts=[[4], [5]])
    assert md.adjustments.repetition_keys is None
    assert md.adjustments.penalty_keys.tolist() == [1]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(2, V)
    logits[:, 1] = 10.0  # EOS
    logits[:, 5] = 9.0  # stop token id
    logits[:, 7] = 8.0
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], logprobs=0) for _ in range(2)]
    for p in params:
        p.update_from_model([1])
    out = _sample(logits, params, outputs=[[9, 9], [9, 9, 9]])
    assert out.sampled_token_ids.tolist() == [7, 1]  # row 0 has 2 < 3 outputs: masked
    # The logprob is the raw one, even for a masked-then-not-chosen distribution.
    assert torch.allclose(out.sampled_logprobs, torch.log_softmax(logits, -1)[[0, 1], [7, 1]])


def test_logit_bias_and_bad_words():
    logits = torch.zeros(1, V)
    logits[0, 3] = 5.0
    out = _sample(logits, [SamplingParams(temperature=0.0, logit_bias={9: 6.0})])
    assert out.sampled_token_ids.tolist() == [9]
    out = _sample(logits, [SamplingParams(temperature=0.0, bad_words_token_ids=[3])])
    assert out.sampled_token_ids.tolist() != [3]
    torch.manual_seed(13)
    out = _sample(logits.expand(500, V).contiguous(),
                  [SamplingParams(bad_words_token_ids=[3, 4]) for _ in range(500)])
    assert not ((out.sampled_token_ids == 3) | (out.sampled_token_ids == 4)).any()


def test_allowed_token_ids():
    torch.manual_seed(14)
    logits = torch.randn(1000, V)
    allowed = [5, 17, 40]
    params = [SamplingParams(allowed_token_ids=allowed) if i % 2 else SamplingParams()
              for i in range(1000)]
    out = _sample(logits, params)
    assert set(out.sampled_token_ids[1::2].tolist()) == set(allowed)
    assert len(set(out.sampled_token_ids[0::2].tolist())) > 3
    out = _sample(logits[:2], [SamplingParams(temperature=0.0, allowed_token_ids=allowed)] * 2)
    assert out.sampled_token_ids.tolist() == [allowed[int(logits[i, allowed].argmax())]
                                              for i in range(2)]


def test_logits_processors_see_output_ids_and_edit_the_row():
    seen = []

    def force_last(output_ids, row):
        seen.append((list(output_ids), row.shape))
        row = torch.full_like(row, float("-inf"))
        row[-1] = 0.0
        return row

    logits = torch.randn(2, V)
    out = _sample(logits, [SamplingParams(logits_processors=[force_last]),
                           SamplingParams(temperature=0.0)], outputs=[[4, 5], []])
    assert out.sampled_token_ids[0] == V - 1
    assert out.sampled_token_ids[1] == logits[1].argmax()
    assert seen == [([4, 5], torch.Size([V]))]


def test_out_of_vocab_ids_rejected(tiny_tokenizer_dir):
    # Checked once at the edge (InputProcessor), not by the sampler every step.
    from pagedllm.engine.input_processor import InputProcessor
    from pagedllm.tokenizer import Tokenizer

    processor = InputProcessor(Tokenizer.from_pretrained(tiny_tokenizer_dir), max_model_len=64, vocab_size=V)
    for kw in (dict(logit_bias={V: 1.0}), dict(allowed_token_ids=[V + 3]),
               dict(bad_words_token_ids=[V])):
        field = next(iter(kw))
        with pytest.raises(ValueError, match=field):
            processor.process([1, 2], SamplingParams(**kw))
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingMetadata.build([SamplingParams()], [], [[]], [None], V, "cpu")


def test_logits_shape_checked():
    md = _build([SamplingParams()])
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, V), md)


# ---------------------------------------------------------------- logprobs


def test_raw_logprobs_equal_log_softmax_even_when_processed():
    torch.manual_seed(15)
    logits = torch.randn(4, V) * 3
    params = [SamplingParams(temperature=0.3, top_k=4, repetition_penalty=1.5, logprobs=0),
              SamplingParams(temperature=0.0, logit_bias={0: 50.0}, logprobs=0),
              SamplingParams(temperature=2.0, top_p=0.7, min_p=0.01, logprobs=0),
              SamplingParams(logprobs=0)]
    out = _sample(logits, params, outputs=[[1, 2], [], [3], []], prompts=[[4]] * 4)
    expected = torch.log_softmax(logits, -1).gather(1, out.sampled_token_ids[:, None]).squeeze(1)
    assert torch.allclose(out.sampled_logprobs, expected, atol=1e-5)
    assert out.sampled_logprobs.dtype == torch.float32


def test_sampled_logprobs_only_for_rows_that_need_them():
    torch.manual_seed(18)
    logits = torch.randn(3, V) * 2
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, n=1, best_of=2),
              SamplingParams(temperature=0.0)]
    md = _build(params, logits)
    assert md.logprob_rows.tolist() == [1]
    out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    lsm = torch.log_softmax(logits, -1)
    assert math.isclose(out.sampled_logprobs[1].item(), lsm[1].max().item(), abs_tol=1e-5)
    assert torch.isnan(out.sampled_logprobs[[0, 2]]).all()
    none_needed = _sample(logits, [SamplingParams(temperature=0.0)] * 3)
    assert torch.isnan(none_needed.sampled_logprobs).all()
    assert _build([SamplingParams(logprobs=1)] * 2).logprob_rows is None  # all rows: no index


def test_topk_logprobs_and_ranks():
    torch.manual_seed(16)
    logits = torch.randn(3, V)
    params = [SamplingParams(logprobs=2), SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams()]
    out = _sample(logits, params)
    lsm = torch.log_softmax(logits, -1)
    assert out.topk_token_ids.shape == (3, 5) and out.topk_token_ids.dtype == torch.int64
    assert out.topk_logprobs.shape == (3, 5) and out.topk_logprobs.dtype == torch.float32
    ref_vals, ref_ids = lsm.topk(5, -1)
    assert torch.equal(out.topk_token_ids, ref_ids)
    assert torch.allclose(out.topk_logprobs, ref_vals, atol=1e-5)
    sampled_lp = lsm.gather(1, out.sampled_token_ids[:, None])
    assert torch.equal(out.sampled_ranks, (lsm > sampled_lp).sum(-1) + 1)
    assert out.sampled_ranks[1] == 1  # greedy


def test_zero_logprobs_gives_empty_topk():
    out = _sample(torch.randn(2, V), [SamplingParams(logprobs=0), SamplingParams()])
    assert out.topk_token_ids.shape == (2, 0) and out.topk_logprobs.shape == (2, 0)
    assert out.sampled_ranks.shape == (2,)


def test_compute_prompt_logprobs():
    torch.manual_seed(17)
    logits = torch.randn(7, V)
    target = torch.randint(0, V, (7,))
    lp, ranks, ids, top = compute_prompt_logprobs(logits, target, 3)
    lsm = torch.log_softmax(logits, -1)
    assert torch.allclose(lp, lsm[torch.arange(7), target], atol=1e-5)
    assert torch.equal(ranks, (lsm > lsm[torch.arange(7), target][:, None]).sum(-1) + 1)
    ref_vals, ref_ids = lsm.topk(3, -1)
    assert torch.equal(ids, ref_ids) and torch.allclose(top, ref_vals, atol=1e-5)
    lp0, _, ids0, top0 = compute_prompt_logprobs(logits, target, 0)
    assert ids0.shape == (7, 0) and top0.shape == (7, 0)
    assert math.isclose(float(lp0.sum()), float(lp.sum()), rel_tol=1e-6)
    with pytest.raises(ValueError, match="num_logprobs"):
        compute_prompt_logprobs(logits, target, -1)
