"""Batch-level logits processors with vLLM V1's interface (``vllm.v1.sample.logits_processor``).

A class-based processor sees the whole batch: the engine builds one instance per class on the
sampling worker (``cls(vllm_config, device, is_pin_memory)``), tells it before every step which
requests joined, left or moved within the batch (``update_state(BatchUpdate)``; row ``i`` of the
step's logits is batch index ``i``), and calls ``apply(logits)`` on the ``[num_rows, vocab]``
float32 logits. Requests pass their own arguments through ``SamplingParams.extra_args``.
``is_argmax_invariant()`` says where it runs: False (it can change a greedy pick) with the
masks and bias, before the penalties; True after temperature, on random rows' logits only (greedy
rows ignore it), as vLLM's sampler orders them. The per-request callables of
``SamplingParams.logits_processors`` stay as they are; ``AdapterLogitsProcessor`` wraps that
style into a class.

No torch at import time is not a goal here (the worker imports this); plain data and callables.
"""

from __future__ import annotations


import enum
import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from pagedllm.config import VllmConfig
from pagedllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as V2LogitsProcessor

if TYPE_CHECKING:
    import torch

    from pagedllm.sampling_params import SamplingParams


class MoveDirectionality(enum.Enum):
    """How a ``BatchUpdate.moved`` entry moves requests between batch indices."""

    UNIDIRECTIONAL = enum.auto()   # (a, b): the request at a now sits at b; a is empty
    SWAP = enum.auto()             # (a, b): the requests at a and b trade places


# A batch index that lost its request this step.
RemovedRequest = int
# (batch index, params, prompt token ids, output token ids): a request that joined the batch; the
# output list is the request's live list (it grows as tokens are generated).
AddedRequest = tuple[int, "SamplingParams", "list[int] | None", "list[int]"]
# (index a, index b, directionality).
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """The change of the sampling batch since the previous step (vLLM's ``BatchUpdate``).

    Apply in the order removed, added, moved. An added index never equals a removed one; a move's
    destination may be a removed index.

    Attributes:
        batch_size: rows of this step's logits.
        removed: indices whose requests left.
        added: requests that joined, at their indices.
        moved: moves and swaps, in order.
    """

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """vLLM V1's batch-level logits processor interface (see the module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: "SamplingParams") -> None:
        """Check a request's params (its ``extra_args``) when it is added, in the caller's thread.

        Raises:
            ValueError: for params this processor cannot serve (the request is refused).
        """
        return None

    @abstractmethod
    def __init__(self, vllm_config: VllmConfig, device: "torch.device", is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: "torch.Tensor") -> "torch.Tensor":
        """Process ``logits`` [batch_size, vocab_size] float32 (may modify it in place) and return it."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when ``apply`` never changes any row's argmax (then greedy rows skip it)."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every step's ``apply``; ``batch_update`` is None when the batch did not
        change (the output lists of the requests may still have grown)."""
        raise NotImplementedError


T = TypeVar("T")


def process_dict_updates(req_entries: dict[int, T], batch_update: BatchUpdate | None,
                         new_state: Callable[["SamplingParams", "list[int] | None", "list[int]"], T | None]) -> bool:
    """Keep a processor's ``{batch index: state}`` dict in step with ``batch_update`` (vLLM's
    helper for processors that act on a few rows).

    Args:
        req_entries: updated in place.
        batch_update: the step's change, or None (nothing to do).
        new_state: ``(params, prompt_ids, output_ids) -> state`` for an added request; None
            means the processor ignores that request.
    Returns:
        True when ``req_entries`` changed.
    """
    if not batch_update:
        return False
    changed = False
    for index in batch_update.removed:
        if req_entries.pop(index, None) is not None:
            changed = True
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[index] = state
            changed = True
        elif req_entries.pop(index, None) is not None:
            changed = True
    for a, b, direction in batch_update.moved:
        entry_a, entry_b = req_entries.pop(a, None), req_entries.pop(b, None)
        if entry_a is not None:
            req_entries[b] = entry_a
            changed = True
        if entry_b is not None:
            changed = True
            if direction == MoveDirectionality.SWAP:
                req_entries[a] = entry_b
    return changed


# A per-request logits function: (output_ids, row) -> row, or (prompt_ids, output_ids, row) -> row;
# row: [vocab_size] float32.
RequestLogitsProcessor = Callable[..., Any]


class AdapterLogitsProcessor(LogitsProcessor):
    """A batch processor made of per-request functions (vLLM's ``AdapterLogitsProcessor``):
    subclass it, define ``new_req_logits_processor(params)`` (a function for that request, or
    None) and ``is_argmax_invariant``; ``apply`` runs each request's function on its row."""

    def __init__(self, vllm_config: VllmConfig, device: "torch.device", is_pin_memory: bool) -> None:
        self.req_info: dict[int, Callable[[Any], Any]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: "SamplingParams") -> RequestLogitsProcessor | None:
        """The request's function (2 or 3 arguments, see ``RequestLogitsProcessor``), or None."""
        raise NotImplementedError

    def _new_state(self, params, prompt_ids, output_ids):
        fn = self.new_req_logits_processor(params)
        if fn is None:
            return None
        takes_prompt = len(inspect.signature(fn).parameters) == 3
        return partial(fn, prompt_ids, output_ids) if takes_prompt else partial(fn, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: "torch.Tensor") -> "torch.Tensor":
        for index, fn in self.req_info.items():
            logits[index] = fn(logits[index])
        return logits


def resolve_logits_processor_classes(entries: Iterable[Any] | None) -> list[type[LogitsProcessor]]:
    """The ``logits_processors`` engine argument -> classes.

    Args:
        entries: ``LogitsProcessor`` subclasses (V1's here, or Model Runner V2's,
            ``v1.worker.gpu.sample.logits_processor``), or their names (``"pkg.module:Class"`` or
            ``"pkg.module.Class"``, imported here).
    Raises:
        ValueError: naming ``logits_processors``, for a name that does not import or an entry
            that is not a ``LogitsProcessor`` subclass.
    """
    classes = []
    for entry in entries or ():
        cls = entry
        if isinstance(entry, str):
            module, sep, name = entry.partition(":") if ":" in entry else entry.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module), name) if sep and module else None
            except (ImportError, AttributeError) as e:
                raise ValueError(f"logits_processors: cannot import {entry!r}: {e}") from e
        if not (isinstance(cls, type) and issubclass(cls, (LogitsProcessor, V2LogitsProcessor))):
            raise ValueError(f"logits_processors entries must be LogitsProcessor subclasses (vLLM V1's or Model "
                             f"Runner V2's) or their 'module:Class' names, got {entry!r}")
        classes.append(cls)
    return classes
