"""KV cache groups: layers with the same attention kind share one block table (hybrid KV cache).

vLLM V1's hybrid KV cache manager, in plain data (no torch). The layers are split by attention
kind (full, or a sliding window of ``w`` tokens) into groups of ``group_size`` layers each; every
group has its own block table per request, and all groups draw from one pool of equal pages: the
worker allocates ``group_size`` KV tensor pairs of ``[num_blocks, block_size, Hkv, D]`` and the
j-th layer of every group uses pair j, so a block id names the same bytes whichever group holds
it (page = ``group_size`` layers x ``block_size`` tokens).

Gemma 3 270M: 18 layers, 15 sliding (w = 512) and 3 full -> ``group_size`` 3, one full group
(layers 5, 11, 17) and five sliding groups. A sliding group needs only the blocks of the last
``w`` tokens, so an 8k-token request holds 512 full-group blocks plus ~33 per sliding group
(block_size 16) instead of 512 blocks of 18 layers each.

Block ids cross the process boundary interleaved: a request's table is one flat list with
logical block ``i`` of group ``g`` at index ``i * num_groups + g`` (``split_group_block_ids``
undoes it), so the per-step message keeps its fields and a single group is today's table.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Sequence

#: Block 0 of a hybrid pool is never allocated: it stands for a sliding group's blocks that fell
#: out of the window (vLLM's null block); attention never reads it.
NULL_BLOCK_ID = 0


#: More groups than this fall back to the single-group manager (tables too long per request).
MAX_KV_CACHE_GROUPS = 8


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group of layers sharing a block table.

    Attributes:
        layer_indices: global decoder-layer indices; the j-th uses the worker's KV tensor pair j.
        sliding_window: tokens (the query at p sees p - w < k <= p); ``None`` for full attention.
    """

    layer_indices: tuple[int, ...]
    sliding_window: int | None = None

    def num_window_blocks(self, block_size: int) -> int:
        """Blocks before the newest token's block that the next query still reads:
        ``cdiv(w - 1, block_size)`` for a sliding group (a prefix-cache hit needs them)."""
        if self.sliding_window is None:
            raise ValueError("a full-attention group has no window")
        return cdiv(self.sliding_window - 1, block_size)


