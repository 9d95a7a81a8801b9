"""vLLM's Model Runner V2 logits-processor interface (``vllm.v1.worker.gpu.sample.logits_processor``):
``LogitsProcessor``, ``LogitsProcRequestState`` (the per-slot token history a processor reads) and
``LogitsContext`` (one step's batch layout).

Import-light, as vLLM's: the engine process imports processor classes only to run their
``validate_params`` at admission, so torch and numpy appear only under ``TYPE_CHECKING``. The
sampling worker's side (slots, buffers, the call in the sampler) is
``pagedllm/sample/v2_logits_processors.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pagedllm.config import VllmConfig
    from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class LogitsProcRequestState:
    """The worker's per-slot request buffers, shared read-only with every processor.

    The buffers are updated in place each step before ``apply`` (a processor keeps this object
    and reads current values). Each buffer has ``.gpu`` (the device tensor) and ``.np`` (its host
    numpy copy; on the CPU the same memory).

    Attributes:
        device: the device the logits and ``.gpu`` tensors are on.
        max_num_reqs: request slots (the engine's ``max_num_seqs``).
        vocab_size: logits columns.
        all_token_ids: [max_num_reqs, max_model_len] int32: each slot's committed tokens (prompt,
            then outputs), valid up to ``total_len``; the rest is stale.
        prompt_len: [max_num_reqs] int32, tokens of the request's prompt.
        prefill_len: [max_num_reqs] int32, tokens at the slot's last (re)fill: the prompt, or
            prompt + outputs so far for a request resumed after preemption.
        total_len: [max_num_reqs] int32, prompt + outputs so far (grows each step).
    """

    device: "torch.device"
    max_num_reqs: int
    vocab_size: int
    all_token_ids: Any
    prompt_len: Any
    prefill_len: Any
    total_len: Any


@dataclass(frozen=True)
class LogitsContext:
    """One step's batch layout, given to every ``apply``.

    A row is a logits row. Without speculative decoding (the only mode pagedllm runs processors
    in: ``speculative_config`` refuses class-based processors) rows are the step's sampling
    requests, one each, so ``expanded_idx_mapping`` equals ``idx_mapping``.

    Attributes:
        expanded_idx_mapping: [num_logits_rows] int32, device: row -> request slot.
        idx_mapping: [num_reqs] int32, device: batch position -> request slot.
        idx_mapping_np: [num_reqs] int32 numpy, the same on the host.
        expanded_local_pos: [num_logits_rows] int32, device: the row's offset among its
            request's rows (0 here).
        input_ids: [num_logits_rows] int32, device: the token fed at each row's position.
        pos: [num_logits_rows] int32, device: that position (0-based).
        seq_lens_upper_bound_np: [num_reqs] int32 numpy: tokens visible to the token sampled
            this step (``pos + 1``; exact without speculative decoding).
    """

    expanded_idx_mapping: "torch.Tensor"
    idx_mapping: "torch.Tensor"
    idx_mapping_np: "np.ndarray"
    expanded_local_pos: "torch.Tensor"
    input_ids: "torch.Tensor"
    pos: "torch.Tensor"
    seq_lens_upper_bound_np: "np.ndarray"


class LogitsProcessor(ABC):
    """A Model Runner V2 logits processor (``LLM(logits_processors=[MyProc])``; V1 classes may
    be in the same list).

    Per-request state is kept by request slot (``req_idx`` in [0, max_num_reqs)); slots are
    recycled through a free list, so ``add_request`` must (re)initialize all of a slot's state.
    ``apply`` runs on every step's whole batch after the masks (allowed tokens, bad words,
    ``min_tokens``, grammar), ``logit_bias``, per-request processors, V1 processors that can
    change an argmax and the penalties; before temperature, min_p, top-k and top-p (it sees
    unscaled logits, and must not raise a masked token from -inf).
    """

    def __init__(self, vllm_config: "VllmConfig", req_states: LogitsProcRequestState) -> None:  # noqa: B027
        """Built once on the sampling worker; keep what stays constant (``req_states`` is
        read-only)."""

    @classmethod
    def validate_params(cls, sampling_params: "SamplingParams") -> None:  # noqa: B027
        """Check a request's arguments (``extra_args``) at admission, in the engine process.

        Raises:
            ValueError: the request is refused with this message (HTTP 400 in the server).
        """

    def add_request(self, req_idx: int, sampling_params: "SamplingParams") -> bool:
        """A request took slot ``req_idx`` (new, or resumed after preemption): overwrite the
        slot's state. Returns whether this processor edits the request's logits."""
        return True

    def apply_staged_writes(self) -> None:  # noqa: B027
        """Once per step after the worker flushed ``req_states``, before ``apply``: flush
        host-side writes staged by ``add_request``."""

    @abstractmethod
    def apply(self, logits: "torch.Tensor", ctx: LogitsContext) -> "torch.Tensor":
        """Edit the step's logits (in place preferred) or return a new tensor.

        Args:
            logits: [num_logits_rows, vocab_size] float32, rows of requests this processor
                declined included (filter with ``ctx.idx_mapping_np``).
            ctx: the step's layout.
        Returns:
            [num_logits_rows, vocab_size] float32.
        """
        raise NotImplementedError
