"""Per-step attention inputs for a flattened batch that mixes prefill chunks and decodes."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Where each token of the flattened batch reads and writes K/V (PagedAttention, Kwon et al. 2023).

    The batch holds ``num_seqs`` sequences; sequence ``i`` contributes the query tokens
    ``query_start_loc[i]:query_start_loc[i+1]`` of the flattened ``[num_tokens, ...]`` input, at
    positions ``context_lens[i] .. seq_lens[i]-1``. Its K/V for positions ``0 .. seq_lens[i]-1``
    live in the paged cache at the physical blocks ``block_tables[i, :ceil(seq_lens[i]/block_size)]``
    once this step's K/V have been written through ``slot_mapping``.

    Attributes:
        slot_mapping: [num_tokens] int64; slot = block_id * block_size + offset; -1 = padding (skip).
        slot_mapping_has_padding: whether ``slot_mapping`` may hold -1 (False lets ``write_kv``
            skip its per-layer check: ``build_attention_metadata`` never pads).
        block_tables: [num_seqs, max_num_blocks] int32; rows padded with 0 past each sequence's blocks.
        query_start_loc: [num_seqs + 1] int32, cumulative query lengths (starts at 0).
        seq_lens: [num_seqs] int32, tokens of context after this step (cached + new).
        context_lens: [num_seqs] int32, tokens already cached before this step.
        max_query_len: max over sequences of the query length (tokens).
        max_seq_len: max over sequences of ``seq_lens`` (tokens).
        block_size: tokens per block.
        query_lens_cpu / seq_lens_cpu / context_lens_cpu: the same as Python lists, for backends
            that loop on the host without a device sync.
        plans: per-step memo for attention backends (not an ``__init__`` argument). A backend
            derives index tensors and masks from this metadata once per step and sliding window,
            and every layer of the forward reuses them; see :meth:`get_plan`. The memo lives and
            dies with this object, so nothing leaks across steps.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    context_lens_cpu: list[int]
    slot_mapping_has_padding: bool = True
    plans: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_pure_decode(self) -> bool:
        """True when every sequence has exactly one query token."""
        return self.max_query_len == 1

    @property
    def is_pure_prefill(self) -> bool:
        """True when no sequence has cached context (every query starts at position 0)."""
        return all(c == 0 for c in self.context_lens_cpu)

    @property
    def query_start_loc_cpu(self) -> list[int]:
        """``query_start_loc`` as a list of ``num_seqs + 1`` token offsets (no device sync)."""
        return [0, *accumulate(self.query_lens_cpu)]

    def get_plan(self, key: Hashable, build: Callable[[AttentionMetadata], Any]) -> Any:
        """Return the memoised ``build(self)`` for ``key``, building it on first use.

        Backends call this once per layer; only the first layer of a step pays for ``build``.
        ``key`` must capture everything besides this metadata that ``build`` depends on (backend
        name, sliding window, ...).
        """
        plan = self.plans.get(key)
        if plan is None:
            plan = build(self)
            self.plans[key] = plan
        return plan
