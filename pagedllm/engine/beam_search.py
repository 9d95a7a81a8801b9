"""Beam search above the scheduler, with beams that share KV blocks through forks.

vLLM keeps beam search out of its engine core (``LLM.beam_search`` drives ``generate`` one token at
a time); so does pagedllm, but its beams are live scheduler requests that share blocks instead of
new prompts. Each beam is an engine request sampling greedily with ``logprobs = 2 * beam_width``
(the runner returns the raw top-2W log-probabilities of its next token). When every live beam of a
prompt has produced its step's token (beams that report early are paused so they do not run
ahead), ``BeamSearchManager`` ranks the ``beam_width x 2 * beam_width`` candidates by cumulative
logprob (vLLM's semantics) and keeps the best ``beam_width``:

- the first survivor of a beam replaces that beam's just-sampled token
  (``Scheduler.replace_last_token``: it is neither computed nor sent to the worker yet);
- every further survivor of the same beam forks it (``Scheduler.fork_request``): the child shares
  all the parent's blocks (ref counts up) and copies the partial last block on its first write;
- a beam with no survivor is finished, freeing the blocks only it held.

So no beam recomputes or copies a full block of its prefix. A candidate ending in EOS (unless
``ignore_eos``) goes to the completed list. The final ranking is vLLM's
``cum_logprob / len(tokens) ** length_penalty`` with ``tokens`` = prompt + generated (an EOS at the
end not counted).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.output_processor import record_new_tokens
from pagedllm.metrics.stats import IterationStats
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams  # noqa: F401 (re-exported)


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's shape): ``tokens`` = prompt + generated, ``cum_logprob`` natural log;
    ``text`` (set when the search finishes) is the decode of all of ``tokens``, prompt and special
    tokens included, as vLLM's ``LLM.beam_search`` sets it (the server's choices and
    ``RequestOutput.outputs`` carry only the generated text)."""

    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """vLLM's ``BeamSearchOutput``: the best ``beam_width`` sequences, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's ranking score: ``cum_logprob / len ** length_penalty``, ``len`` = ``len(tokens)``
    (prompt included) minus one when the last token is EOS."""
    seq_len = len(tokens)
    if eos_token_id is not None and tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cum_logprob / (seq_len ** length_penalty)


@dataclass
class _Instance:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: BeamSearchParams
    eos_token_id: int | None
    arrival_time: float
    beams: dict[str, BeamSearchSequence]          # live engine request id -> its beam
    reported: dict[str, tuple[int, dict]] = field(default_factory=dict)  # this round's outputs
    completed: list[BeamSearchSequence] = field(default_factory=list)
    metrics: RequestMetrics | None = None         # the search's timestamps (arrival, first/last token)


def check_beam_search_request(num_prompt_tokens: int, params: BeamSearchParams, max_num_seqs: int,
                              max_model_len: int, prompt_embeds: object = None) -> int:
    """Check a beam search against an engine's scheduler limits.

    Args:
        prompt_embeds: the prompt's ``PromptEmbeds``, if any (refused: beams are token prompts).
    Returns:
        The effective max_tokens: ``params.max_tokens`` capped by what ``max_model_len`` leaves.
    Raises:
        ValueError: if ``beam_width`` exceeds ``max_num_seqs`` (the beams run as one group), the
            prompt leaves no room for a token within ``max_model_len``, or is given as embeddings.
    """
    if prompt_embeds is not None:
        raise ValueError("prompt_embeds: beam search does not run with prompt embeddings")
    if params.beam_width > max_num_seqs:
        raise ValueError(f"beam_width ({params.beam_width}) exceeds max_num_seqs ({max_num_seqs}): "
                         "the beams run as one group")
    max_tokens = min(params.max_tokens, max_model_len - num_prompt_tokens)
    if max_tokens < 1:
        raise ValueError(f"the prompt ({num_prompt_tokens} tokens) leaves no room for max_tokens "
                         f"within max_model_len ({max_model_len})")
    return max_tokens


