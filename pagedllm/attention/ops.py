"""Paged KV-cache primitives: scatter K/V into the cache, and build one step's AttentionMetadata.

Source: PagedAttention (Kwon et al., "Efficient Memory Management for Large Language Model Serving
with PagedAttention", SOSP 2023). A sequence's K/V live in fixed-size physical blocks of a shared
pool; its block table maps logical block ``i`` (positions ``i*block_size ..``) to a physical row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    check_padding: bool = True,
) -> None:
    """Scatter this step's K/V into the paged cache, in place (PagedAttention, Kwon et al. 2023).

    Token ``t`` goes to ``cache[slot // block_size, slot % block_size]`` with
    ``slot = slot_mapping[t]``; tokens whose slot is -1 (padding) are skipped and their slots
    untouched. Implemented as ``index_copy_`` on the ``[num_blocks * block_size, ...]`` view.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim], model dtype.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], same dtype and
            device, contiguous.
        slot_mapping: [num_tokens] int64; slot = block_id * block_size + offset; -1 skips.
        check_padding: look for -1 slots (a compare, a reduction and a host read per call);
            False when the caller knows there are none (``AttentionMetadata.slot_mapping_has_padding``).
    Raises:
        ValueError: if len(slot_mapping) != num_tokens, if shapes or dtypes of key/value and
            the caches disagree, or if a cache is not contiguous.
        IndexError / RuntimeError: (from torch) if a slot is >= num_blocks * block_size.
    """
    num_tokens = key.shape[0]
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping must have shape [{num_tokens}] (one slot per token), "
            f"got {tuple(slot_mapping.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if key.dim() != 3 or tuple(key.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(
            f"key must be [num_tokens, {k_cache.shape[2]}, {k_cache.shape[3]}] to match the "
            f"cache, got {tuple(key.shape)}")
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise ValueError(
            f"key/value dtype {key.dtype}/{value.dtype} != cache dtype "
            f"{k_cache.dtype}/{v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if num_tokens == 0:
        return
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    if check_padding:
        valid = slots >= 0
        if not bool(valid.all()):  # one host sync; padding is rare (CUDA-graph style batches)
            key, value, slots = key[valid], value[valid], slots[valid]
    # [num_blocks, block_size, H_kv, D] -> [num_slots, H_kv, D]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value)


def build_attention_metadata(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str,
) -> AttentionMetadata:
    """Build one step's :class:`AttentionMetadata` for a flattened batch (vectorised, numpy).

    Sequence ``i`` contributes ``query_lens[i]`` tokens at positions
    ``context_lens[i] .. context_lens[i] + query_lens[i] - 1``; token at position ``p`` writes
    slot ``block_tables[i][p // block_size] * block_size + p % block_size``.

    Example (hand-checked in the tests): 10 tokens, block_size 4, block table [7, 2, 5] ->
    slot_mapping [28, 29, 30, 31, 8, 9, 10, 11, 20, 21].

    Args:
        query_lens: new tokens per sequence this step (>= 0; 1 for a decode).
        context_lens: tokens already cached per sequence before this step (>= 0).
        block_tables: physical block ids per sequence, logical block ``j`` at index ``j``; each
            must cover ``context_lens[i] + query_lens[i]`` tokens (longer tables are fine).
        block_size: tokens per block (>= 1).
        device: where the tensors go.
    Returns:
        AttentionMetadata with int64 ``slot_mapping`` [num_tokens], int32 ``block_tables``
        [num_seqs, max_num_blocks] (rows padded with 0), int32 ``query_start_loc``
        [num_seqs + 1], int32 ``seq_lens`` / ``context_lens`` [num_seqs].
    Raises:
        ValueError: if the three lists differ in length, a length or block id is negative,
            block_size < 1, or a block table is too short for its sequence.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    num_seqs = len(query_lens)
    if len(context_lens) != num_seqs or len(block_tables) != num_seqs:
        raise ValueError(
            f"query_lens, context_lens and block_tables must have one entry per sequence, got "
            f"{num_seqs}, {len(context_lens)} and {len(block_tables)}")
    q_lens = np.asarray(query_lens, dtype=np.int64).reshape(num_seqs)
    ctx_lens = np.asarray(context_lens, dtype=np.int64).reshape(num_seqs)
    if num_seqs and q_lens.min() < 0:
        i = int(q_lens.argmin())
        raise ValueError(f"query_lens[{i}] must be >= 0, got {int(q_lens[i])}")
    if num_seqs and ctx_lens.min() < 0:
        i = int(ctx_lens.argmin())
        raise ValueError(f"context_lens[{i}] must be >= 0, got {int(ctx_lens[i])}")
    s_lens = ctx_lens + q_lens

    # Padded block table [num_seqs, max_num_blocks], filled with one masked assignment.
    table_lens = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=num_seqs)
    blocks_needed = -(-s_lens // block_size)  # ceil division
    short = np.nonzero(table_lens < blocks_needed)[0]
    if short.size:
        i = int(short[0])
        raise ValueError(
            f"block_tables[{i}] has {int(table_lens[i])} blocks ({int(table_lens[i]) * block_size} "
            f"tokens at block_size {block_size}), but sequence {i} needs {int(s_lens[i])} tokens "
            f"({int(blocks_needed[i])} blocks)")
    width = int(table_lens.max()) if num_seqs else 0
    table = np.zeros((num_seqs, width), dtype=np.int64)
    if width:
        flat_ids = np.fromiter((b for t in block_tables for b in t), dtype=np.int64,
                               count=int(table_lens.sum()))
        if flat_ids.size and flat_ids.min() < 0:
            raise ValueError(f"block ids must be >= 0, got {int(flat_ids.min())}")
        table[np.arange(width)[None, :] < table_lens[:, None]] = flat_ids  # row-major fill

    # slot_mapping: per token, its sequence and position, then one fancy-index into the table.
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_of_token = np.repeat(np.arange(num_seqs), q_lens)                       # [num_tokens]
    positions = (np.arange(num_tokens) - query_start_loc[:-1][seq_of_token]
                 + ctx_lens[seq_of_token])                                      # [num_tokens]
    slot_mapping = (table[seq_of_token, positions // block_size] * block_size
                    + positions % block_size)                                   # [num_tokens]

    def to_dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a).to(device=device, dtype=dtype)

    q_list = q_lens.tolist()
    s_list = s_lens.tolist()
    return AttentionMetadata(
        slot_mapping=to_dev(slot_mapping.astype(np.int64), torch.int64),
        block_tables=to_dev(table, torch.int32),
        query_start_loc=to_dev(query_start_loc, torch.int32),
        seq_lens=to_dev(s_lens, torch.int32),
        context_lens=to_dev(ctx_lens, torch.int32),
        max_query_len=max(q_list, default=0),
        max_seq_len=max(s_list, default=0),
        block_size=block_size,
        query_lens_cpu=q_list,
        seq_lens_cpu=s_list,
        context_lens_cpu=ctx_lens.tolist(),
        slot_mapping_has_padding=False,  # every token here has a real slot
    )
