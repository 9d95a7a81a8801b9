"""Detecting the Gumbel-max watermark in a list of token ids (vLLM's ``GumbelWatermarkDetector``).

Each token ``x_t`` after its context ``c_t`` (the ``context_width`` ids before it, -1 before the
text) is scored ``-log(1 - u(c_t, x_t))``, ``u`` the keyed PRF uniform. Without the watermark
(or with another key) the uniforms are independent U(0, 1), each score is Exp(1) and the sum of
``n`` scores is Gamma(n, 1); watermarked text picks tokens with large ``u`` and scores higher
(Aaronson's Gumbel-max / exponential-minimum scheme, 2022; Kuditipudi et al. 2023, "Robust
distortion-free watermarks for language models", as vLLM cites them). The p-value is the Gamma(n, 1)
survival function at the score, ``Q(n, s) = e^-s * sum_{k<n} s^k / k!`` (the regularized upper
incomplete gamma function). A context seen before in the text repeats one keyed uniform vector,
so its token is not independent evidence and is skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedllm.watermarking.philox import PhiloxPRF, create_prf


@dataclass(frozen=True)
class WatermarkDetection:
    """One detection (vLLM's ``WatermarkDetection``).

    Attributes:
        score: the summed per-token scores (nats; Gamma(n, 1) without the watermark).
        p_value: P(score at least this large | no watermark), in [0, 1].
        num_scored_tokens: n, the tokens scored (repeated contexts are skipped).
        is_watermarked: ``p_value <= p_value_threshold``.
    """

    score: float
    p_value: float
    num_scored_tokens: int
    is_watermarked: bool


def gamma_survival(score: float, shape: int) -> float:
    """``P(G > score)`` for ``G ~ Gamma(shape, 1)``, integer ``shape``: ``e^-s sum_{k<n} s^k/k!``,
    summed in log space (no overflow for long texts). 1.0 when ``shape`` or ``score`` is <= 0."""
    if shape <= 0 or score <= 0:
        return 1.0
    log_s = math.log(score)
    logs = [k * log_s - math.lgamma(k + 1) for k in range(shape)]
    top = max(logs)
    log_sum = top + math.log(math.fsum(math.exp(v - top) for v in logs))
    return min(1.0, math.exp(min(0.0, log_sum - score)))


def scoring_contexts(token_ids: list[int], context_width: int,
                     deduplicate: bool) -> tuple[list[tuple[int, ...]], list[int]]:
    """The (context, token) pairs a detector scores: each token with the ``context_width`` ids
    before it (-1 before the text); with ``deduplicate``, a token whose context came earlier is
    skipped."""
    seen: set[tuple[int, ...]] = set()
    contexts, targets = [], []
    prefix = [-1] * context_width + list(token_ids)
    for t, tok in enumerate(token_ids):
        ctx = tuple(prefix[t:t + context_width])
        if deduplicate:
            if ctx in seen:
                continue
            seen.add(ctx)
        contexts.append(ctx)
        targets.append(int(tok))
    return contexts, targets


class GumbelWatermarkDetector:
    """vLLM's ``GumbelWatermarkDetector``.

    Args:
        key: the secret key the text was generated with (int in [0, 2**64)).
        context_width: ids per context (the generator's ``context_width``), >= 1.
        p_value_threshold: ``is_watermarked`` when the p-value is at most this, in (0, 1).
        prf: ``"philox"`` or a ``PhiloxPRF``.
        deduplicate_contexts: skip tokens whose context occurred earlier in the text.
    Raises:
        ValueError: naming the argument: a bad key, width, threshold or PRF name.
    """

    def __init__(self, key: int, context_width: int = 4, p_value_threshold: float = 0.01,
                 prf: PhiloxPRF | str = "philox", deduplicate_contexts: bool = True) -> None:
        if isinstance(context_width, bool) or not isinstance(context_width, int) or context_width < 1:
            raise ValueError(f"context_width must be an int >= 1, got {context_width!r}")
        if not 0 < p_value_threshold < 1:
            raise ValueError(f"p_value_threshold must be in (0, 1), got {p_value_threshold!r}")
        self.prf = create_prf(prf, key) if isinstance(prf, str) else prf
        self.context_width = context_width
        self.p_value_threshold = p_value_threshold
        self.deduplicate_contexts = deduplicate_contexts

    def token_scores(self, token_ids: list[int]) -> torch.Tensor:
        """[n] float64 per-token scores ``-log(1 - u)`` of the scored tokens."""
        contexts, targets = scoring_contexts(token_ids, self.context_width, self.deduplicate_contexts)
        if not targets:
            return torch.empty(0, dtype=torch.float64)
        u = self.prf.uniform(torch.tensor(contexts, dtype=torch.int64),
                             torch.tensor(targets, dtype=torch.int64).unsqueeze(-1)).squeeze(-1)
        return -torch.log1p(-u.double())

    def detect(self, token_ids: list[int]) -> WatermarkDetection:
        """Score ``token_ids`` (the generated text's ids, no prompt) and test them.

        Returns:
            ``WatermarkDetection``; an empty list scores 0 with p-value 1.
        """
        scores = self.token_scores(token_ids)
        n = int(scores.numel())
        if n == 0:
            return WatermarkDetection(0.0, 1.0, 0, False)
        score = float(scores.sum().item())
        p_value = gamma_survival(score, n)
        return WatermarkDetection(score=score, p_value=p_value, num_scored_tokens=n,
                                  is_watermarked=p_value <= self.p_value_threshold)
