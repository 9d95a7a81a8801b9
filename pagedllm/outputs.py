"""What callers get back: vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field



@dataclass
class Logprob:
    """Log-probability of one token (natural log, from the model's raw logits).

    Attributes:
        logprob: log p(token), from the unprocessed logits.
        rank: 1-based rank of the token under those logits, or None.
        decoded_token: the token's text, filled by the detokenizer, or None.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None

# Per generated (or prompt) token: {token_id: Logprob} for the chosen token and the top-k.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One sample of a request.

    Attributes:
        index: sample index within the request (0 .. n-1).
        text: generated text (stop string cut unless ``include_stop_str_in_output``).
        token_ids: generated token ids (a stop token id is kept).
        cumulative_logprob: sum of the sampled tokens' log-probabilities (natural log, raw logits);
            None unless ``logprobs`` was asked for (or ``best_of`` > ``n``), as in vLLM.
        logprobs: per generated token, the top-``logprobs`` dict, or None if not asked for.
        finish_reason: None while running, then "stop", "length" or "abort".
        stop_reason: the stop string or stop token id that ended the sample, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (``time.monotonic`` seconds) and derived latencies of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token (s)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request after a step (or at the end of ``LLM.generate``).

    Attributes:
        request_id: the caller's id.
        prompt: the prompt text (None when token ids were given).
        prompt_token_ids: the tokenized prompt.
        prompt_logprobs: None, or per prompt token (first one None) its logprobs dict.
        outputs: one ``CompletionOutput`` per sample, by index.
        finished: True when every sample has finished.
        metrics: request timings.
        num_cached_tokens: prompt tokens found in the prefix cache (vLLM's name; of the first
            sample), None until the first token; ``usage.prompt_tokens_details.cached_tokens``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
    num_cached_tokens: int | None = None
