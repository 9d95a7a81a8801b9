"""Turns per-step ``EngineCoreOutput``s into ``RequestOutput``s: detokenization, stop strings,
logprobs, and the fan-in of n > 1 / best_of samples into one parent request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.metrics.stats import IterationStats
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.tokenizer import Tokenizer


def record_new_tokens(key: str, metrics: RequestMetrics, num_new: int, now: float,
                      iteration_stats: IterationStats | None,
                      prev_times: dict[str, tuple[float | None, float | None]]) -> None:
    """Account ``num_new`` generated tokens of request ``key`` at ``now`` (seconds, monotonic):
    the step's generation-token count, the request's (first, last) token times before this step
    (kept once per step in ``prev_times``, for TTFT / inter-token latency), then its first and
    last token times."""
    if iteration_stats is not None:
        iteration_stats.num_generation_tokens += num_new
        prev_times.setdefault(key, (metrics.first_token_time, metrics.last_token_time))
    if metrics.first_token_time is None:
        metrics.first_token_time = now
    metrics.last_token_time = now


@dataclass
class SampleState:
    """One sample (engine-level request) of a parent request."""

    request_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    changed: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ParentState:
    """A user request: ``best_of or n`` samples, of which the best ``n`` are returned."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


@dataclass
class ProcessedOutputs:
    """``request_outputs`` to hand to callers; ``reqs_to_abort``: samples that hit a stop string,
    which the scheduler must finish (their blocks are freed)."""

    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]


