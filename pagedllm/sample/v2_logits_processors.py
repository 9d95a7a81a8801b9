"""The sampling worker's side of vLLM's Model Runner V2 logits processors
(``pagedllm.v1.worker.gpu.sample.logits_processor``): request slots, the per-slot token buffers,
each step's ``LogitsContext`` and the ``apply`` call the sampler makes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from pagedllm.utils.torch_utils import async_tensor_h2d
from pagedllm.v1.worker.gpu.sample.logits_processor.interface import (
    LogitsContext,
    LogitsProcessor,
    LogitsProcRequestState,
)

if TYPE_CHECKING:
    from pagedllm.config import VllmConfig
    from pagedllm.core.sched_output import SchedulerOutput
    from pagedllm.worker.request_states import CachedRequestState


class SlotBuffer:
    """An int32 host array and its device tensor (what vLLM's staged / UVA buffers offer a
    processor: ``.np`` and ``.gpu``). On the CPU both are one memory; on CUDA the rows written
    since the last ``flush`` are copied (non-blocking, from pinned memory).

    Args:
        shape: the buffer's shape (the first dimension is the request slot).
        device: where ``.gpu`` lives.
    """

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=torch.int32, pin_memory=on_cuda)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(shape, dtype=torch.int32, device=device) if on_cuda else self.cpu
        self._dirty: set[int] = set()

    def mark(self, slot: int) -> None:
        """Row ``slot`` of ``.np`` changed (copied at the next ``flush``)."""
        if self.gpu is not self.cpu:
            self._dirty.add(slot)

    def flush(self) -> None:
        """Copy the changed rows to ``.gpu``."""
        for slot in self._dirty:
            self.gpu[slot].copy_(self.cpu[slot], non_blocking=True)
        self._dirty.clear()


class V2LogitsProcessors:
    """The V2 processor instances of one sampling worker and the request slots they key on.

    A request takes the lowest free slot when it first reaches the worker or resumes after a
    preemption (``add_request`` on every processor, ``prefill_len`` = its tokens then) and gives
    it back when it finishes or is preempted. Each step ``update_slots`` appends the tokens the
    worker learnt to ``all_token_ids`` (so a slot holds prompt + outputs so far) and ``prepare``
    builds the ``LogitsContext`` of the step's sampled rows (rows = requests: processors never run
    with speculative decoding).

    Args:
        processors: built processors, in the order they run.
        req_states: the buffers they were built with.
    """

    def __init__(self, processors: Sequence[LogitsProcessor], req_states: LogitsProcRequestState) -> None:
        self.processors = list(processors)
        self.req_states = req_states
        self.slots: dict[str, int] = {}                  # request id -> slot
        self._free = list(range(req_states.max_num_reqs - 1, -1, -1))   # pop() gives the lowest
        self._ctx: LogitsContext | None = None

    @classmethod
    def build(cls, classes: Sequence[type[LogitsProcessor]], vllm_config: "VllmConfig", device: torch.device,
              max_num_reqs: int, max_model_len: int, vocab_size: int) -> "V2LogitsProcessors":
        """Allocate the buffers and build ``cls(vllm_config, req_states)`` for each class.

        The token buffer takes ``max_num_reqs * max_model_len * 4`` bytes (int32) on the host,
        and as much again on a CUDA device (256 slots x 4096 tokens: 4 MiB); the three length
        buffers ``max_num_reqs * 4`` bytes each.
        """
        states = LogitsProcRequestState(
            device=device, max_num_reqs=max_num_reqs, vocab_size=vocab_size,
            all_token_ids=SlotBuffer((max_num_reqs, max_model_len), device),
            prompt_len=SlotBuffer((max_num_reqs,), device), prefill_len=SlotBuffer((max_num_reqs,), device),
            total_len=SlotBuffer((max_num_reqs,), device))
        return cls([c(vllm_config, states) for c in classes], states)

    def _buffers(self) -> tuple[SlotBuffer, ...]:
        rs = self.req_states
        return rs.all_token_ids, rs.prompt_len, rs.prefill_len, rs.total_len

    def _assign(self, state: "CachedRequestState") -> None:
        if not self._free:
            raise RuntimeError(f"no free logits-processor slot for request {state.req_id!r}: "
                               f"{len(self.slots)} of {self.req_states.max_num_reqs} held")
        slot = self._free.pop()
        self.slots[state.req_id] = slot
        rs = self.req_states
        rs.prompt_len.np[slot] = len(state.prompt_token_ids)
        rs.prefill_len.np[slot] = len(state.token_ids)
        rs.total_len.np[slot] = 0
        for buf in (rs.prompt_len, rs.prefill_len):
            buf.mark(slot)
        for proc in self.processors:
            proc.add_request(slot, state.sampling_params)

    def _release(self, req_id: str) -> None:
        slot = self.slots.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)
            self._free.sort(reverse=True)

    def update_slots(self, sched: "SchedulerOutput", requests: dict[str, "CachedRequestState"]) -> None:
        """Apply one step's message (after the worker's request states took it): free the slots
        of finished and preempted requests, give slots to new and resumed ones, append each
        scheduled request's new tokens, flush the buffers, then ``apply_staged_writes``.

        Raises:
            RuntimeError: if more requests than ``max_num_reqs`` need slots, or a request holds
                more tokens than ``max_model_len``.
        """
        for req_id in list(sched.finished_req_ids) + list(sched.preempted_req_ids):
            self._release(req_id)
        for cached in sched.scheduled_cached_reqs:
            if cached.resumed_from_preemption:
                self._release(cached.req_id)             # refilled: a fresh slot, prefill_len anew
        for req_id in sched.num_scheduled_tokens:
            self._sync(requests[req_id])
        self._flush()

    def _sync(self, state: "CachedRequestState") -> None:
        """Give ``state`` a slot if it has none, and append the tokens its slot lacks."""
        if state.req_id not in self.slots:
            self._assign(state)
        slot = self.slots[state.req_id]
        tokens, total = self.req_states.all_token_ids, self.req_states.total_len
        start, end = int(total.np[slot]), len(state.token_ids)
        if end > tokens.np.shape[1]:
            raise RuntimeError(f"request {state.req_id!r} holds {end} tokens, over the buffer's {tokens.np.shape[1]}")
        if end > start:
            tokens.np[slot, start:end] = state.token_ids[start:end]
            total.np[slot] = end
            tokens.mark(slot)
            total.mark(slot)

    def _flush(self) -> None:
        for buf in self._buffers():
            buf.flush()
        for proc in self.processors:
            proc.apply_staged_writes()

    def prepare(self, states: Sequence["CachedRequestState"]) -> LogitsContext:
        """The ``LogitsContext`` of this step's sampled rows (row ``i`` = ``states[i]``, whose
        tokens ``update_slots`` normally holds already), kept for ``apply``.

        Raises:
            RuntimeError: as ``update_slots``, for a row that needs a slot or tokens.
        """
        if any(st.req_id not in self.slots or self.req_states.total_len.np[self.slots[st.req_id]] != len(st.token_ids)
               for st in states):   # a row the step's message did not schedule (a fork sampling its parent's row)
            for st in states:
                self._sync(st)
            self._flush()
        device = self.req_states.device
        idx = np.fromiter((self.slots[st.req_id] for st in states), dtype=np.int32, count=len(states))
        seq_lens = np.fromiter((len(st.token_ids) for st in states), dtype=np.int32, count=len(states))
        last = np.fromiter((st.token_ids[-1] for st in states), dtype=np.int32, count=len(states))
        idx_t = async_tensor_h2d(idx, device)
        self._ctx = LogitsContext(
            expanded_idx_mapping=idx_t, idx_mapping=idx_t, idx_mapping_np=idx,
            expanded_local_pos=torch.zeros(len(states), dtype=torch.int32, device=device),
            input_ids=async_tensor_h2d(last, device), pos=async_tensor_h2d(seq_lens - 1, device),
            seq_lens_upper_bound_np=seq_lens)
        return self._ctx

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] float32 -> every processor's ``apply`` in order, with ``prepare``'s context.

        Raises:
            RuntimeError: if ``prepare`` was not called for these rows.
        """
        ctx = self._ctx
        if ctx is None or ctx.idx_mapping_np.shape[0] != logits.shape[0]:
            raise RuntimeError(f"logits have {logits.shape[0]} rows but the step's context was prepared for "
                               f"{None if ctx is None else ctx.idx_mapping_np.shape[0]}")
        for proc in self.processors:
            logits = proc.apply(logits, ctx)
        return logits
