"""How many draft tokens each request verifies per step, and the counts for the metrics.

The rule (``SpeculativeConfig.adaptive``): a step's wall time is modelled as ``T = W + t * n`` for
``n`` scheduled tokens (W: reading the weights and the fixed per-step work, t: the cost of one more
token), fitted online by least squares with exponential forgetting over the engine's decode-only
steps. A request accepts each next draft with probability ``a`` (the ratio of accepted drafts to
drafts verified up to and including the first rejection, over its own history, starting from a
prior of 1/2 worth two drafts). A draft at depth ``j`` is then emitted with probability ``a**j``
and costs ``t``; with ``B`` requests running, a step emits about ``B`` tokens in ``W + B * t``, so
adding it raises the expected tokens per second exactly when ``a**j > t / (W / B + t)``. Each
request drafts the largest ``k <= num_speculative_tokens`` whose last draft passes that bar. So at
batch 1, where ``W`` dominates, drafts are cheap and most requests speculate; as ``B`` grows the
bar rises towards 1 and speculation turns itself off; a request whose drafts are rarely accepted
stops drafting, and drafts one token every ``PROBE_INTERVAL`` steps to learn whether that changed.
Above ``disable_by_batch_size`` running requests (vLLM's key) nobody drafts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.proposer import Proposer

# A request that stopped drafting drafts one token after this many steps without drafts.
PROBE_INTERVAL = 16
# The prior acceptance probability and its weight (drafts) before a request has its own history.
_PRIOR_ACCEPTANCE = 0.5
_PRIOR_WEIGHT = 2.0
# Forgetting factor of the step-time fit (per decode step), and the prior ratio t / W before the
# fit has seen two different token counts.
_FIT_DECAY = 0.98
_PRIOR_TOKEN_COST = 0.25


@dataclass
class SpecDecodingStats:
    """Speculative-decoding counts since the engine started (vLLM's spec-decode metrics).

    Attributes:
        num_drafts: verification steps of a request with at least one draft token.
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: draft tokens accepted.
        num_accepted_tokens_per_pos: accepted drafts by position in the draft (0-based), length
            ``num_speculative_tokens``.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (NaN before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else math.nan

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step with drafts, the corrected / bonus token included
        (vLLM's "mean acceptance length"; NaN before any draft)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

    def copy(self) -> "SpecDecodingStats":
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))


@dataclass
class _RequestHistory:
    accepted: int = 0
    trials: int = 0             # drafts verified up to and including the first rejection
    steps_without_draft: int = 0

    @property
    def acceptance(self) -> float:
        return (self.accepted + _PRIOR_ACCEPTANCE * _PRIOR_WEIGHT) / (self.trials + _PRIOR_WEIGHT)


class StepTimeModel:
    """Least-squares fit of ``T = W + t * n`` (seconds; n tokens) with exponential forgetting."""

    def __init__(self) -> None:
        self._s = [0.0] * 5   # weights, sum n, sum n^2, sum T, sum n*T

    def observe(self, num_tokens: int, seconds: float) -> None:
        s = self._s
        for i, v in enumerate((1.0, num_tokens, num_tokens * num_tokens, seconds, num_tokens * seconds)):
            s[i] = s[i] * _FIT_DECAY + v

    def token_cost_ratio(self, batch_size: int) -> float:
        """``t / (W / B + t)`` for ``B = batch_size``: the bar a draft's emission probability must
        pass (``_PRIOR_TOKEN_COST`` as t / W until the fit has spread in n)."""
        w, sn, snn, st, snt = self._s
        var = w * snn - sn * sn
        ratio = _PRIOR_TOKEN_COST
        if w > 0 and var > 1e-9 * max(w * snn, 1.0):
            t = max((w * snt - sn * st) / var, 0.0)
            fixed = max((st - t * sn) / w, 1e-9)
            ratio = t / fixed
        return ratio / (1 / max(batch_size, 1) + ratio)


class SpecDecodeController:
    """Sizes each request's drafts, asks the proposer for them, and counts the outcome.

    Args:
        config: the speculative config.
        proposer: the engine-side proposer (n-gram, suffix), or None when drafts come from the
            worker (draft models: ``set_worker_drafts``).
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None) -> None:
        self.config = config
        self.proposer = proposer
        self.num_speculative_tokens = config.num_speculative_tokens
        self.step_time = StepTimeModel()
        self.stats = SpecDecodingStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self._history: dict[str, _RequestHistory] = {}
        self._worker_drafts: dict[str, list[int]] = {}
        self._bar = 0.0

    def begin_step(self, num_running: int) -> None:
        """Set the step's acceptance bar from the number of running requests (``B``)."""
        limit = self.config.disable_by_batch_size
        self._bar = math.inf if limit is not None and num_running > limit else \
            self.step_time.token_cost_ratio(num_running)

    def num_drafts(self, request_id: str) -> int:
        """Draft tokens the request should verify this step (the rule in the module docstring)."""
        if math.isinf(self._bar):
            return 0
        if not self.config.adaptive:
            return self.num_speculative_tokens
        history = self._history.setdefault(request_id, _RequestHistory())
        a = history.acceptance
        if a <= 0 or a <= self._bar:
            k = 0
        elif a >= 1:
            k = self.num_speculative_tokens
        else:
            k = min(self.num_speculative_tokens, int(math.log(self._bar) / math.log(a)) if self._bar > 0
                    else self.num_speculative_tokens)
        if k == 0 and history.steps_without_draft >= PROBE_INTERVAL:
            k = 1
        return k

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` drafts (>= 1): the proposer's, or the worker's from the last step."""
        if self.proposer is not None:
            return self.proposer.propose(request_id, token_ids, max_tokens)[:max_tokens]
        return self._worker_drafts.pop(request_id, [])[:max_tokens]

    def skipped(self, request_id: str) -> None:
        """The request decodes this step without drafts."""
        history = self._history.get(request_id)
        if history is not None:
            history.steps_without_draft += 1

    def set_worker_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Drafts the worker's draft model proposed in the last step, by request id."""
        self._worker_drafts.update(drafts)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification step's outcome: ``num_accepted`` of ``num_drafts`` drafts accepted."""
        if num_drafts <= 0:
            return
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            s.num_accepted_tokens_per_pos[pos] += 1
        history = self._history.setdefault(request_id, _RequestHistory())
        history.accepted += num_accepted
        history.trials += num_accepted + (1 if num_accepted < num_drafts else 0)
        history.steps_without_draft = 0

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode-only step of ``num_tokens`` scheduled tokens took ``seconds``."""
        self.step_time.observe(num_tokens, seconds)

    def finish_request(self, request_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        """Forget the request (the proposer may keep its output)."""
        self._history.pop(request_id, None)
        self._worker_drafts.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.finish_request(request_id, token_ids, num_prompt_tokens)


def make_proposer(config: SpeculativeConfig) -> Proposer | None:
    """The engine-side proposer of ``config.method`` (None for the draft-model methods)."""
    if config.method == "ngram":
        from pagedllm.spec_decode.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        from pagedllm.spec_decode.suffix import SuffixDecodingProposer

        return SuffixDecodingProposer(config.suffix_decoding_max_tree_depth,
                                      config.suffix_decoding_max_cached_requests,
                                      config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
    return None
