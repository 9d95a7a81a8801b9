"""The Philox PRF and the detector against vLLM's own values.

The values below were printed by ``tools/watermarking/vllm_reference_values.py`` from vLLM
0.33.0's source (its ``v1/watermarking/prfs/philox.py``, ``detector.py`` and ``gumbel.py``'s Gamma
survival function, loaded with torch only; torch 2.13.0+cpu). Equal uniforms mean text watermarked
by vLLM with a key is detected here with that key, and the other way round.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.v1.watermarking import GumbelWatermarkDetector, PhiloxPRF
from pagedllm.watermarking.detector import gamma_survival
from pagedllm.watermarking.philox import mulhilo32, philox4x32

PRF_UNIFORMS = [  # (key, context, token, uniform)
    (1234, [-1, -1, -1, -1], 0, 0.9695760607719421),
    (1234, [-1, -1, -1, -1], 7, 0.9301977753639221),
    (1234, [10, 20, 30, 40], 262143, 0.8531206250190735),
    (1234, [2, 5, 17, 99], 1001, 0.5332568287849426),
    (0, [0, 0, 0, 0], 0, 0.6178800463676453),
    (18446744073709551615, [262143, 1, 2, 3], 5, 0.6875739693641663),
    (987654321987654321, [5, 6], 12345, 0.12372254580259323),
    (42, [1, 2, 3, 4, 5, 6, 7], 3, 0.3440020978450775),
    (42, [100, 200, 300, 400, 500, 600, 700, 800, 900], 31, 0.6898155212402344),
]
DETECTIONS = [  # (key, context_width, token_ids, score, p_value, num_scored_tokens)
    (1234, 4, list(range(100, 160)), 57.51807706883389, 0.6109294768490476, 60),
    (1234, 4, [5, 6, 7, 8] * 10 + [9, 10, 11], 5.399021849431325, 0.9512925777200928, 10),
    (7, 2, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4],
     28.15105355072079, 0.14200995582809794, 23),
]
VOCAB_ROW_1234 = [0.1752062290906906, 0.19012968242168427, 0.10319190472364426, 0.18573568761348724,
                  0.5447207689285278, 0.3214034140110016, 0.729812741279602, 0.4293850362300873,
                  0.38074859976768494, 0.07358764857053757, 0.1826905459165573, 0.4198140799999237,
                  0.25175800919532776, 0.8822038173675537, 0.4315085709095001, 0.2806284725666046]


@pytest.mark.parametrize("key,context,token,expected", PRF_UNIFORMS)
def test_prf_uniform_equals_vllm(key, context, token, expected):
    u = PhiloxPRF(key).uniform(torch.tensor([context]), torch.tensor([[token]]))
    assert u.dtype == torch.float32 and u.shape == (1, 1)
    assert u.item() == expected   # bit-exact: the same 24-bit mantissa


@pytest.mark.parametrize("use_kernel", [True, False])
def test_vocab_row_equals_vllm_and_per_token_calls(use_kernel):
    """Both vocabulary paths (the C++ kernel where it builds, and torch) give vLLM's bits."""
    prf = PhiloxPRF(1234)
    ctx = torch.tensor([[1, 2, 3, 4]])
    assert prf.vocab_uniform(ctx, 16, use_kernel=use_kernel)[0].tolist() == VOCAB_ROW_1234
    # the 4-tokens-per-encryption path equals one call per token, vocab not a multiple of 4 too
    ctxs = torch.tensor([[1, 2, 3, 4], [-1, -1, -1, 9], [7, 7, 7, 7]])
    assert torch.equal(prf.vocab_uniform(ctxs, 1001, use_kernel=use_kernel), prf.uniform(ctxs, torch.arange(1001)))


def test_kernel_equals_torch_on_random_contexts():
    from pagedllm.watermarking.philox import load_philox_kernel

    if load_philox_kernel() is None:
        pytest.skip("the C++ Philox kernel did not build here (torch runs instead)")
    gen = torch.Generator().manual_seed(0)
    ctxs = torch.randint(-1, 262144, (5, 4), generator=gen)
    for key in (0, 1234, 2**64 - 1, 0xDEADBEEF12345678):
        prf = PhiloxPRF(key)
        assert torch.equal(prf.vocab_uniform(ctxs, 70001), prf.vocab_uniform(ctxs, 70001, use_kernel=False))


def test_philox_known_answer():
    # Random123's published known-answer vector for Philox4x32-10 (counter 0, key 0)
    zero = torch.zeros((), dtype=torch.int64)
    out = [int(w) for w in philox4x32((zero, zero, zero, zero), (0, 0))]
    assert out == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = torch.full((), 0xFFFFFFFF, dtype=torch.int64)
    out = [int(w) for w in philox4x32((ones, ones, ones, ones), (0xFFFFFFFF, 0xFFFFFFFF))]
    assert out == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def test_mulhilo32_exact():
    xs = torch.tensor([0, 1, 0xFFFFFFFF, 0x12345678, 0xDEADBEEF])
    for m in (0xD2511F53, 0xCD9E8D57):
        hi, lo = mulhilo32(m, xs)
        for x, h, lw in zip(xs.tolist(), hi.tolist(), lo.tolist()):
            assert (h << 32) | lw == m * x


@pytest.mark.parametrize("key,width,ids,score,p_value,n", DETECTIONS)
def test_detector_equals_vllm(key, width, ids, score, p_value, n):
    d = GumbelWatermarkDetector(key, context_width=width).detect(ids)
    assert d.num_scored_tokens == n
    assert d.score == pytest.approx(score, rel=1e-12)
    assert d.p_value == pytest.approx(p_value, rel=1e-9)
    assert d.is_watermarked is False


def test_gamma_survival_closed_forms():
    assert gamma_survival(2.0, 1) == pytest.approx(math.exp(-2.0))
    assert gamma_survival(3.0, 2) == pytest.approx(math.exp(-3.0) * 4.0)
    assert gamma_survival(0.0, 5) == 1.0 and gamma_survival(5.0, 0) == 1.0
    # far tail of a long text: no overflow, equals torch's regularized upper incomplete gamma
    ref = torch.special.gammaincc(torch.tensor(500.0, dtype=torch.float64), torch.tensor(800.0, dtype=torch.float64))
    assert gamma_survival(800.0, 500) == pytest.approx(float(ref), rel=1e-9)


def test_detector_empty_and_bad_arguments():
    d = GumbelWatermarkDetector(1).detect([])
    assert (d.score, d.p_value, d.num_scored_tokens, d.is_watermarked) == (0.0, 1.0, 0, False)
    with pytest.raises(ValueError, match="context_width"):
        GumbelWatermarkDetector(1, context_width=0)
    with pytest.raises(ValueError, match="p_value_threshold"):
        GumbelWatermarkDetector(1, p_value_threshold=1.0)
    with pytest.raises(ValueError, match="prf"):
        GumbelWatermarkDetector(1, prf="aes")
    with pytest.raises(ValueError, match="key"):
        PhiloxPRF(2**64)