@dataclass(frozen=True)
class KVCacheGroups:
    """How a model's layers map to block tables and KV tensors.

    Attributes:
        groups: the groups, full-attention ones first; all have ``group_size`` layers.
        num_layers: decoder layers of the model.
        fallback_reason: why the single-group manager is used (``None`` when hybrid, or when
            the model has one attention kind and needed no fallback).
    Raises:
        ValueError: if groups differ in size or do not cover each layer exactly once.
    """

    groups: tuple[KVCacheGroupSpec, ...]
    num_layers: int
    fallback_reason: str | None = None

    def __post_init__(self) -> None:
        sizes = {len(g.layer_indices) for g in self.groups}
        if len(sizes) != 1:
            raise ValueError(f"KV cache groups must have equal sizes, got {sorted(sizes)}")
        layers = sorted(i for g in self.groups for i in g.layer_indices)
        if layers != list(range(self.num_layers)):
            raise ValueError(f"KV cache groups must cover layers 0..{self.num_layers - 1} once each")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def group_size(self) -> int:
        """Layers per group = KV tensor pairs the worker allocates."""
        return len(self.groups[0].layer_indices)

    @property
    def is_hybrid(self) -> bool:
        """True when some group has a sliding window (the hybrid manager is used)."""
        return any(g.sliding_window is not None for g in self.groups)

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Per group: its window, ``None`` for full attention."""
        return tuple(g.sliding_window for g in self.groups)

    def _stage_layers(self, start: int, end: int | None) -> range:
        end = self.num_layers if end is None else end
        if not 0 <= start < end <= self.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is not inside the model's {self.num_layers} layers")
        return range(start, end)

    def layer_tensor_index(self, start: int = 0, end: int | None = None) -> list[int]:
        """Per decoder layer of ``[start, end)`` (a pipeline stage; default all layers): which of
        the stage's ``num_tensor_pairs(start, end)`` KV tensor pairs it uses (the j-th of a
        group's layers in the range uses pair j).

        Raises:
            ValueError: if the range is empty or outside the model's layers.
        """
        stage = self._stage_layers(start, end)
        out = [0] * len(stage)
        for g in self.groups:
            for j, layer in enumerate(i for i in g.layer_indices if i in stage):
                out[layer - start] = j
        return out

    def num_tensor_pairs(self, start: int = 0, end: int | None = None) -> int:
        """KV tensor pairs a stage holding layers ``[start, end)`` allocates: the most layers any
        group has in the range (``group_size`` for the whole model). Groups are global, so every
        stage pages the same block ids; a block is ``num_tensor_pairs`` layers on each stage.

        Raises:
            ValueError: as ``layer_tensor_index``.
        """
        stage = self._stage_layers(start, end)
        return max(sum(1 for i in g.layer_indices if i in stage) for g in self.groups)

    def layer_group(self, start: int = 0, end: int | None = None) -> list[int]:
        """Per decoder layer of ``[start, end)`` (default all layers): the index of its group
        among all ``num_groups``.

        Raises:
            ValueError: as ``layer_tensor_index``.
        """
        stage = self._stage_layers(start, end)
        out = [0] * len(stage)
        for gi, g in enumerate(self.groups):
            for layer in g.layer_indices:
                if layer in stage:
                    out[layer - start] = gi
        return out

    def max_blocks_per_request(self, num_tokens: int, block_size: int, chunk_tokens: int | None = None) -> int:
        """Blocks one request of ``num_tokens`` tokens holds at most, summed over the groups.

        A full group holds ``cdiv(num_tokens, block_size)``; a sliding group the window plus the
        step's tokens, ``min(cdiv(num_tokens, bs), cdiv(w - 1 + chunk, bs) + 1)`` (vLLM's
        ``max_memory_usage_bytes``), with ``chunk`` = ``chunk_tokens`` (the largest prefill chunk,
        ``max_num_batched_tokens``) or 1 (decode).
        """
        chunk = 1 if chunk_tokens is None else max(1, min(chunk_tokens, num_tokens))
        total = 0
        for g in self.groups:
            n = cdiv(num_tokens, block_size)
            if g.sliding_window is not None:
                n = min(n, cdiv(g.sliding_window - 1 + chunk, block_size) + 1)
            total += n
        return total


    def max_concurrency(self, num_blocks: int, num_tokens: int, block_size: int,
                        max_num_batched_tokens: int = 0) -> float:
        """Requests of ``num_tokens`` tokens that ``num_blocks`` pages hold at once.

        One group: ``num_blocks * block_size / num_tokens`` (today's startup line). Hybrid: the
        pool less the null block and one step's prefill chunk (``max_num_batched_tokens``
        tokens, transiently held by every sliding group before its out-of-window blocks go
        back), over ``max_blocks_per_request(num_tokens, block_size)``.
        """
        if not self.is_hybrid:
            return num_blocks * block_size / num_tokens
        num_sliding = sum(1 for g in self.groups if g.sliding_window is not None)
        usable = num_blocks - 1 - num_sliding * cdiv(max_num_batched_tokens, block_size)
        return max(usable, 0) / self.max_blocks_per_request(num_tokens, block_size)


def single_group(num_layers: int, reason: str | None = None) -> KVCacheGroups:
    """Today's layout: one full-attention group of every layer (one table, one tensor pair per layer)."""
    return KVCacheGroups((KVCacheGroupSpec(tuple(range(num_layers)), None),), num_layers, reason)


