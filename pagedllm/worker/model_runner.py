"""SchedulerOutput -> the worker's request states -> flattened batch -> one forward -> sampled tokens."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch
from torch import nn

from pagedllm.attention.ops import SMALL_DECODE_SEQS, build_attention_metadata
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.communication import recv_from_prev_stage, send_to_next_stage
from pagedllm.distributed.parallel_state import ParallelContext
from pagedllm.layers.fused_ops import greedy_argmax
from pagedllm.sample.greedy_head import ExactGreedyHead
from pagedllm.outputs import Logprob
from pagedllm.sample.batch_logits_processors import BatchLogitsProcessors
from pagedllm.sample.metadata import SamplingMetadata, is_plain_greedy
from pagedllm.sample.sampler import Sampler, compute_prompt_logprobs, make_generator
from pagedllm.sampling_params import LogitsProcessor, SamplingParams
from pagedllm.structured_output.bitmask import apply_step_bitmask, forbidden_tokens
from pagedllm.worker.request_states import RequestStates, ScheduledRequest

logger = logging.getLogger(__name__)


@dataclass
class _DraftRow:
    """[speculative decoding] One scored position of a request verifying drafts, as the sampler
    reads a request state: its outputs extended by the drafts before this position (penalties,
    ``min_tokens``), the request's params and its generator."""

    req_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: object


