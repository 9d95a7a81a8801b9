"""Fast device-agnostic paged attention on ``F.scaled_dot_product_attention`` (SDPA).

Source: PagedAttention (Kwon et al. 2023) for the block-table gather; sliding window per Hugging
Face / Mistral (query at p sees p - window < k <= p); soft cap per Gemma 2 (``cap * tanh(s/cap)``).

The flattened batch is split three ways, once per step and window (memoised on the metadata, so
every layer after the first reuses the index tensors and masks):

- decodes (query_len == 1): batched. The blocks of all decode sequences are gathered at once into a
  padded ``[B, num_blocks * block_size, H_kv, D]`` tensor (only the blocks the window can reach),
  and one SDPA call runs with a length/window mask. Grouped-query attention is done by folding
  the ``G = num_heads // num_kv_heads`` query heads of a kv head into SDPA's query-length axis
  (``[B, H_kv, G, D]``), which on CPU is several times faster in bfloat16 than ``enable_gqa``.
  Gathered rows the mask hides are zeroed first: a masked NaN in the cache (an uninitialised slot)
  would otherwise poison the output, since 0 * NaN = NaN.
- fresh prefills (no cached context): SDPA straight on this step's q/k/v, causal (or with a
  band mask when the window is shorter than the prompt); the cache is not read.
- chunked prefills (cached context + a chunk): per sequence, gather the window-reachable K/V and
  run SDPA with an explicit ``[T, S]`` mask.

With a soft cap SDPA cannot be used; the same paths then run an explicit float32 attention.
SDPA keeps float32 accumulators internally for bfloat16 inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.attention.backends import AttentionSpec
from pagedllm.attention.metadata import AttentionMetadata


@dataclass
class _DecodePlan:
    """Batched decode gather for B sequences.

    Attributes:
        token_idx: [B] int64, rows of the flattened batch holding the decode tokens.
        token_range: (first, B) when those rows are contiguous (then a slice replaces the
            index ops), else None.
        block_ids: [B * num_blocks] int64 physical blocks to gather, sequence-major.
        num_blocks: blocks gathered per sequence (padded with repeats of the last block).
        mask: [B, 1, 1, num_blocks * block_size] bool, True = attend.
        masked_rows: [n] int64 rows of the gathered ``[B * num_blocks * block_size]`` K/V that
            the mask hides (zeroed before the matmul), or None when there are none.
    """

    token_idx: torch.Tensor
    token_range: tuple[int, int] | None
    block_ids: torch.Tensor
    num_blocks: int
    mask: torch.Tensor
    masked_rows: torch.Tensor | None


@dataclass
class _FreshPrefill:
    """A prefill with no cached context: tokens ``start:end``; ``mask`` [T, T] or None (causal)."""

    start: int
    end: int
    mask: torch.Tensor | None


@dataclass
class _ChunkedPrefill:
    """A chunk after cached context: tokens ``start:end`` read keys ``key_start .. seq_len-1``.

    Attributes:
        block_ids: [n] int64 blocks covering positions ``key_start .. seq_len-1``.
        offset: row of position ``key_start`` inside the gathered ``[n * block_size]`` rows.
        num_keys: ``seq_len - key_start``.
        mask: [T, num_keys] bool, True = attend.
    """

    start: int
    end: int
    block_ids: torch.Tensor
    offset: int
    num_keys: int
    mask: torch.Tensor


@dataclass
class _Plan:
    decode: _DecodePlan | None
    fresh: list[_FreshPrefill]
    chunked: list[_ChunkedPrefill]
    covers_all_tokens: bool


def _band_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[..., T, S] bool: k <= p, and p - window < k when a window is set (HF semantics)."""
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def _first_key(pos: int, window: int | None) -> int:
    """Earliest key position the query at ``pos`` can see."""
    return 0 if window is None else max(0, pos - window + 1)


