"""Reference paged attention: one sequence at a time, explicit mask, float32 softmax.

Source: PagedAttention (Kwon et al. 2023) for the block-table gather; the sliding window follows
Hugging Face / Mistral (query at p sees p - window < k <= p); the soft cap follows Gemma 2
(``cap * tanh(s / cap)``). Written for clarity, not speed: the oracle the fast backends and the
tests are checked against.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backends import AttentionSpec
from pagedllm.attention.metadata import AttentionMetadata


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """Read positions ``0 .. seq_len-1`` of one sequence out of the paged cache.

    Args:
        cache: [num_blocks, block_size, num_kv_heads, head_dim].
        block_table: [>= ceil(seq_len / block_size)] int, physical block per logical block.
        seq_len: tokens to read.
    Returns:
        [seq_len, num_kv_heads, head_dim], a contiguous copy in the cache dtype.
    """
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]      # [num_blocks, block_size, H_kv, D]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]  # [seq_len, H_kv, D]


def forward(
    spec: AttentionSpec,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """Attend every query token to its sequence's cached K/V (already holding this step's K/V).

    Args:
        spec: the layer's heads, scale, window and soft cap.
        query: [num_tokens, num_heads, head_dim].
        key, value: [num_tokens, num_kv_heads, head_dim]; unused (read back from the cache).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        metadata: this step's AttentionMetadata.
    Returns:
        [num_tokens, num_heads, head_dim] in query dtype; rows of padding tokens (past the last
        sequence's queries) are zero.
    """
    del key, value
    out = torch.zeros_like(query)
    group = spec.num_queries_per_kv
    starts = metadata.query_start_loc_cpu
    for i in range(metadata.num_seqs):
        q_len = metadata.query_lens_cpu[i]
        if q_len == 0:
            continue
        seq_len = metadata.seq_lens_cpu[i]
        ctx_len = metadata.context_lens_cpu[i]
        k = gather_kv(k_cache, metadata.block_tables[i], seq_len).float()   # [S, H_kv, D]
        v = gather_kv(v_cache, metadata.block_tables[i], seq_len).float()   # [S, H_kv, D]
        k = k.repeat_interleave(group, dim=1)                               # [S, H, D]
        v = v.repeat_interleave(group, dim=1)                               # [S, H, D]
        q = query[starts[i]:starts[i + 1]].float()                          # [T, H, D]

        scores = torch.einsum("thd,shd->hts", q, k) * spec.scale            # [H, T, S]
        if spec.logits_soft_cap is not None:
            cap = spec.logits_soft_cap
            scores = cap * torch.tanh(scores / cap)

        q_pos = torch.arange(ctx_len, seq_len, device=query.device)[:, None]  # [T, 1]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]           # [1, S]
        allowed = k_pos <= q_pos                                              # causal
        if spec.sliding_window is not None:
            allowed &= k_pos > q_pos - spec.sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))

        probs = torch.softmax(scores, dim=-1)                                # [H, T, S] fp32
        o = torch.einsum("hts,shd->thd", probs, v)                           # [T, H, D]
        out[starts[i]:starts[i + 1]] = o.to(query.dtype)
    return out
