"""write_kv and build_attention_metadata: hand-computed slots, padding, validation."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import build_attention_metadata, write_kv


def test_slot_mapping_hand_computed():
    # 10 tokens at block_size 4 -> 3 blocks: [7, 2, 5] -> slots 28..31, 8..11, 20, 21.
    md = build_attention_metadata([10], [0], [[7, 2, 5]], block_size=4, device="cpu")
    assert md.slot_mapping.tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    assert md.slot_mapping.dtype == torch.int64
    assert md.block_tables.tolist() == [[7, 2, 5]]
    assert md.block_tables.dtype == torch.int32
    assert md.query_start_loc.tolist() == [0, 10]
    assert md.seq_lens.tolist() == [10]
    assert md.context_lens.tolist() == [0]
    assert (md.max_query_len, md.max_seq_len, md.num_seqs, md.num_tokens) == (10, 10, 1, 10)
    assert md.is_pure_prefill and not md.is_pure_decode


def test_metadata_mixed_batch():
    # seq 0: fresh prefill of 3; seq 1: decode at position 5; seq 2: chunk of 4 after 6 cached.
    md = build_attention_metadata(
        query_lens=[3, 1, 4], context_lens=[0, 5, 6], block_tables=[[9], [3, 1], [4, 0, 8]],
        block_size=4, device="cpu")
    assert md.slot_mapping.tolist() == [36, 37, 38, 5, 2, 3, 32, 33]
    assert md.block_tables.tolist() == [[9, 0, 0], [3, 1, 0], [4, 0, 8]]
    assert md.query_start_loc.tolist() == [0, 3, 4, 8]
    assert md.query_start_loc_cpu == [0, 3, 4, 8]
    assert md.seq_lens.tolist() == [3, 6, 10]
    assert md.context_lens.tolist() == [0, 5, 6]
    assert md.seq_lens_cpu == [3, 6, 10] and md.query_lens_cpu == [3, 1, 4]
    assert (md.max_query_len, md.max_seq_len) == (4, 10)
    assert not md.is_pure_prefill and not md.is_pure_decode


def test_metadata_pure_decode_and_longer_tables():
    md = build_attention_metadata([1, 1], [0, 7], [[5, 6, 7], [1, 2]], block_size=8, device="cpu")
    assert md.slot_mapping.tolist() == [40, 15]
    assert md.is_pure_decode


def test_metadata_empty_batch():
    md = build_attention_metadata([], [], [], block_size=16, device="cpu")
    assert md.num_seqs == 0 and md.num_tokens == 0
    assert md.query_start_loc.tolist() == [0]
    assert tuple(md.block_tables.shape) == (0, 0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(query_lens=[1], context_lens=[0, 1], block_tables=[[0]]), "one entry per sequence"),
    (dict(query_lens=[-1], context_lens=[0], block_tables=[[0]]), r"query_lens\[0\]"),
    (dict(query_lens=[1], context_lens=[-2], block_tables=[[0]]), r"context_lens\[0\]"),
    (dict(query_lens=[2], context_lens=[3], block_tables=[[0]]), r"block_tables\[0\] has 1 blocks"),
    (dict(query_lens=[1], context_lens=[0], block_tables=[[-3]]), "block ids"),
])
def test_metadata_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_attention_metadata(block_size=4, device="cpu", **kwargs)


def test_metadata_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        build_attention_metadata([1], [0], [[0]], block_size=0, device="cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_scatters_and_skips_padding(dtype):
    num_blocks, block_size, h_kv, d = 4, 4, 2, 8
    k_cache = torch.randn(num_blocks, block_size, h_kv, d).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, h_kv, d).to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    key = torch.randn(5, h_kv, d).to(dtype)
    value = torch.randn(5, h_kv, d).to(dtype)
    slots = torch.tensor([13, -1, 2, -1, 7])
    write_kv(key, value, k_cache, v_cache, slots)

    expected_k, expected_v = k_before.view(-1, h_kv, d).clone(), v_before.view(-1, h_kv, d).clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected_k[s], expected_v[s] = key[t], value[t]
    assert torch.equal(k_cache.view(-1, h_kv, d), expected_k)
    assert torch.equal(v_cache.view(-1, h_kv, d), expected_v)
    # Slot 13 = block 3, offset 1.
    assert torch.equal(k_cache[3, 1], key[0])


def test_write_kv_all_padding_leaves_cache_untouched():
    k_cache, v_cache = torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    write_kv(torch.randn(3, 1, 8), torch.randn(3, 1, 8), k_cache, v_cache,
             torch.full((3,), -1, dtype=torch.int64))
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


def test_write_kv_validates():
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    key = torch.randn(3, 1, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(key, key, k_cache, v_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="dtype"):
        write_kv(key.bfloat16(), key.bfloat16(), k_cache, v_cache, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="key must be"):
        write_kv(torch.randn(3, 2, 8), torch.randn(3, 2, 8), k_cache, v_cache,
                 torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("ctx_lens, tables, bs", [
    ([0], [[3]], 4),
    ([63], [[5, 1, 9, 2]], 16),
    ([7, 0, 30, 16], [[2, 3], [9], [4, 5, 6, 7, 8], [0, 1, 10]], 8),
    ([15, 2], [[11, 12, 13], [14]], 8),               # longer tables than needed
])
def test_decode_metadata_equals_numpy_path(monkeypatch, ctx_lens, tables, bs):
    """Small pure-decode batches take the plain-Python builder; it gives the numpy path's
    tensors (values and dtypes; contiguous, as the C++ kernel needs, though four are views of
    one buffer) and lists."""
    from pagedllm.attention import ops

    fast = build_attention_metadata([1] * len(ctx_lens), ctx_lens, tables, bs, "cpu")
    monkeypatch.setattr(ops, "SMALL_DECODE_SEQS", 0)
    ref = build_attention_metadata([1] * len(ctx_lens), ctx_lens, tables, bs, "cpu")
    for name in ("slot_mapping", "block_tables", "query_start_loc", "seq_lens", "context_lens"):
        a, b = getattr(fast, name), getattr(ref, name)
        assert a.dtype == b.dtype and torch.equal(a, b) and a.is_contiguous(), name
    for name in ("max_query_len", "max_seq_len", "block_size", "query_lens_cpu", "seq_lens_cpu",
                 "context_lens_cpu", "slot_mapping_has_padding"):
        assert getattr(fast, name) == getattr(ref, name), name


@pytest.mark.parametrize("small", [True, False])
@pytest.mark.parametrize("ctx_lens, tables, match", [
    ([-2], [[0]], r"context_lens\[0\]"),
    ([4], [[0]], r"block_tables\[0\] has 1 blocks"),
    ([0, 0], [[0], [-3]], "block ids"),
])
def test_decode_metadata_rejects_bad_input_on_both_paths(monkeypatch, small, ctx_lens, tables, match):
    from pagedllm.attention import ops

    if not small:
        monkeypatch.setattr(ops, "SMALL_DECODE_SEQS", 0)
    with pytest.raises(ValueError, match=match):
        build_attention_metadata([1] * len(ctx_lens), ctx_lens, tables, block_size=4, device="cpu")