@dataclass
class _PendingSampling:
    """[structured output] A step between its forward and its sampling (``ModelRunner``'s
    ``_prepare_sampling`` / ``_finish_sampling``): kept on the worker while the engine fills the
    grammar bitmask, when the step runs with ``grammar_bitmask_follows``.

    Attributes:
        sched: the step's message.
        reqs, sample_rows: the scheduled requests and the indices of those that sample.
        output: the step's output so far (its prompt logprobs).
        states, src, h: ``_sampling_rows``'s: a state per sampled row, the row of ``h`` each reads,
            ``h`` = [R, H] hidden rows in the model dtype.
        tokens: the exact greedy head's tokens so far, state index -> token id.
        masked: greedy grammar states whose tokens the head gives once the bitmask is known.
        rest, logits, index: ``_head_logits``'s (None until it ran, or when no row needs them).
    """

    sched: SchedulerOutput
    reqs: list[ScheduledRequest]
    sample_rows: list[int]
    output: ModelRunnerOutput
    states: list = field(default_factory=list)
    src: list[int] = field(default_factory=list)
    h: torch.Tensor | None = None
    tokens: dict[int, int] = field(default_factory=dict)
    masked: list[int] = field(default_factory=list)
    rest: list[int] | None = None
    logits: torch.Tensor | None = None
    index: list[int] | None = None


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
        parallel: this rank's tensor / pipeline place (None: the whole model). Every rank runs
            every step on the same message; a later pipeline stage receives the previous one's
            hidden states ([num_tokens, hidden_size], ``dtype``) and all ranks of the last stage
            compute the logits (a collective), but only the driver rank samples.
        host_kv_caches: the host-side pool for swap preemption, per layer (k, v), each
            [num_cpu_blocks, block_size, Hkv, D] on the CPU (pinned on CUDA); None without swap.
        greedy_head: the exact greedy head (``sample/greedy_head.py``), or None (every sampled
            row through ``compute_logits``); built by the worker only with one tensor rank.
        draft: [draft models] the draft model and its KV pool (``spec_decode/draft_model.py``),
            or None. After the step's sampling the driver drafts ``num_lookahead_tokens`` tokens
            for each sampled request (``ModelRunnerOutput.draft_token_ids``); copy-on-write
            copies the draft pool's blocks too.
        layer_groups: [hybrid KV cache] per layer of the model (this pipeline stage's layers),
            its KV cache group; the tables arrive interleaved (``core/kv_cache_spec.py``), and
            each layer's attention gets the metadata built from its group's table. None: one
            group (today's single table).
        num_kv_cache_groups: the model's groups, all stages' (how the interleaved tables split).
    """

    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device, vocab_size: int, seed: int = 0,
                 parallel: ParallelContext | None = None, hidden_size: int = 0,
                 dtype: torch.dtype | None = None,
                 host_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 greedy_head: ExactGreedyHead | None = None, draft=None,
                 layer_groups: list[int] | None = None, num_kv_cache_groups: int = 1) -> None:
        self.model = model
        self.layer_groups = layer_groups
        self.num_kv_cache_groups = 1 if layer_groups is None else num_kv_cache_groups
        self.draft = draft
        self.kv_caches = kv_caches
        self.host_kv_caches = host_kv_caches or []
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size
        # Plain greedy rows through the fused C++ argmax when the model runs the fused CPU ops.
        self.sampler = Sampler(greedy_argmax=greedy_argmax if getattr(model, "use_fused_ops", False) else None)
        self.default_generator = make_generator(seed, device)
        self.watermark = None   # [watermarking] a ``WatermarkSampler`` (``Worker.init_watermarking``)
        self.requests = RequestStates(block_size, self.num_kv_cache_groups)
        # In-process logits processors of the next step's new requests (never in the message; see
        # ``add_logits_processors``), moved into the request's state by that step.
        self._logits_processors: dict[str, list[LogitsProcessor]] = {}
        # -- tensor / pipeline parallelism --
        self.parallel = parallel or ParallelContext()
        self.is_driver = self.parallel.is_driver
        self.hidden_size, self.dtype = hidden_size, dtype
        # Exact greedy head: plain greedy rows skip the full head.
        self.greedy_head = greedy_head
        # Class-based logits processors (vLLM V1's interface; ``set_batch_logits_processors``).
        self.batch_logits_processors: BatchLogitsProcessors | None = None
        # [LoRA] the worker's slots (``lora/worker_manager.py``), set by ``Worker.init_lora``; None: no LoRA.
        self.lora_manager = None
        # [structured output] the step whose sampling waits for its grammar bitmask (``sample_tokens``).
        self._pending_sampling: _PendingSampling | None = None

    def set_batch_logits_processors(self, processors: BatchLogitsProcessors | None) -> None:
        """Run these class-based processors on every step's sampled rows (driver rank only);
        with any that can change an argmax, no row takes the exact greedy head."""
        self.batch_logits_processors = processors

    def add_logits_processors(self, req_id: str, processors: list[LogitsProcessor]) -> None:
        """Attach the logits processors of a request that the next ``execute_model`` sends as
        new; the engine hands them over in-process (callables are never part of the message)."""
        self._logits_processors[req_id] = list(processors)

    def _generator_for(self, state) -> torch.Generator | None:
        params = state.sampling_params
        if params.seed is None or params.sampling_type_greedy:
            return None
        if state.generator is None:
            state.generator = make_generator(params.seed, self.device)
        return state.generator

    def _update_states(self, sched: SchedulerOutput) -> list[ScheduledRequest]:
        """Apply the step's diffs; attach in-process logits processors to new requests; update the
        Model Runner V2 processors' slots and token buffers."""
        reqs = self.requests.update(sched)
        if self._logits_processors:
            for new in sched.scheduled_new_reqs:
                processors = self._logits_processors.pop(new.req_id, None)
                if processors:
                    state = self.requests.requests[new.req_id]
                    state.sampling_params = state.sampling_params.clone()
                    state.sampling_params.logits_processors = processors
        v2 = self.batch_logits_processors.v2 if self.batch_logits_processors is not None else None
        if v2 is not None:   # Model Runner V2 processors: request slots and token buffers
            v2.update_slots(sched, self.requests.requests)
        return reqs

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step.

        With ``sched.grammar_bitmask_follows`` only the forward and what needs no bitmask run
        (``_prepare_sampling``); the step is kept and None returned, and ``sample_tokens``
        samples it once the engine has filled the bitmask. Otherwise the whole step runs.

        Raises:
            RuntimeError: if a block table does not cover a scheduled token (scheduler bug).
        """
        self._pending_sampling = None   # (a dropped split step's, if any)
        reqs = self._update_states(sched)
        output = ModelRunnerOutput()
        # Block moves before the forward, in this order (see SchedulerOutput): a block freed by a
        # swap-out may be this step's copy destination.
        self._swap_blocks(sched.blocks_to_swap_out, self.kv_caches, self.host_kv_caches)
        self._copy_blocks(sched.blocks_to_copy)
        self._swap_blocks(sched.blocks_to_swap_in, self.host_kv_caches, self.kv_caches)
        if not reqs:
            return output

        query_lens = [r.num_scheduled_tokens for r in reqs]
        context_lens = [r.num_computed_tokens for r in reqs]
        num_tokens = sum(query_lens)
        # Token offsets of each request's chunk in the flattened batch: [0, q0, q0 + q1, ...] (Python
        # ints: after the forward has streamed the weights, numpy's code runs from cold caches).
        starts = [0, *accumulate(query_lens)]
        if len(reqs) <= SMALL_DECODE_SEQS and num_tokens == len(reqs) and all(n == 1 for n in query_lens):
            # A few decodes: one small tensor from lists, input ids then positions (the numpy path
            # below costs more per call).
            ids_pos = torch.tensor([*(r.token_ids[0] for r in reqs), *context_lens], dtype=torch.int64,
                                   device=self.device)
            input_ids, positions = ids_pos[:num_tokens], ids_pos[num_tokens:]
        else:
            input_ids = torch.from_numpy(np.fromiter(
                (t for r in reqs for t in r.token_ids), dtype=np.int64, count=num_tokens)).to(self.device)
            # positions: context_len .. context_len + query_len - 1 for each request, flattened.
            q = np.asarray(query_lens, dtype=np.int64)
            shift = np.repeat(np.asarray(context_lens, dtype=np.int64) - np.asarray(starts[:-1], dtype=np.int64), q)
            positions = torch.from_numpy(np.arange(num_tokens, dtype=np.int64) + shift).to(self.device)
        G = self.num_kv_cache_groups
        if G == 1:
            md = build_attention_metadata(query_lens, context_lens, [r.block_table for r in reqs],
                                          self.block_size, self.device)
        else:   # [hybrid KV cache] one metadata per group of this stage (its table: every G-th id), one per layer
            group_mds = {g: build_attention_metadata(query_lens, context_lens, [r.block_table[g::G] for r in reqs],
                                                     self.block_size, self.device) for g in set(self.layer_groups)}
            md = [group_mds[g] for g in self.layer_groups]
        if self.lora_manager is not None:   # this step's rows per adapter slot
            self.lora_manager.prepare([r.state.lora_request for r in reqs], query_lens)
        # -- pipeline parallelism: a later stage starts from the previous stage's output --
        if self.parallel.is_first_stage:
            inputs_embeds = self._prompt_embeds_input(reqs, starts, input_ids)
            if inputs_embeds is None:
                hidden = self.model(input_ids, positions, self.kv_caches, md)      # [T, H]
            else:
                hidden = self.model(input_ids, positions, self.kv_caches, md, inputs_embeds=inputs_embeds)
        else:
            received = recv_from_prev_stage((num_tokens, self.hidden_size), self.dtype, self.device, self.parallel)
            hidden = self.model(input_ids, positions, self.kv_caches, md, hidden_states=received)
        if not self.parallel.is_last_stage:
            send_to_next_stage(hidden, self.parallel)
            return output

        ends = [e - 1 for e in starts[1:]]                                     # last token index per request
        pending = self._prepare_sampling(sched, reqs, hidden, ends, starts, output)
        if sched.grammar_bitmask_follows:
            self._pending_sampling = pending   # [structured output] sampled by ``sample_tokens``
            return None
        return self._finish_sampling(pending, sched.grammar_bitmask)

    @torch.inference_mode()
    def sample_tokens(self, grammar_bitmask: np.ndarray | None) -> ModelRunnerOutput | None:
        """[structured output] Sample the step whose ``execute_model`` ran with
        ``grammar_bitmask_follows`` (vLLM V1's ``sample_tokens``): its logits, masked with
        ``grammar_bitmask``, through the sampler (then drafts accepted and proposed).

        Args:
            grammar_bitmask: [len(structured_output_request_ids), ceil(vocab_size / 32)] int32,
                the step's bitmask; None drops the step unsampled (the engine's fill failed).
        Returns:
            The step's output (what ``execute_model`` returns on a step without the split), an
            empty output when the step is dropped or this rank samples nothing (a non-last
            pipeline stage, a non-driver rank).
        """
        pending, self._pending_sampling = self._pending_sampling, None
        if pending is None or grammar_bitmask is None:
            return ModelRunnerOutput()
        return self._finish_sampling(pending, grammar_bitmask)

    def _prepare_sampling(self, sched: SchedulerOutput, reqs: list[ScheduledRequest], hidden: torch.Tensor,
                          ends: list[int], starts: list[int], output: ModelRunnerOutput) -> "_PendingSampling":
        """What a step can compute before its grammar bitmask: the sampled rows, the exact greedy
        head's tokens of plain greedy rows, the logits of the rows that take the full head when the
        bitmask cannot change which rows those are (no grammar row takes the greedy head), and the
        prompt logprobs. On every rank of the last stage (the logits and prompt logprobs are
        collectives under tensor parallelism); ``hidden`` is [num_tokens, H]."""
        sample_rows = [i for i, r in enumerate(reqs) if r.sample]
        pending = _PendingSampling(sched, reqs, sample_rows, output)
        if sample_rows:
            pending.states, pending.src, pending.h = self._sampling_rows(reqs, sample_rows, hidden, ends)
            pending.tokens, pending.masked = self._plain_greedy_tokens(sched, pending.states, pending.src, pending.h)
            if not pending.masked:
                self._head_logits(pending)
        self._prompt_logprobs(reqs, hidden, starts, output)
        return pending

    def _finish_sampling(self, pending: "_PendingSampling", grammar_bitmask: np.ndarray | None) -> ModelRunnerOutput:
        """The rest of the step once the bitmask is known: the masked greedy head rows, the full
        head's logits if not computed yet, the sampler (driver rank), drafts accepted and proposed.
        ``grammar_bitmask``: [R, ceil(V / 32)] int32 (R: ``structured_output_request_ids``), or None."""
        sched, reqs, sample_rows, output = pending.sched, pending.reqs, pending.sample_rows, pending.output
        if sample_rows:
            if pending.masked:
                pending.tokens.update(self._masked_greedy_tokens(sched, pending, grammar_bitmask))
                self._head_logits(pending)
            speculative = len(pending.h) > len(sample_rows)
            saved = self._save_seeded_generators(reqs, sample_rows) if speculative and self.is_driver else {}
            self._sample(sched, pending, grammar_bitmask, output)
            if speculative and self.is_driver:
                self._accept_drafts(reqs, sample_rows, output, saved)
        if self.draft is not None and self.is_driver and sample_rows and sched.num_lookahead_tokens:
            self._propose_drafts(sched, reqs, sample_rows, output)
        return output

    def _prompt_embeds_input(self, reqs: list[ScheduledRequest], starts: list[int],
                             input_ids: torch.Tensor) -> torch.Tensor | None:
        """[prompt embeddings] The first layer's input when this step computes prompt positions
        given as embeddings (a prefill chunk of such a request, or its recompute after a
        preemption): ``embed_input_ids(input_ids)`` with those rows replaced by the request's
        ``PromptEmbeds`` rows (cast to the model dtype); None when no scheduled position has one.

        Returns:
            [num_tokens, hidden_size] in the model dtype, or None.
        """
        rows: list[int] = []
        values = []
        for r, start in zip(reqs, starts):
            pe = r.state.prompt_embeds
            if pe is None:
                continue
            first = r.num_computed_tokens
            embedded = pe.embedded_positions(first, first + r.num_scheduled_tokens)
            if embedded:
                rows.extend(start + p - first for p in embedded)
                values.append(pe.embeds[embedded])                            # [len(embedded), H]
        if not rows:
            return None
        embeds = self.model.embed_input_ids(input_ids)                          # [T, H]
        embeds[torch.tensor(rows, dtype=torch.int64, device=self.device)] = \
            torch.cat(values).to(device=self.device, dtype=embeds.dtype)
        return embeds

    def _propose_drafts(self, sched: SchedulerOutput, reqs: list[ScheduledRequest], sample_rows: list[int],
                        output: ModelRunnerOutput) -> None:
        """[draft models] Draft the next step's tokens of each sampled request the scheduler gave
        lookahead slots (``sched.num_lookahead_tokens``) into ``output.draft_token_ids``.

        A request's real tokens are now its known tokens, the accepted drafts and the new token
        (L); the draft computes its K/V from the first position it does not hold
        (``CachedRequestState.draft_valid_prefix``). Drafts are capped so that no K/V is written
        past the request's table (its blocks times ``block_size`` tokens). [hybrid KV cache] The
        draft's pool is indexed by the full-attention group's table (group 0, every
        ``num_kv_cache_groups``-th id: ``resolve_kv_cache_groups`` keeps the hybrid layout with a
        draft model only when there is one), which holds every position; a draft's own sliding
        layers read it through their window. Forks of this step and
        their parents do not draft (they share a partial last block until their copy-on-write);
        no draft position reaches ``max_model_len``.
        """
        from pagedllm.spec_decode.draft_model import DraftInput

        lookahead = sched.num_lookahead_tokens
        forked = {st.req_id for _, st in self.requests.forks} | {parent for parent, _ in self.requests.forks}
        index = {rid: i for i, rid in enumerate(output.req_ids)}
        items: list[DraftInput] = []
        for i in sample_rows:
            r = reqs[i]
            rid = r.request_id
            k = lookahead.get(rid, 0)
            if k <= 0 or rid in forked or rid not in index:
                continue
            st = r.state
            m = output.num_accepted_tokens.get(rid, 0)
            real = st.token_ids + r.spec_token_ids[:m] + [output.sampled_token_ids[index[rid]]]
            table = st.block_ids[::self.num_kv_cache_groups]   # the full group's (the only one without hybrid)
            k = min(k, len(table) * self.block_size - len(real) + 1, self.draft.max_model_len - len(real) + 1)
            if k <= 0:
                continue
            start = min(st.draft_valid_prefix(real), len(real) - 1)
            items.append(DraftInput(rid, real, start, table, k))
        for item, drafts in zip(items, self.draft.propose(items)):
            st = self.requests.requests[item.req_id]
            st.draft_num_computed, st.draft_kv_tokens = len(item.token_ids), drafts[:-1]
            output.draft_token_ids[item.req_id] = drafts

    def _sampling_rows(self, reqs: list[ScheduledRequest], sample_rows: list[int], hidden: torch.Tensor,
                       ends: list[int]) -> tuple[list, list[int], torch.Tensor]:
        """The rows the step samples: one per sampling request (its last position), ``k + 1`` for a
        request verifying ``k`` draft tokens (its last known token's position and each draft's,
        each row seeing the drafts before it as outputs), then one per fork (n > 1 / best_of: the
        parent's row, drawn with the fork's own params and generator).

        Returns:
            (states, src, h): a state per sampled row (``CachedRequestState`` or ``_DraftRow``), the
            row of ``h`` each reads, and ``h`` = [R, H] hidden rows (R <= len(states)).
        """
        states: list = []
        positions: list[int] = []
        last_row: dict[str, int] = {}
        for i in sample_rows:
            r = reqs[i]
            drafts = r.spec_token_ids
            if drafts:
                st = r.state
                generator = self._generator_for(st)
                for j in range(len(drafts) + 1):
                    states.append(_DraftRow(st.req_id, st.sampling_params, st.prompt_token_ids,
                                            st.output_token_ids + drafts[:j], generator))
                positions.extend(range(ends[i] - len(drafts), ends[i] + 1))
            else:
                states.append(r.state)
                positions.append(ends[i])
            last_row[r.request_id] = len(states) - 1
        src = list(range(len(states)))
        for parent, st in self.requests.forks:
            if parent in last_row:
                states.append(st)
                src.append(last_row[parent])
        return states, src, self._sampled_hidden(hidden, positions)

    def _save_seeded_generators(self, reqs: list[ScheduledRequest], sample_rows: list[int]) -> dict:
        """[speculative decoding] The RNG state of each seeded random request verifying drafts,
        before the sampler draws one uniform per row (``_accept_drafts`` rewinds it)."""
        saved = {}
        for i in sample_rows:
            r = reqs[i]
            generator = r.state.generator
            if r.spec_token_ids and generator is not None:
                saved[r.request_id] = (generator, generator.get_state())
        return saved

    def _accept_drafts(self, reqs: list[ScheduledRequest], sample_rows: list[int], output: ModelRunnerOutput,
                       saved: dict) -> None:
        """[speculative decoding] Collapse each verifying request's ``k + 1`` sampled rows into its
        accepted drafts and one more token, in place of ``output``'s per-row lists.

        Row ``j`` drew token ``s_j`` from the target's distribution after the drafts ``d_1..d_j``;
        the drafts are accepted while ``s_j == d_{j+1}``, and the token after them is ``s_m`` (the
        first disagreement, or the bonus token after all ``k``). Drafts are one proposal each
        (n-gram, suffix, greedy draft models: a point-mass draft distribution ``q``), for which
        this is the rejection rule of Leviathan et al. / Chen et al. (2023): the draft is kept
        with probability ``p(d)`` and otherwise the token comes from ``p`` without ``d``,
        renormalised; so every token has the target's distribution, and a greedy request emits
        exactly the argmax tokens it would without drafts. A seeded request's generator is
        rewound to have drawn one uniform per emitted token, as without drafts, so its tokens
        equal those of the same seed without speculation.
        """
        tokens, lps, tops = output.sampled_token_ids, output.sampled_logprobs, output.top_logprobs
        new = ModelRunnerOutput(prompt_logprobs=output.prompt_logprobs)
        row = 0
        for i in sample_rows:
            r = reqs[i]
            drafts = r.spec_token_ids
            m = 0
            while m < len(drafts) and tokens[row + m] == drafts[m]:
                m += 1
            new.req_ids.append(r.request_id)
            new.sampled_token_ids.append(tokens[row + m])
            new.sampled_logprobs.append(lps[row + m])
            new.top_logprobs.append(tops[row + m])
            if drafts:
                new.num_accepted_tokens[r.request_id] = m
                new.accepted_logprobs[r.request_id] = lps[row: row + m]
                new.accepted_top_logprobs[r.request_id] = tops[row: row + m]
                if r.request_id in saved:
                    generator, state = saved[r.request_id]
                    generator.set_state(state)
                    for _ in range(m + 1):
                        torch.rand(1, dtype=torch.float64, device=self.device, generator=generator)
            row += len(drafts) + 1
        # Forks follow the requests' rows, unchanged.
        new.req_ids += output.req_ids[row:]
        new.sampled_token_ids += tokens[row:]
        new.sampled_logprobs += lps[row:]
        new.top_logprobs += tops[row:]
        output.__dict__.update(new.__dict__)

    def _sampled_hidden(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``hidden[rows]`` ([len(rows), H]); ``hidden`` itself when the rows are all of its rows
        (``rows`` is increasing: a decode-only step where every request samples)."""
        if len(rows) == hidden.shape[0]:
            return hidden
        return hidden[torch.tensor(rows, dtype=torch.int64, device=self.device)]

    def _sample_logits(self, states: list, logits: torch.Tensor, output: ModelRunnerOutput,
                       grammar_rows: dict[str, int], grammar_bitmask: np.ndarray | None) -> None:
        """Grammar masks, then the sampler, on ``logits`` [len(states), V] in the model dtype (one
        row per state, batch order; the sampler widens them to float32 unless every row is plain
        greedy); fills the output's per-request lists. ``grammar_rows``: the constrained requests
        among ``states`` (request id -> row of ``grammar_bitmask``, [R, ceil(V / 32)] int32)."""
        if grammar_bitmask is not None and grammar_rows:  # [structured output] grammar masks (forks: own rows), one call
            apply_step_bitmask(logits, [st.req_id for st in states], grammar_rows, grammar_bitmask)
        metadata = SamplingMetadata.build(
            [st.sampling_params for st in states],
            [st.output_token_ids for st in states],
            [st.prompt_token_ids for st in states],
            [self._generator_for(st) for st in states],
            logits.shape[-1], self.device, default_generator=self.default_generator,
            watermark=self.watermark)
        processors = self.batch_logits_processors
        if processors is not None:   # the batch they see: these rows, in this order
            processors.update([(st.req_id, st.sampling_params, st.prompt_token_ids, st.output_token_ids)
                               for st in states])
            if processors.v2 is not None:   # Model Runner V2: the rows' slots and lengths
                processors.v2.prepare(states)
        sampled = self.sampler(logits, metadata, processors)
        output.req_ids = [st.req_id for st in states]
        output.sampled_token_ids = sampled.sampled_token_ids.tolist()
        output.sampled_logprobs = sampled.sampled_logprobs.tolist()
        output.top_logprobs = self._top_logprobs(states, sampled)

    def _head_logits(self, pending: "_PendingSampling") -> None:
        """The full head (``compute_logits``) over the rows the exact greedy head left
        (``pending.tokens``): once per distinct hidden row (forks read their parent's logits), into
        ``pending.rest`` (state indices; None: every state), ``pending.logits`` ([U, V], the model
        dtype; None when no row is left) and ``pending.index`` (each rest state's logits row, or
        None when they are in order). On the other ranks of the last stage this only joins the
        logits' gather."""
        states, src, h, tokens = pending.states, pending.src, pending.h, pending.tokens
        if not tokens:   # every row: h holds one row per state before the forks, in order
            pending.rest = None
            pending.logits = self.model.compute_logits(h)                           # [R, V]
            pending.index = src if len(src) > h.shape[0] else None                  # forks read their parent's row
            return
        pending.rest = [k for k in range(len(states)) if k not in tokens]
        rest_src = [src[k] for k in pending.rest]
        if rest_src:
            rows = sorted(set(rest_src))
            pending.logits = self.model.compute_logits(h[torch.as_tensor(rows, device=self.device)])
            at = {r: j for j, r in enumerate(rows)}
            pending.index = [at[r] for r in rest_src] if len(rest_src) > len(rows) or rows != rest_src else None

    def _sample(self, sched: SchedulerOutput, pending: "_PendingSampling", grammar_bitmask: np.ndarray | None,
                output: ModelRunnerOutput) -> None:
        """The step's one sampling path, on the rows ``_sampling_rows`` returned and the logits
        ``_head_logits`` computed; fills the output's per-request lists in the states' order
        (driver rank only; the other ranks only joined the logits' gather).

        With the exact greedy head (driver rank, one tensor rank), plain greedy rows take its
        tokens (``_plain_greedy_tokens``, ``_masked_greedy_tokens``): their ``sampled_logprobs``
        entry is NaN (not asked for, as the sampler gives such rows) and their ``top_logprobs``
        None. Every other row, and the head's fallback rows, go through the full head and the
        sampler.
        """
        if not self.is_driver:
            return
        states, tokens, rest, logits = pending.states, pending.tokens, pending.rest, pending.logits
        if pending.index is not None:
            logits = logits.index_select(0, torch.as_tensor(pending.index, device=self.device))
        if rest is None:
            self._sample_logits(states, logits, output, sched.structured_output_request_ids, grammar_bitmask)
            return
        sub = ModelRunnerOutput()
        if rest:
            rest_ids = {states[k].req_id for k in rest}
            grammar_rows = {rid: row for rid, row in sched.structured_output_request_ids.items() if rid in rest_ids}
            self._sample_logits([states[k] for k in rest], logits, sub, grammar_rows, grammar_bitmask)
        pos = {k: j for j, k in enumerate(rest)}
        order = range(len(states))
        output.req_ids = [st.req_id for st in states]
        output.sampled_token_ids = [tokens[k] if k in tokens else sub.sampled_token_ids[pos[k]] for k in order]
        output.sampled_logprobs = [math.nan if k in tokens else sub.sampled_logprobs[pos[k]] for k in order]
        output.top_logprobs = [None if k in tokens else sub.top_logprobs[pos[k]] for k in order]

    def _plain_greedy_tokens(self, sched: SchedulerOutput, states: list, src: list[int],
                             h: torch.Tensor) -> tuple[dict[int, int], list[int]]:
        """The exact greedy head's tokens (``sample/greedy_head.py``), state index -> token id, for
        the plain greedy states (``sample.metadata.is_plain_greedy``, no grammar) when at most
        ``greedy_head.max_rows`` distinct rows of them sample this step (fallback rows left
        out), and the greedy states whose only edit is their grammar's mask, for
        ``_masked_greedy_tokens`` once the bitmask is known (none when more than ``max_rows``).
        Nothing without the head (not the driver rank), or with class-based logits processors
        that can change an argmax. ``h``: [R, H] hidden rows, ``src[k]`` state ``k``'s row."""
        head = self.greedy_head
        processors = self.batch_logits_processors
        if head is None or not self.is_driver or (processors is not None and processors.changes_argmax):
            return {}, []
        grammar_rows = sched.structured_output_request_ids
        has_bitmask = sched.grammar_bitmask is not None or sched.grammar_bitmask_follows
        plain, masked = [], []
        for k, st in enumerate(states):
            if is_plain_greedy(st.sampling_params, st.output_token_ids):
                if st.sampling_params.structured_outputs is None and st.req_id not in grammar_rows:
                    plain.append(k)
                elif st.req_id in grammar_rows and has_bitmask:
                    masked.append(k)
        tokens: dict[int, int] = {}
        plain_rows = sorted({src[k] for k in plain})
        if plain and len(plain_rows) <= head.max_rows:
            ids, fallback = head.argmax(h[torch.as_tensor(plain_rows, device=self.device)])
            got = {r: int(t) for r, t, fb in zip(plain_rows, ids.tolist(), fallback.tolist()) if not fb}
            tokens = {k: got[src[k]] for k in plain if src[k] in got}
        return tokens, (masked if len(masked) <= head.max_rows else [])

    def _masked_greedy_tokens(self, sched: SchedulerOutput, pending: "_PendingSampling",
                              grammar_bitmask: np.ndarray) -> dict[int, int]:
        """The exact greedy head's tokens of ``pending.masked`` (greedy grammar states, one row per
        state: forks have their own masks): the exact argmax over the tokens ``grammar_bitmask``
        ([R, ceil(V / 32)] int32) allows; fallback rows left out."""
        states, src, h, masked = pending.states, pending.src, pending.h, pending.masked
        grammar_rows = sched.structured_output_request_ids
        head = self.greedy_head
        forbidden = forbidden_tokens(grammar_bitmask[[grammar_rows[states[k].req_id] for k in masked]],
                                     head.vocab_size, self.device)
        ids, fallback = head.argmax(h[torch.as_tensor([src[k] for k in masked], device=self.device)], forbidden)
        return {k: int(t) for k, t, fb in zip(masked, ids.tolist(), fallback.tolist()) if not fb}

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

    def _prompt_logprobs(self, reqs: list[ScheduledRequest], hidden: torch.Tensor, starts: list[int],
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
            if not self.is_driver:  # joined the logits' all-gather only
                continue
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

    def _swap_blocks(self, pairs: list[tuple[int, int]], src_caches, dst_caches) -> None:
        """Swap preemption: copy block ``src`` of ``src_caches`` to block ``dst`` of ``dst_caches``
        (device -> host pool, or back), one batched index copy per layer and K/V.

        Raises:
            RuntimeError: if blocks are to be swapped but no host pool was allocated.
        """
        if not pairs:
            return
        if not src_caches or not dst_caches:
            raise RuntimeError(f"{len(pairs)} blocks to swap but no host KV pool (preemption_mode is not 'swap')")
        src_dev, dst_dev = src_caches[0][0].device, dst_caches[0][0].device
        src = torch.as_tensor([p[0] for p in pairs], device=src_dev)
        dst = torch.as_tensor([p[1] for p in pairs], device=dst_dev)
        for (k_src, v_src), (k_dst, v_dst) in zip(src_caches, dst_caches):
            k_dst[dst] = k_src[src].to(dst_dev)
            v_dst[dst] = v_src[src].to(dst_dev)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy physical block src to dst in every layer's K and V pool, the draft
        model's too (one batched index copy each; every source is read before any destination
        is written)."""
        if not pairs:
            return
        src = torch.as_tensor([p[0] for p in pairs], device=self.device)
        dst = torch.as_tensor([p[1] for p in pairs], device=self.device)
        draft_caches = self.draft.kv_caches if self.draft is not None else []
        # Layers of different groups share tensors (hybrid KV cache): copy each tensor once.
        unique = {id(k): (k, v) for k, v in [*self.kv_caches, *draft_caches]}
        for k_cache, v_cache in unique.values():
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]
