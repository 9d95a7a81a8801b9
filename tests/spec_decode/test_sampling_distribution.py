"""Speculative sampling keeps the target's distribution (Leviathan et al. / Chen et al. 2023): a
chi-square goodness-of-fit test of the joint distribution of the first three sampled tokens
(temperature 1, top_k 4, unseeded) against the exact probabilities from transformers, with drafts
that are accepted and rejected at every position.

False-alarm rate: the test fails when the p-value is below ``ALPHA`` = 1e-3, so a correct engine
fails it one run in a thousand for a given RNG state; the engine's seed is fixed, so the result is
the same on every run. Power: the same counts are tested against the distribution at temperature
0.8 (what a wrong rule that favours likely drafts would look like) and must be rejected.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pagedllm import LLM, SamplingParams
from oracle import OracleProposer

ALPHA = 1e-3
NUM_SAMPLES = 3000
TOP_K = 4
PROMPT = [30, 31, 32, 33, 34, 35, 30, 31, 32]


def chi_square_p_value(observed: dict, expected: dict) -> float:
    """Pearson's chi-square over the cells of ``expected`` (counts), cells with an expected count
    below 5 pooled into one; p = Q(df / 2, stat / 2), the chi-square survival function."""
    cells = sorted(expected, key=lambda c: expected[c])
    pooled_e = pooled_o = 0.0
    stat, df = 0.0, -1
    for c in cells:
        e, o = expected[c], observed.get(c, 0)
        if e < 5:
            pooled_e += e
            pooled_o += o
            continue
        stat += (o - e) ** 2 / e
        df += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        df += 1
    assert df >= 3, "too few cells for the test"
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def exact_joint(model_dir: str, temperature: float) -> dict[tuple[int, int, int], float]:
    """P(t1, t2, t3 | PROMPT) under top_k = TOP_K sampling at ``temperature`` (transformers, float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def next_probs(prefix: list[int]) -> dict[int, float]:
        logits = model(torch.tensor([PROMPT + prefix])).logits[0, -1]
        top = logits.topk(TOP_K)
        probs = torch.softmax(top.values / temperature, dim=-1)
        return dict(zip(top.indices.tolist(), probs.tolist()))

    joint = {}
    p1 = next_probs([])
    for t1, a in p1.items():
        p2 = next_probs([t1])
        for t2, b in p2.items():
            for t3, c in next_probs([t1, t2]).items():
                joint[(t1, t2, t3)] = a * b * c
    return joint


def test_speculative_sampling_matches_the_target_distribution(make_tiny_checkpoint):
    path = make_tiny_checkpoint("llama")
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=8, seed=1234,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "adaptive": False})
    joint = exact_joint(path, 1.0)
    # Drafts: the most likely continuation after the most likely first token (so they are right
    # for some samples and wrong for others, at both positions).
    t1 = max({k[0] for k in joint}, key=lambda t: sum(v for k, v in joint.items() if k[0] == t))
    t2 = max({k[1] for k in joint if k[0] == t1}, key=lambda t: sum(v for k, v in joint.items() if k[:2] == (t1, t)))
    t3 = max((k[2] for k in joint if k[:2] == (t1, t2)), key=lambda t: joint[(t1, t2, t)])
    oracle = OracleProposer([(PROMPT, [t1, t2, t3])], wrong=0.0, vocab_size=llm.llm_engine.vocab_size)
    llm.llm_engine.spec_decoder.proposer = oracle
    # Four tokens, so that the first decode can verify two drafts (it stops short of max_tokens).
    params = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * NUM_SAMPLES, params, use_tqdm=False)
    observed: dict = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids[:3])
        observed[key] = observed.get(key, 0) + 1
    assert set(observed) <= set(joint), "a token outside the top-k was sampled"
    stats = llm.llm_engine.spec_decoder.stats
    assert stats.num_draft_tokens > 1000
    assert 0.03 < stats.acceptance_rate < 0.9          # both outcomes (the tiny model is nearly uniform)
    assert stats.num_accepted_tokens_per_pos[1] > 100  # second drafts accepted too
    p = chi_square_p_value(observed, {k: v * NUM_SAMPLES for k, v in joint.items()})
    assert p > ALPHA, f"sampled distribution differs from the target's (p = {p:.2e})"
    # Power: the counts are far from a slightly sharper distribution.
    sharper = exact_joint(path, 0.8)
    assert chi_square_p_value(observed, {k: v * NUM_SAMPLES for k, v in sharper.items()}) < ALPHA


@pytest.mark.parametrize("df, stat, want", [(1, 3.841, 0.05), (10, 29.588, 0.001), (20, 45.315, 0.001)])
def test_chi_square_survival_function_matches_the_tables(df, stat, want):
    """Q(df/2, x/2) at the critical values of the standard chi-square tables."""
    got = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                        torch.tensor(stat / 2, dtype=torch.float64)))
    assert got == pytest.approx(want, rel=2e-3)
