"""One generation request as the scheduler sees it: token ids, progress, status, timings.

The status ordering follows vLLM V1 (``vllm/v1/request.py``): every finished status compares
greater than ``PREEMPTED``, so ``is_finished`` is one comparison. No torch here.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any, Protocol

from pagedllm.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a request stopped, as the OpenAI API spells it."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestStatus(enum.IntEnum):
    """Where a request is in its lifecycle.

    WAITING -> RUNNING -> (PREEMPTED -> RUNNING)* -> FINISHED_*. A PREEMPTED request sits in the
    waiting queue with no KV blocks and is recomputed from scratch when readmitted. A request
    with a grammar starts as WAITING_FOR_FSM (vLLM's name) while the grammar compiles; it waits
    in the queue without holding back the requests behind it, then becomes WAITING.
    """

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished status.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        """True for the FINISHED_* statuses."""
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> str | None:
        """"stop", "length" or "abort" for a finished status, ``None`` otherwise."""
        reason = _FINISHED_REASONS.get(status)
        return None if reason is None else reason.value


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(frozen=True, eq=False)
class PromptEmbeds:
    """Prompt positions given as embeddings (vLLM's ``prompt_embeds``); the tensor is opaque here.

    The request's ``prompt_token_ids`` keep a placeholder id (0, as vLLM) at each such position for
    the bookkeeping; the model runner feeds these rows to the first layer instead of embedding the
    ids (``worker/model_runner.py``), on every (re)computation of the prompt.

    Attributes:
        embeds: [num_prompt_tokens, hidden_size] CPU tensor, floating point: what the model's input
            embedding layer would output (for Gemma 3, already times sqrt(hidden_size)).
        is_token_ids: per prompt position, True where the token id is real (a chat prompt with
            ``prompt_embeds`` content parts), or None: every position comes from ``embeds``.
        digest: hex SHA-256 of the tensor's dtype, shape and bytes and of ``is_token_ids``: part of
            the prefix-cache key, so blocks are shared only between equal embeddings.
    """

    embeds: Any
    is_token_ids: list[bool] | None
    digest: str

    def embedded_positions(self, start: int, end: int) -> list[int]:
        """Prompt positions in ``[start, end)`` that take their row of ``embeds``."""
        end = min(end, len(self.embeds))
        if self.is_token_ids is None:
            return list(range(start, end))
        return [p for p in range(start, end) if not self.is_token_ids[p]]


class StructuredOutputHandle(Protocol):
    """What the scheduler may ask of a request's grammar state (``structured_output.request``
    implements it; core only calls these methods and never imports the grammar engine)."""

    def is_ready(self) -> bool:
        """True once the grammar compile has ended (compiled, or failed: see ``error``)."""

    @property
    def error(self) -> str | None:
        """Why the grammar failed to compile, or None."""

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance the matcher; False if the grammar rejects a token."""

    def is_terminated(self) -> bool:
        """True when the grammar allows nothing more (the request then stops)."""


class Request:
    """A prompt, the tokens generated for it so far, and its scheduling state.

    Attributes:
        request_id: unique id (the engine's).
        prompt_token_ids: the prompt, >= 1 token; never mutated.
        output_token_ids: generated tokens, appended by ``append_output_token_ids``.
        sampling_params: how to sample (the scheduler reads ``min_tokens`` and
            ``all_stop_token_ids``).
        max_tokens: most tokens to generate, already resolved by the engine (>= 1).
        arrival_time: ``time.monotonic()`` seconds when the request arrived.
        status: a ``RequestStatus``.
        num_computed_tokens: tokens (prompt then outputs) whose K/V is in the cache, counting the
            tokens scheduled for the step in flight (the scheduler advances it in ``schedule()``).
        num_preemptions: times this request was preempted (recompute).
        stop_reason: the stop token id that finished the request, if any.
        cumulative_logprob: sum of the sampled tokens' log-probabilities (natural log).
        first_scheduled_time: ``time.monotonic()`` seconds of the first schedule, or ``None``.
        first_token_time: ``time.monotonic()`` seconds of the first generated token, or ``None``
            (TTFT = first_token_time - arrival_time).
        block_hashes: chained hashes of the request's full blocks (``kv_cache_utils``), filled
            incrementally by the ``KVCacheManager`` as blocks fill.
        num_cached_tokens: prompt tokens found in the prefix cache at the first admission (vLLM's
            name); the model ran ``num_prompt_tokens - num_cached_tokens`` of them then.
        structured_output_request: the request's grammar state (an opaque
            ``StructuredOutputHandle``), or None for an unconstrained request. Its matcher lives
            and dies with this object: nothing else keeps it.
        paused: not scheduled while True (beam search holds a beam between rounds).
        group_id: beam search: the id shared by the beams of one prompt, else None.
        group_width: seats of ``max_num_seqs`` the group takes as soon as one of its beams runs
            (the beam width: its beams fork up to it between steps); 1 without a group.
        lora_request: the LoRA adapter it runs with (``lora.request.LoRARequest``, plain data), or
            None for the base model.
        prompt_embeds: the prompt's embeddings (``PromptEmbeds``), kept for a recompute after
            preemption, or None for a token prompt.
    Raises:
        ValueError: for an empty prompt or ``max_tokens < 1``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        arrival_time: float | None = None,
        structured_output_request: StructuredOutputHandle | None = None,
        lora_request=None,
        prompt_embeds: PromptEmbeds | None = None,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"prompt_token_ids must not be empty (request {request_id!r})")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # prompt + outputs, kept in step with output_token_ids so slicing a chunk is O(chunk).
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.structured_output_request = structured_output_request
        self.status = (RequestStatus.WAITING if structured_output_request is None
                       else RequestStatus.WAITING_FOR_FSM)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # Prompt-logprob bookkeeping, so a recomputed prompt does not deliver them twice:
        # entries delivered to the caller, and entries the runner produced since (re)admission.
        self.num_prompt_logprobs_delivered = 0
        self.num_prompt_logprobs_seen = 0
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = 0
        # Beam search: a beam that reported its step's candidates waits (is not scheduled) until
        # the other beams of its prompt have reported too.
        self.paused = False
        self.group_id: str | None = None
        self.group_width = 1
        self.lora_request = lora_request
        self.prompt_embeds = prompt_embeds

    @property
    def block_hash_extra_keys(self) -> tuple | None:
        """What the K/V depends on besides the tokens (``kv_cache_utils.hash_block_tokens``): the
        adapter, so two adapters never share KV for the same prompt, and the prompt embeddings'
        digest, so placeholder ids never match another prompt's blocks; None for a plain prompt
        on the base model."""
        keys = ()
        if self.lora_request is not None:
            lora = self.lora_request
            keys += ("lora", lora.lora_int_id, lora.lora_path)
        if self.prompt_embeds is not None:
            keys += ("prompt_embeds", self.prompt_embeds.digest)
        return keys or None

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs (a shared list: read-only for callers)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        """True once the request has a FINISHED_* status."""
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        """"stop", "length", "abort", or ``None`` while unfinished."""
        return RequestStatus.get_finished_reason(self.status)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Append generated token(s) to ``output_token_ids`` and ``all_token_ids``.

        Sets ``first_token_time`` on the first generated token.
        """
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if not token_ids:
            return
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (f"Request(id={self.request_id!r}, status={self.status.name}, "
                f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")