class BeamSearchManager:
    """Beam bookkeeping over the scheduler (see the module docstring).

    Args:
        scheduler: the engine's scheduler (forks, token replacement, finishing beams).
        tokenizer: decodes the final sequences.
    """

    def __init__(self, scheduler, tokenizer) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.instances: dict[str, _Instance] = {}
        self.beam_to_instance: dict[str, _Instance] = {}
        self._ids = itertools.count()

    def has_request(self, request_id: str) -> bool:
        return request_id in self.instances

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: BeamSearchParams, arrival_time: float) -> None:
        """Start a beam search: one engine request on the prompt (the first beam).

        Raises:
            ValueError: as ``check_request``.
        """
        max_tokens = self.check_request(len(prompt_token_ids), params)
        inst = _Instance(request_id, prompt, list(prompt_token_ids), params, self.tokenizer.eos_token_id,
                         arrival_time, beams={}, metrics=RequestMetrics(arrival_time))
        inst.max_tokens = max_tokens
        self.instances[request_id] = inst
        self.scheduler.add_request(self._new_beam(inst, BeamSearchSequence(list(prompt_token_ids))))

    def check_request(self, num_prompt_tokens: int, params: BeamSearchParams, prompt_embeds: object = None) -> int:
        """``check_beam_search_request`` with this engine's scheduler limits (pure: any thread may
        call it)."""
        return check_beam_search_request(num_prompt_tokens, params, self.scheduler.max_num_seqs,
                                         self.scheduler.max_model_len, prompt_embeds)

    def _new_beam(self, inst: _Instance, seq: BeamSearchSequence) -> Request:
        rid = f"beam{next(self._ids)}_{inst.request_id}"
        params = SamplingParams(temperature=0.0, max_tokens=inst.max_tokens, ignore_eos=True,
                                logprobs=2 * inst.params.beam_width)
        inst.beams[rid] = seq
        self.beam_to_instance[rid] = inst
        request = Request(rid, inst.prompt_token_ids, params, inst.max_tokens, arrival_time=inst.arrival_time)
        # The scheduler admits the first beam only when max_num_seqs has room for all the beams.
        request.group_id, request.group_width = inst.request_id, inst.params.beam_width
        return request

    def process_outputs(self, core_outputs: list[EngineCoreOutput], iteration_stats: IterationStats | None = None
                        ) -> tuple[list[EngineCoreOutput], list[RequestOutput]]:
        """Take this step's outputs of beam requests; advance every beam search whose round is complete.

        Args:
            core_outputs: the scheduler's outputs of this step.
            iteration_stats: when given, receives the tokens the beams sampled, each search's TTFT
                and inter-token latencies (per round), and each finished search once, with the
                finish reason of its best sequence and the generated tokens of its returned
                sequences (``usage.completion_tokens``).
        Returns:
            (the other requests' outputs, finished beam searches as ``RequestOutput``s).
        """
        now = time.monotonic()
        rest, touched = [], {}
        prev_times: dict[str, tuple[float | None, float | None]] = {}
        for out in core_outputs:
            inst = self.beam_to_instance.get(out.request_id)
            if inst is None:
                rest.append(out)
                continue
            if out.new_token_ids:
                if inst.metrics.first_scheduled_time is None:
                    inst.metrics.first_scheduled_time = out.first_scheduled_time
                record_new_tokens(inst.request_id, inst.metrics, len(out.new_token_ids), now,
                                  iteration_stats, prev_times)
                inst.reported[out.request_id] = (len(out.new_token_ids), out.new_top_logprobs[-1] or {})
                request = self.scheduler.get_request(out.request_id)
                if request is not None:
                    request.paused = True   # wait for the round; do not decode the sampled token
                touched[inst.request_id] = inst
        if iteration_stats is not None:
            for rid, (first, last) in prev_times.items():
                inst = touched[rid]
                iteration_stats.observe_new_tokens(inst.metrics, first, last, len(inst.prompt_token_ids), now)
        finished = []
        for inst in touched.values():
            if set(inst.reported) >= set(inst.beams):
                result = self._advance(inst)
                if result is not None:
                    finished.append(result)
                    if iteration_stats is not None:
                        best = result.outputs[0].finish_reason if result.outputs else None
                        iteration_stats.observe_finished(
                            inst.metrics, best or "length", len(inst.prompt_token_ids),
                            sum(len(o.token_ids) for o in result.outputs), len(result.outputs), now)
        return rest, finished

    def _advance(self, inst: _Instance) -> RequestOutput | None:
        p = inst.params
        candidates: list[tuple[BeamSearchSequence, str, int]] = []
        for rid, seq in inst.beams.items():
            _, top = inst.reported[rid]
            for token_id, lp in top.items():
                new = BeamSearchSequence(seq.tokens + [token_id], seq.logprobs + [lp.logprob],
                                         seq.cum_logprob + lp.logprob)
                if token_id == inst.eos_token_id and not p.ignore_eos:
                    new.finish_reason = "stop"
                    inst.completed.append(new)
                else:
                    candidates.append((new, rid, token_id))
        key = lambda c: get_beam_search_score(c[0].tokens, c[0].cum_logprob, inst.eos_token_id, p.length_penalty)
        survivors = sorted(candidates, key=key, reverse=True)[:p.beam_width]
        inst.reported.clear()
        last_round = not survivors or len(survivors[0][0].tokens) - len(inst.prompt_token_ids) >= inst.max_tokens
        old = inst.beams
        if last_round:
            for seq, _, _ in survivors:
                seq.finish_reason = "length"
                inst.completed.append(seq)
            self._finish_beams(inst, list(old))
            return self._make_output(inst)
        inst.beams = {}
        kept: set[str] = set()
        for seq, parent_id, token_id in survivors:
            if parent_id not in kept:
                kept.add(parent_id)
                self.scheduler.replace_last_token(parent_id, token_id)
                inst.beams[parent_id] = seq
            else:
                child = self._new_beam(inst, seq)
                self.scheduler.fork_request(parent_id, child, token_id)
        self._finish_beams(inst, [rid for rid in old if rid not in kept])
        for rid in inst.beams:
            request = self.scheduler.get_request(rid)
            if request is not None:
                request.paused = False
        return None

    def _finish_beams(self, inst: _Instance, rids: list[str]) -> None:
        """Drop beams (their blocks return to the pool, shared ones stay with the other beams)."""
        self.scheduler.finish_requests(rids, RequestStatus.FINISHED_ABORTED)
        for rid in rids:
            self.beam_to_instance.pop(rid, None)

    def _make_output(self, inst: _Instance) -> RequestOutput:
        p = inst.params
        best = sorted(inst.completed, key=lambda s: get_beam_search_score(
            s.tokens, s.cum_logprob, inst.eos_token_id, p.length_penalty), reverse=True)[:p.beam_width]
        outputs = []
        num_prompt = len(inst.prompt_token_ids)
        for i, seq in enumerate(best):
            seq.text = self.tokenizer.decode(seq.tokens, skip_special_tokens=False)
            generated = self.tokenizer.decode(seq.tokens[num_prompt:], skip_special_tokens=True)
            outputs.append(CompletionOutput(i, generated, seq.tokens[num_prompt:], seq.cum_logprob, None,
                                            seq.finish_reason, None))
        self.instances.pop(inst.request_id, None)
        inst.metrics.finished_time = time.monotonic()
        out = RequestOutput(inst.request_id, inst.prompt, inst.prompt_token_ids, None, outputs, True, inst.metrics)
        out.beam_sequences = best
        return out

    def abort(self, request_id: str, iteration_stats: IterationStats | None = None) -> RequestOutput | None:
        """Finish a beam search early: its beams' blocks are freed; the output has no sequences.
        ``iteration_stats``, when given, records it as finished with reason "abort"."""
        inst = self.instances.pop(request_id, None)
        if inst is None:
            return None
        self._finish_beams(inst, list(inst.beams))
        now = time.monotonic()
        inst.metrics.finished_time = now
        if iteration_stats is not None:
            iteration_stats.observe_finished(inst.metrics, "abort", len(inst.prompt_token_ids), 0,
                                             inst.params.beam_width, now)
        return RequestOutput(request_id, inst.prompt, inst.prompt_token_ids, None, [], True, inst.metrics)
