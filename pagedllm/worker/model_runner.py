"""SchedulerOutput -> the worker's request states -> flattened batch -> one forward -> sampled tokens."""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from pagedllm.attention.ops import build_attention_metadata
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.outputs import Logprob
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler, compute_prompt_logprobs, make_generator
from pagedllm.sampling_params import LogitsProcessor
from pagedllm.structured_output.bitmask import apply_step_bitmask
from pagedllm.worker.request_states import RequestStates, ScheduledRequest

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs one scheduler step on the model.

    Keeps the worker's copy of every request (``RequestStates``, updated from each step's
    diffs), builds ``input_ids``, ``positions`` and the ``AttentionMetadata`` (slot mapping, block
    tables, sequence lengths) for the flattened batch, runs the model once, sends only the last
    position of each sampling request through the LM head (plus prompt positions of requests
    that asked for prompt logprobs), and samples.

    Args:
        model: a registered model (``forward`` / ``compute_logits``).
        kv_caches: per layer (k_cache, v_cache), each [num_blocks, block_size, Hkv, D].
        block_size: tokens per block.
        device: where the model lives.
        vocab_size: logits width.
        seed: seeds the generator shared by unseeded random rows.
    """

    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device, vocab_size: int, seed: int = 0) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        self.default_generator = make_generator(seed, device)
        self.requests = RequestStates()
        # In-process logits processors of the next step's new requests (never in the message; see
        # ``add_logits_processors``), moved into the request's state by that step.
        self._logits_processors: dict[str, list[LogitsProcessor]] = {}

    def add_logits_processors(self, req_id: str, processors: list[LogitsProcessor]) -> None:
        """Attach the logits processors of a request that the next ``execute_model`` sends as
        new; the engine hands them over in-process (callables are never part of the message)."""
        self._logits_processors[req_id] = list(processors)

    def _generator_for(self, req: ScheduledRequest) -> torch.Generator | None:
        params = req.sampling_params
        if params.seed is None or params.sampling_type_greedy:
            return None
        state = req.state
        if state.generator is None:
            state.generator = make_generator(params.seed, self.device)
        return state.generator

    def _update_states(self, sched: SchedulerOutput) -> list[ScheduledRequest]:
        """Apply the step's diffs; attach in-process logits processors to new requests."""
        reqs = self.requests.update(sched)
        if self._logits_processors:
            for new in sched.scheduled_new_reqs:
                processors = self._logits_processors.pop(new.req_id, None)
                if processors:
                    state = self.requests.requests[new.req_id]
                    state.sampling_params = state.sampling_params.clone()
                    state.sampling_params.logits_processors = processors
        return reqs

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step.

        Raises:
            RuntimeError: if a block table does not cover a scheduled token (scheduler bug).
        """
        reqs = self._update_states(sched)
        output = ModelRunnerOutput()
        if not reqs:
            return output
        self._copy_blocks(sched.blocks_to_copy)

        query_lens = [r.num_scheduled_tokens for r in reqs]
        context_lens = [r.num_computed_tokens for r in reqs]
        input_ids = torch.from_numpy(np.fromiter(
            (t for r in reqs for t in r.token_ids), dtype=np.int64, count=sum(query_lens))).to(self.device)
        # positions: context_len .. context_len + query_len - 1 for each request, flattened.
        q = np.asarray(query_lens, dtype=np.int64)
        starts = np.repeat(np.asarray(context_lens, dtype=np.int64) - np.concatenate(([0], np.cumsum(q)[:-1])), q)
        positions = torch.from_numpy(np.arange(int(q.sum()), dtype=np.int64) + starts).to(self.device)
        md = build_attention_metadata(query_lens, context_lens, [r.block_table for r in reqs],
                                      self.block_size, self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, md)          # [T, H]

        ends = np.cumsum(q) - 1                                                # last token index per request
        sample_rows = [i for i, r in enumerate(reqs) if r.sample]
        if sample_rows:
            idx = torch.as_tensor(ends[sample_rows], device=self.device)
            logits = self.model.compute_logits(hidden[idx]).float()            # [N, V]
            sampling_reqs = [reqs[i] for i in sample_rows]
            if sched.grammar_bitmask is not None:  # [structured output] grammar masks, one call
                apply_step_bitmask(logits, [r.request_id for r in sampling_reqs],
                                   sched.structured_output_request_ids, sched.grammar_bitmask)
            metadata = SamplingMetadata.build(
                [r.sampling_params for r in sampling_reqs],
                [r.state.output_token_ids for r in sampling_reqs],
                [r.state.prompt_token_ids for r in sampling_reqs],
                [self._generator_for(r) for r in sampling_reqs],
                logits.shape[-1], self.device, default_generator=self.default_generator)
            sampled = self.sampler(logits, metadata)
            output.req_ids = [r.request_id for r in sampling_reqs]
            output.sampled_token_ids = sampled.sampled_token_ids.tolist()
            output.sampled_logprobs = sampled.sampled_logprobs.tolist()
            output.top_logprobs = self._top_logprobs(sampling_reqs, sampled)
        self._prompt_logprobs(reqs, hidden, np.concatenate(([0], np.cumsum(q))), output)
        return output

    def _top_logprobs(self, reqs: list[ScheduledRequest], sampled) -> list[dict[int, Logprob] | None]:
        if sampled.topk_token_ids is None:
            return [None] * len(reqs)
        ids = sampled.topk_token_ids.tolist()
        lps = sampled.topk_logprobs.tolist()
        ranks = sampled.sampled_ranks.tolist() if sampled.sampled_ranks is not None else [None] * len(reqs)
        chosen = sampled.sampled_token_ids.tolist()
        chosen_lp = sampled.sampled_logprobs.tolist()
        out: list[dict[int, Logprob] | None] = []
        for i, r in enumerate(reqs):
            k = r.sampling_params.logprobs
            if k is None:
                out.append(None)
                continue
            entry = {chosen[i]: Logprob(chosen_lp[i], ranks[i])}
            for rank, (tok, lp) in enumerate(zip(ids[i][:k], lps[i][:k]), start=1):
                if tok not in entry:
                    entry[tok] = Logprob(lp, rank)
            out.append(entry)
        return out

    def _prompt_logprobs(self, reqs: list[ScheduledRequest], hidden: torch.Tensor, starts: np.ndarray,
                         output: ModelRunnerOutput) -> None:
        """Logprobs of prompt tokens 1..P-1 covered by this step's chunk: the logits at position
        j score prompt token j + 1."""
        for i, r in enumerate(reqs):
            k = r.sampling_params.prompt_logprobs
            if k is None:
                continue
            prompt = r.state.prompt_token_ids
            num_prompt = len(prompt)
            first, last = r.num_computed_tokens, min(r.num_computed_tokens + r.num_scheduled_tokens, num_prompt - 1)
            if first >= last:
                continue
            rows = hidden[int(starts[i]): int(starts[i]) + (last - first)]
            logits = self.model.compute_logits(rows).float()
            targets = torch.as_tensor(prompt[first + 1: last + 1], device=self.device)
            tgt_lp, ranks, top_ids, top_lps = compute_prompt_logprobs(logits, targets, k)
            tgt_lp, ranks = tgt_lp.tolist(), ranks.tolist()
            top_ids, top_lps = top_ids.tolist(), top_lps.tolist()
            entries = []
            for j, tok in enumerate(prompt[first + 1: last + 1]):
                entry = {tok: Logprob(tgt_lp[j], ranks[j])}
                for rank, (t, lp) in enumerate(zip(top_ids[j], top_lps[j]), start=1):
                    entry.setdefault(t, Logprob(lp, rank))
                entries.append(entry)
            output.prompt_logprobs[r.request_id] = entries

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy physical block src to dst in every layer's K and V pool."""
        if not pairs:
            return
        src = torch.as_tensor([p[0] for p in pairs], device=self.device)
        dst = torch.as_tensor([p[1] for p in pairs], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]