class OutputProcessor:
    """Keeps the per-request output state between steps.

    Args:
        tokenizer: for detokenization and decoded logprob tokens.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.sample_to_parent: dict[str, tuple[ParentState, SampleState]] = {}

    def add_request(self, parent_id: str, sample_ids: list[str], prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, sample_params: list[SamplingParams], arrival_time: float,
                    prime_token_ids: list[int] | None = None) -> None:
        """Register a parent request and its samples (engine-level request ids).

        ``prime_token_ids``: the prompt ids the detokenizers start from (default
        ``prompt_token_ids``; a prompt given as embeddings has placeholders there)."""
        samples = []
        prime = prompt_token_ids if prime_token_ids is None else prime_token_ids
        for i, (sid, sp) in enumerate(zip(sample_ids, sample_params)):
            detok = IncrementalDetokenizer(self.tokenizer.backend, prime, sp)
            samples.append(SampleState(sid, i, sp, detok, logprobs=[] if sp.logprobs is not None else None))
        parent = ParentState(parent_id, prompt, prompt_token_ids, params, samples, RequestMetrics(arrival_time),
                             prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        self.parents[parent_id] = parent
        for s in samples:
            self.sample_to_parent[s.request_id] = (parent, s)

    def has_request(self, parent_id: str) -> bool:
        return parent_id in self.parents

    def sample_ids(self, parent_id: str) -> list[str]:
        parent = self.parents.get(parent_id)
        return [s.request_id for s in parent.samples] if parent else []

    def abort_requests(self, parent_ids: list[str],
                       iteration_stats: IterationStats | None = None) -> list[RequestOutput]:
        """Mark every unfinished sample aborted and return final outputs for the parents
        (recorded as finished with reason "abort" in ``iteration_stats`` when given)."""
        outs = []
        now = time.monotonic()
        for pid in parent_ids:
            parent = self.parents.get(pid)
            if parent is None:
                continue
            for s in parent.samples:
                if not s.finished:
                    s.finish_reason, s.changed = "abort", True
            parent.metrics.finished_time = now
            if iteration_stats is not None:
                self._observe_finished(parent, iteration_stats, now)
            outs.append(self._make_output(parent))
            self._drop(parent)
        return outs

    def process_outputs(self, core_outputs: list[EngineCoreOutput],
                        iteration_stats: IterationStats | None = None) -> ProcessedOutputs:
        """Apply one step's outputs.

        Args:
            core_outputs: the scheduler's outputs of this step.
            iteration_stats: when given, receives generated-token counts, TTFTs, inter-token
                latencies and finished requests.
        Returns:
            RequestOutputs for parents that changed (by the parent's ``output_kind``), and the
            sample ids to finish in the scheduler because a stop string matched.
        """
        now = time.monotonic()
        touched: dict[str, ParentState] = {}
        to_abort: list[str] = []
        # parent id -> (first_token_time, last_token_time) before this step, for latency stats.
        prev_times: dict[str, tuple[float | None, float | None]] = {}
        for out in core_outputs:
            entry = self.sample_to_parent.get(out.request_id)
            if entry is None:
                continue
            parent, sample = entry
            if sample.finished:
                continue
            touched[parent.request_id] = parent
            if out.new_prompt_logprobs and parent.prompt_logprobs is not None and sample.index == 0:
                room = len(parent.prompt_token_ids) - len(parent.prompt_logprobs)
                parent.prompt_logprobs.extend(self._decode_logprobs(out.new_prompt_logprobs[:max(room, 0)]))
            if out.new_token_ids and parent.num_cached_tokens is None and sample.index == 0:
                parent.num_cached_tokens = out.num_cached_tokens
            scheduled = out.first_scheduled_time
            if scheduled is not None and (parent.metrics.first_scheduled_time is None
                                          or scheduled < parent.metrics.first_scheduled_time):
                parent.metrics.first_scheduled_time = scheduled
            # A prompt-only request (the server's echo with max_tokens 0): its one token is dropped.
            if out.new_token_ids and not sample.params._prompt_only:
                stop_terminated = out.finish_reason == "stop" and isinstance(out.stop_reason, int)
                new_ids, stop_str = self._detokenize(sample, out.new_token_ids, stop_terminated)
                record_new_tokens(parent.request_id, parent.metrics, len(new_ids), now,
                                  iteration_stats, prev_times)
                sample.changed = True
                sample.token_ids.extend(new_ids)
                sample.cumulative_logprob += sum(out.new_logprobs[:len(new_ids)])
                if sample.logprobs is not None:
                    sample.logprobs.extend(self._decode_logprobs(out.new_top_logprobs[:len(new_ids)]))
                # A stop string before the step's last token (speculative decoding) ends the sample
                # there, whatever the scheduler decided at the last token.
                if stop_str is not None and (out.finish_reason is None or len(new_ids) < len(out.new_token_ids)):
                    sample.finish_reason, sample.stop_reason = "stop", stop_str
                    if out.finish_reason is None:
                        to_abort.append(sample.request_id)
            if out.finish_reason is not None and not sample.finished:
                sample.finish_reason, sample.stop_reason, sample.changed = out.finish_reason, out.stop_reason, True
        if iteration_stats is not None:
            for pid, (first, last) in prev_times.items():
                parent = touched[pid]
                iteration_stats.observe_new_tokens(parent.metrics, first, last, len(parent.prompt_token_ids), now)
        results = []
        for parent in touched.values():
            if parent.finished:
                parent.metrics.finished_time = now
                if iteration_stats is not None:
                    self._observe_finished(parent, iteration_stats, now)
            kind = parent.params.output_kind
            if kind == RequestOutputKind.FINAL_ONLY and not parent.finished:
                continue
            if parent.params.best_of and parent.params.best_of > parent.params.n and not parent.finished:
                continue
            results.append(self._make_output(parent))
            if parent.finished:
                self._drop(parent)
        return ProcessedOutputs(results, to_abort)

    @staticmethod
    def _detokenize(sample, new_token_ids: list[int], stop_terminated: bool) -> tuple[list[int], str | None]:
        """Feed a sample's new tokens to its detokenizer; returns (the tokens kept, the stop string
        matched or None). Several tokens in one step (speculative decoding) with stop strings go
        one at a time, and a match drops the tokens after it, so the output is what one token per
        step would have given."""
        num_known = len(sample.token_ids)
        if len(new_token_ids) == 1 or not sample.detokenizer.has_stop_strings:
            return new_token_ids, sample.detokenizer.update(new_token_ids, num_known + len(new_token_ids),
                                                            stop_terminated)
        last = len(new_token_ids) - 1
        for j, token_id in enumerate(new_token_ids):
            stop_str = sample.detokenizer.update([token_id], num_known + j + 1, stop_terminated and j == last)
            if stop_str is not None:
                return new_token_ids[:j + 1], stop_str
        return new_token_ids, None

    @staticmethod
    def _observe_finished(parent: ParentState, iteration_stats: IterationStats, now: float) -> None:
        reasons = [s.finish_reason for s in parent.samples]
        reason = "abort" if "abort" in reasons else (reasons[0] or "abort")
        iteration_stats.observe_finished(parent.metrics, reason, len(parent.prompt_token_ids),
                                         sum(len(s.token_ids) for s in parent.samples), len(parent.samples), now)

    def _decode_logprobs(self, entries):
        for entry in entries:
            if entry is None:
                yield None
                continue
            for tok, lp in entry.items():
                if lp.decoded_token is None:
                    lp.decoded_token = self.tokenizer.decode([tok], skip_special_tokens=False)
            yield entry

    def _make_output(self, parent: ParentState) -> RequestOutput:
        delta = parent.params.output_kind == RequestOutputKind.DELTA
        samples = parent.samples
        n = parent.params.n
        if parent.finished and len(samples) > n:
            # best_of: keep the n samples with the highest cumulative logprob (OpenAI semantics).
            samples = sorted(samples, key=lambda s: s.cumulative_logprob, reverse=True)[:n]
        elif delta:
            samples = [s for s in samples if s.changed]
        outputs = []
        for out_index, s in enumerate(samples):
            index = out_index if len(parent.samples) > n else s.index
            text = s.detokenizer.get_next_output_text(s.finished, delta)
            if delta:
                token_ids = s.token_ids[s.num_sent_tokens:]
                logprobs = s.logprobs[s.num_sent_tokens:] if s.logprobs is not None else None
            else:
                token_ids = list(s.token_ids)
                logprobs = list(s.logprobs) if s.logprobs is not None else None
            s.num_sent_tokens, s.changed = len(s.token_ids), False
            cumulative = s.cumulative_logprob if parent.params.needs_sampled_logprobs else None
            outputs.append(CompletionOutput(index, text, token_ids, cumulative, logprobs,
                                            s.finish_reason, s.stop_reason))
        prompt_logprobs = parent.prompt_logprobs
        # A delta carries the prompt logprobs once, complete (a chunked prefill delivers them in parts).
        complete = prompt_logprobs is not None and len(prompt_logprobs) >= len(parent.prompt_token_ids)
        if delta and (parent.prompt_logprobs_sent or not complete):
            prompt_logprobs = None
        elif prompt_logprobs is not None:
            parent.prompt_logprobs_sent = True
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, prompt_logprobs,
                             outputs, parent.finished, parent.metrics, num_cached_tokens=parent.num_cached_tokens)

    def _drop(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for s in parent.samples:
            self.sample_to_parent.pop(s.request_id, None)
