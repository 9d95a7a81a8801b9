"""The class-based logits processors of one sampling worker, and the batch they see: each step's
sampled rows become vLLM's persistent-batch updates (``BatchUpdate``: removed, added, moved)."""

from __future__ import annotations

from typing import Sequence

import torch

from pagedllm.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality, VllmConfig
from pagedllm.sample.v2_logits_processors import V2LogitsProcessors
from pagedllm.sampling_params import SamplingParams
from pagedllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as V2LogitsProcessor


class BatchLogitsProcessors:
    """One instance of each class-based processor, and the batch index of each request.

    Each step the model runner calls ``update`` with the rows the sampler gets (request id,
    params, prompt ids, live output ids, in row order), then the sampler calls
    ``apply_non_argmax_invariant`` / ``apply_argmax_invariant``. The batch is exactly the step's
    sampled rows, row ``i`` = batch index ``i``: a request that did not sample this step (preempted,
    mid-prompt chunk, paused beam) left the batch and joins again when it samples; a request
    keeps its index while it stays; new requests take the lowest free index, the last requests
    fill holes (``UNIDIRECTIONAL``) and swaps put the rest in row order (``SWAP``).

    Model Runner V2 processors (``v2``), when any, run after the penalties on the same rows
    (``V2LogitsProcessors``: their own request slots and token buffers).

    Args:
        processors: built V1 processors, in the order they run within each group.
        v2: the V2 processors, or None.
    """

    def __init__(self, processors: Sequence[LogitsProcessor], v2: V2LogitsProcessors | None = None) -> None:
        self.processors = list(processors)
        self.v2 = v2
        self.non_argmax_invariant = [p for p in self.processors if not p.is_argmax_invariant()]
        self.argmax_invariant = [p for p in self.processors if p.is_argmax_invariant()]
        self._slots: list[str] = []   # request id at each batch index after the last update

    @property
    def changes_argmax(self) -> bool:
        """Whether any processor may change a greedy row's token (V1 non-argmax-invariant, or V2)."""
        return bool(self.non_argmax_invariant) or self.v2 is not None

    @classmethod
    def build(cls, classes: Sequence[type], vllm_config: VllmConfig, device: torch.device,
              vocab_size: int) -> "BatchLogitsProcessors":
        """V1 classes: ``cls(vllm_config, device, is_pin_memory)`` (pinned memory on CUDA); V2
        classes (subclasses of ``v1.worker.gpu.sample.logits_processor.LogitsProcessor``, in the
        same list): ``V2LogitsProcessors.build`` with ``max_num_seqs`` slots of ``max_model_len``
        tokens (``vocab_size``: logits columns)."""
        pin = device.type == "cuda"
        v2_classes = [c for c in classes if issubclass(c, V2LogitsProcessor)]
        v2 = None
        if v2_classes:
            sc = vllm_config.scheduler_config
            v2 = V2LogitsProcessors.build(v2_classes, vllm_config, device, sc.max_num_seqs, sc.max_model_len,
                                          vocab_size)
        return cls([c(vllm_config, device, pin) for c in classes if not issubclass(c, V2LogitsProcessor)], v2)

    def update(self, rows: Sequence[tuple[str, SamplingParams, list[int] | None, list[int]]]) -> BatchUpdate | None:
        """Tell every processor this step's batch (``update_state``, every step).

        Args:
            rows: (request id, params, prompt ids, live output ids) per logits row, in row order.
        Returns:
            The ``BatchUpdate`` given (None: the batch did not change).
        """
        update = self._diff(rows)
        for proc in self.processors:
            proc.update_state(update)
        return update

    def _diff(self, rows) -> BatchUpdate | None:
        order = [r[0] for r in rows]
        wanted = set(order)
        slots: list[str | None] = list(self._slots)
        removed = [i for i, rid in enumerate(slots) if rid not in wanted]
        for i in removed:
            slots[i] = None
        free, removed_left = sorted(removed), set(removed)
        present = {rid for rid in slots if rid is not None}
        added = []
        for rid, params, prompt_ids, output_ids in rows:
            if rid in present:
                continue
            if free:
                index = free.pop(0)
                removed_left.discard(index)   # refilled: not reported as removed
            else:
                index = len(slots)
                slots.append(None)
            slots[index] = rid
            added.append((index, params, prompt_ids, output_ids))
        moved: list[tuple[int, int, MoveDirectionality]] = []
        for hole in [i for i, rid in enumerate(slots) if rid is None]:   # condense: last into the hole
            while slots and slots[-1] is None:
                slots.pop()
            if hole >= len(slots):
                break
            slots[hole] = slots.pop()
            moved.append((len(slots), hole, MoveDirectionality.UNIDIRECTIONAL))
        while slots and slots[-1] is None:
            slots.pop()
        position = {rid: i for i, rid in enumerate(slots)}
        for i, rid in enumerate(order):               # then swaps into row order
            j = position[rid]
            if j != i:
                other = slots[i]
                slots[i], slots[j] = rid, other
                position[rid], position[other] = i, j
                moved.append((i, j, MoveDirectionality.SWAP))
        self._slots = slots
        if not (removed_left or added or moved):
            return None
        return BatchUpdate(batch_size=len(slots), removed=sorted(removed_left, reverse=True), added=added, moved=moved)

    @staticmethod
    def _apply(processors: list[LogitsProcessor], logits: torch.Tensor) -> torch.Tensor:
        for proc in processors:
            logits = proc.apply(logits)
        return logits

    def apply_non_argmax_invariant(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] float32 -> processed (may be in place): the processors that can change an argmax."""
        return self._apply(self.non_argmax_invariant, logits)

    def apply_argmax_invariant(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] float32 after temperature -> processed: the argmax-invariant processors."""
        return self._apply(self.argmax_invariant, logits)
