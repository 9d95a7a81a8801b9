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


# Pure decode batches of at most this many sequences take ``_build_decode_metadata`` (Python lists,
# faster than the numpy path at small batches; the timings are in docs/performance.md).
SMALL_DECODE_SEQS = 8


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
    if 0 < num_seqs <= SMALL_DECODE_SEQS and all(q == 1 for q in query_lens):
        return _build_decode_metadata(context_lens, block_tables, block_size, device)
    q_lens = np.asarray(query_lens, dtype=np.int64).reshape(num_seqs)
    ctx_lens = np.asarray(context_lens, dtype=np.int64).reshape(num_seqs)
    if num_seqs and q_lens.min() < 0:
        i = int(q_lens.argmin())
        raise _negative("query_lens", i, int(q_lens[i]))
    if num_seqs and ctx_lens.min() < 0:
        i = int(ctx_lens.argmin())
        raise _negative("context_lens", i, int(ctx_lens[i]))
    s_lens = ctx_lens + q_lens

    # Padded block table [num_seqs, max_num_blocks], filled with one masked assignment.
    table_lens = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=num_seqs)
    blocks_needed = -(-s_lens // block_size)  # ceil division
    short = np.nonzero(table_lens < blocks_needed)[0]
    if short.size:
        i = int(short[0])
        raise _short_table(i, int(table_lens[i]), int(s_lens[i]), int(blocks_needed[i]), block_size)
    width = int(table_lens.max()) if num_seqs else 0
    table = np.zeros((num_seqs, width), dtype=np.int64)
    if width:
        flat_ids = np.fromiter((b for t in block_tables for b in t), dtype=np.int64,
                               count=int(table_lens.sum()))
        if flat_ids.size and flat_ids.min() < 0:
            raise _negative_block_id(int(flat_ids.min()))
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


# The builders' errors (one wording for both paths; tests/attention/test_ops.py compares them).
def _negative(name: str, i: int, value: int) -> ValueError:
    return ValueError(f"{name}[{i}] must be >= 0, got {value}")


def _negative_block_id(value: int) -> ValueError:
    return ValueError(f"block ids must be >= 0, got {value}")


def _short_table(i: int, table_len: int, seq_len: int, needed: int, block_size: int) -> ValueError:
    return ValueError(
        f"block_tables[{i}] has {table_len} blocks ({table_len * block_size} tokens at block_size "
        f"{block_size}), but sequence {i} needs {seq_len} tokens ({needed} blocks)")


def _build_decode_metadata(context_lens: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int,
                           device: torch.device | str) -> AttentionMetadata:
    """``build_attention_metadata`` for one query token per sequence, in plain Python (a few
    sequences: the numpy path's per-call cost is most of a batch-1 step's metadata time). The same
    tensors, dtypes and errors as the numpy path (tests/attention/test_ops.py compares them)."""
    num_seqs = len(context_lens)
    ctx = [int(c) for c in context_lens]
    for i, c in enumerate(ctx):
        if c < 0:
            raise _negative("context_lens", i, c)
    width = 0
    for i, (c, table) in enumerate(zip(ctx, block_tables)):
        needed = c // block_size + 1          # blocks covering positions 0 .. c
        if len(table) < needed:
            raise _short_table(i, len(table), c + 1, needed, block_size)
        width = max(width, len(table))
    lowest = min((b for table in block_tables for b in table), default=0)
    if lowest < 0:
        raise _negative_block_id(int(lowest))
    flat_table = [0] * (num_seqs * width)
    for i, table in enumerate(block_tables):
        flat_table[i * width: i * width + len(table)] = [int(b) for b in table]
    slots = [flat_table[i * width + c // block_size] * block_size + c % block_size for i, c in enumerate(ctx)]
    seq_lens = [c + 1 for c in ctx]
    # The four int32 tensors as contiguous views of one (one tensor built instead of four).
    ints = torch.tensor([*range(num_seqs + 1), *seq_lens, *ctx, *flat_table], dtype=torch.int32, device=device)
    n1 = num_seqs + 1
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=ints[n1 + 2 * num_seqs:].view(num_seqs, width),
        query_start_loc=ints[:n1],
        seq_lens=ints[n1: n1 + num_seqs],
        context_lens=ints[n1 + num_seqs: n1 + 2 * num_seqs],
        max_query_len=1,
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_lens_cpu=[1] * num_seqs,
        seq_lens_cpu=seq_lens,
        context_lens_cpu=ctx,
        slot_mapping_has_padding=False,
    )