def _build_decode_plan(
    md: AttentionMetadata, seqs: list[int], window: int | None, device: torch.device
) -> _DecodePlan:
    bs = md.block_size
    starts = md.query_start_loc_cpu
    tokens = [starts[i] for i in seqs]
    seq_lens = torch.tensor([md.seq_lens_cpu[i] for i in seqs], dtype=torch.int64)   # [B]
    q_pos = seq_lens - 1                                                             # [B]
    if window is None:
        first_block = torch.zeros_like(seq_lens)
    else:
        first_block = (q_pos - window + 1).clamp_min(0) // bs                        # [B]
    last_block = (seq_lens + bs - 1) // bs - 1                                       # [B]
    num_blocks = int((last_block - first_block).max()) + 1
    logical = first_block[:, None] + torch.arange(num_blocks)                        # [B, nb]
    columns = torch.minimum(logical, last_block[:, None])  # pad with the last block, not block 0
    seq_idx = torch.tensor(seqs, dtype=torch.int64, device=device)
    block_ids = md.block_tables.index_select(0, seq_idx).long().gather(
        1, columns.to(device))                                                        # [B, nb]
    k_pos = (logical[:, :, None] * bs + torch.arange(bs)).reshape(len(seqs), -1)     # [B, nb*bs]
    allowed = _band_mask(q_pos[:, None], k_pos, window)                              # [B, nb*bs]
    masked_rows = torch.nonzero(~allowed.reshape(-1)).reshape(-1)
    contiguous = tokens == list(range(tokens[0], tokens[0] + len(tokens)))
    return _DecodePlan(
        token_idx=torch.tensor(tokens, dtype=torch.int64, device=device),
        token_range=(tokens[0], len(tokens)) if contiguous else None,
        block_ids=block_ids.reshape(-1),
        num_blocks=num_blocks,
        mask=allowed[:, None, None, :].to(device),                                  # [B,1,1,Lk]
        masked_rows=masked_rows.to(device) if masked_rows.numel() else None,
    )


def _build_plan(md: AttentionMetadata, window: int | None, device: torch.device) -> _Plan:
    bs = md.block_size
    starts = md.query_start_loc_cpu
    decode_seqs: list[int] = []
    fresh: list[_FreshPrefill] = []
    chunked: list[_ChunkedPrefill] = []
    for i, q_len in enumerate(md.query_lens_cpu):
        ctx_len, seq_len = md.context_lens_cpu[i], md.seq_lens_cpu[i]
        if q_len == 0:
            continue
        if q_len == 1:
            decode_seqs.append(i)
            continue
        q_pos = torch.arange(ctx_len, seq_len, device=device)[:, None]               # [T, 1]
        if ctx_len == 0:
            mask = None
            if window is not None and window < q_len:
                mask = _band_mask(q_pos, torch.arange(seq_len, device=device)[None, :], window)
            fresh.append(_FreshPrefill(starts[i], starts[i + 1], mask))
            continue
        key_start = _first_key(ctx_len, window)
        first_block, end_block = key_start // bs, -(-seq_len // bs)
        k_pos = torch.arange(key_start, seq_len, device=device)[None, :]              # [1, S]
        chunked.append(_ChunkedPrefill(
            start=starts[i],
            end=starts[i + 1],
            block_ids=md.block_tables[i, first_block:end_block].long(),
            offset=key_start - first_block * bs,
            num_keys=seq_len - key_start,
            mask=_band_mask(q_pos, k_pos, window),                                    # [T, S]
        ))
    decode = _build_decode_plan(md, decode_seqs, window, device) if decode_seqs else None
    return _Plan(decode, fresh, chunked, covers_all_tokens=starts[-1] == md.num_tokens)