def make_kv_cache_groups(layer_windows: Sequence[int | None]) -> KVCacheGroups:
    """Group the layers by attention kind into groups of equal size (vLLM's hybrid grouping).

    ``group_size`` is the gcd of the kinds' layer counts, each kind split in order. One kind of
    sliding window on every layer (Mistral) is one sliding group of all layers.

    Args:
        layer_windows: per decoder layer, its sliding window in tokens or ``None`` (full).
    Returns:
        The groups; the single full group when the model has no sliding layer, or (with a
        ``fallback_reason``) when the kinds cannot be grouped evenly into at most
        ``MAX_KV_CACHE_GROUPS`` groups.
    Raises:
        ValueError: for an empty list or a non-positive window.
    """
    if not layer_windows:
        raise ValueError("layer_windows must name at least one layer")
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        if w is not None and (not isinstance(w, int) or w < 1):
            raise ValueError(f"layer_windows[{i}] must be a positive int or None, got {w!r}")
        kinds.setdefault(w, []).append(i)
    n = len(layer_windows)
    if set(kinds) == {None}:
        return single_group(n)
    size = 0
    for layers in kinds.values():
        size = gcd(size, len(layers))
    num_groups = n // size
    if num_groups > MAX_KV_CACHE_GROUPS:
        # Tiny groups: per-request tables as long as the layer count, pages of a layer or two.
        return single_group(n, f"layer kinds of {sorted(len(v) for v in kinds.values())} layers make "
                               f"{num_groups} groups of {size} (more than {MAX_KV_CACHE_GROUPS})")
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    groups = tuple(KVCacheGroupSpec(tuple(kinds[w][s:s + size]), w)
                   for w in order for s in range(0, len(kinds[w]), size))
    return KVCacheGroups(groups, n)


def split_group_block_ids(block_ids: Sequence[int], num_groups: int) -> list[list[int]]:
    """Undo the interleaving of a flat table: group g's logical block i is ``block_ids[i * G + g]``.

    Raises:
        ValueError: if the length is not a multiple of ``num_groups``.
    """
    if num_groups < 1 or len(block_ids) % num_groups:
        raise ValueError(f"a table of {len(block_ids)} ids does not split into {num_groups} groups")
    return [list(block_ids[g::num_groups]) for g in range(num_groups)]


def resolve_kv_cache_groups(layer_windows: Sequence[int | None], *, disable_hybrid: bool = False,
                            uses_draft_model: bool = False) -> KVCacheGroups:
    """The engine's and every worker's layout (same inputs, same answer on both sides).

    The hybrid layout (``make_kv_cache_groups``) unless a setting it does not cover asks for
    today's single table, named in ``fallback_reason``: ``disable_hybrid_kv_cache_manager``, or
    a draft model on a target without a full-attention group (the draft's own pool is indexed
    by the full group's table, which every sliding group lacks: its out-of-window blocks are
    gone). Pipeline stages need no fallback: the groups are the whole model's, and each stage
    allocates pairs for its own layers (``num_tensor_pairs``). Swap preemption needs none
    either: the host pool takes the same pages (``swap_space.SwapSpace``; a sliding group swaps
    only its window).
    """
    groups = make_kv_cache_groups(layer_windows)
    if not groups.is_hybrid:
        return groups
    n = len(layer_windows)
    if disable_hybrid:
        return single_group(n, "disable_hybrid_kv_cache_manager is set")
    if uses_draft_model and groups.groups[0].sliding_window is not None:
        return single_group(n, "a draft model reads the full-attention group's block table, and every layer "
                               "of this model has a sliding window")
    return groups


def kv_cache_groups_for(model_config, cache_config, uses_draft_model: bool = False) -> KVCacheGroups:
    """``resolve_kv_cache_groups`` from the engine's configs (``ModelConfig.layer_sliding_windows``,
    ``CacheConfig``)."""
    windows = tuple(model_config.layer_sliding_windows) or (None,) * model_config.num_hidden_layers
    return resolve_kv_cache_groups(
        windows, disable_hybrid=cache_config.disable_hybrid_kv_cache_manager, uses_draft_model=uses_draft_model)