def _attend(
    spec: AttentionSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Masked attention with SDPA's layout: q [*, Hq, T, D], k/v [*, Hkv, S, D], Hq % Hkv == 0.

    ``mask`` is bool broadcastable to [*, Hq, T, S] (True = attend); None means causal with
    T == S. Returns [*, Hq, T, D] in q's dtype. Uses SDPA unless a soft cap is set, then an
    explicit float32 softmax.
    """
    gqa = q.shape[-3] != k.shape[-3]
    if spec.logits_soft_cap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=spec.scale, enable_gqa=gqa)
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * spec.scale     # [*, H, T, S]
    cap = spec.logits_soft_cap
    scores = cap * torch.tanh(scores / cap)
    if mask is None:
        t, s = scores.shape[-2:]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)                               # [*, H, T, D]


def _decode(
    spec: AttentionSpec,
    plan: _DecodePlan,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
) -> None:
    num_seqs = plan.token_idx.shape[0]
    h_kv, d = spec.num_kv_heads, spec.head_dim
    num_keys = plan.num_blocks * k_cache.shape[1]

    def gather(cache: torch.Tensor) -> torch.Tensor:
        rows = cache.index_select(0, plan.block_ids).view(-1, h_kv, d)  # [B*nb*bs, H_kv, D]
        if plan.masked_rows is not None:
            rows.index_fill_(0, plan.masked_rows, 0)
        return rows.view(num_seqs, num_keys, h_kv, d).transpose(1, 2)   # [B, H_kv, Lk, D]

    k, v = gather(k_cache), gather(v_cache)
    if plan.token_range is not None:
        q = query.narrow(0, *plan.token_range)                          # [B, H, D]
    else:
        q = query.index_select(0, plan.token_idx)                       # [B, H, D]
    # Fold each kv head's query heads into SDPA's query-length axis: [B, H_kv, G, D].
    q = q.reshape(num_seqs, h_kv, spec.num_queries_per_kv, d)
    o = _attend(spec, q, k, v, plan.mask).reshape(num_seqs, spec.num_heads, d)    # [B, H, D]
    if plan.token_range is not None:
        out.narrow(0, *plan.token_range).copy_(o)
    else:
        out.index_copy_(0, plan.token_idx, o)


def forward(
    spec: AttentionSpec,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """Paged attention over a flattened batch of prefill chunks and decodes.

    Args:
        spec: the layer's heads, scale, window and soft cap.
        query: [num_tokens, num_heads, head_dim], float32 or bfloat16 (any float dtype SDPA takes).
        key, value: [num_tokens, num_kv_heads, head_dim], this step's K/V (read directly for
            fresh prefills).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], already holding this
            step's K/V.
        metadata: this step's AttentionMetadata.
    Returns:
        [num_tokens, num_heads, head_dim] in query dtype; rows of padding tokens (past the last
        sequence's queries) are zero.
    """
    plan: _Plan = metadata.get_plan(
        ("cpu_sdpa", spec.sliding_window),
        lambda md: _build_plan(md, spec.sliding_window, query.device))
    if plan.covers_all_tokens:
        out = torch.empty_like(query)
    else:
        out = torch.zeros_like(query)
    h_kv, d = spec.num_kv_heads, spec.head_dim

    if plan.decode is not None:
        _decode(spec, plan.decode, query, k_cache, v_cache, out)

    for p in plan.fresh:
        q = query[p.start:p.end].transpose(0, 1)                        # [H, T, D]
        k = key[p.start:p.end].transpose(0, 1)                          # [H_kv, T, D]
        v = value[p.start:p.end].transpose(0, 1)                        # [H_kv, T, D]
        out[p.start:p.end] = _attend(spec, q, k, v, p.mask).transpose(0, 1)

    for p in plan.chunked:
        def gather(cache: torch.Tensor, p: _ChunkedPrefill = p) -> torch.Tensor:
            rows = cache.index_select(0, p.block_ids).view(-1, h_kv, d)  # [n*bs, H_kv, D]
            return rows[p.offset:p.offset + p.num_keys].transpose(0, 1)  # [H_kv, S, D]

        q = query[p.start:p.end].transpose(0, 1)                        # [H, T, D]
        o = _attend(spec, q, gather(k_cache), gather(v_cache), p.mask)  # [H, T, D]
        out[p.start:p.end] = o.transpose(0, 1)
    return out
