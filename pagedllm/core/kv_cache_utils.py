"""Content hashes of full KV blocks, chained from the prompt start (automatic prefix caching).

A block's K/V depends on every token before it, so its key is a chain (vLLM V1's
``hash_block_tokens`` in ``vllm/v1/core/kv_cache_utils.py``)::

    hash_0 = H(ROOT_HASH,  tokens[0:B],   extra_keys)
    hash_i = H(hash_{i-1}, tokens[iB:(i+1)B], extra_keys)

with ``H`` = SHA-256 over a fixed byte layout (parent digest, then each token id as a
little-endian signed 64-bit int, then ``repr`` of the extra keys). SHA-256 is stable across
processes, machines and Python versions (unlike Python's salted ``hash()``), so data-parallel
replicas and routers can compare these keys. Only *full* blocks are hashed. No torch here.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Sequence

BlockHash = bytes
"""A 32-byte SHA-256 digest identifying a full block and everything before it."""

ExternalBlockHash = bytes | int
"""A block hash as KV-cache events carry it (vLLM's ``ExternalBlockHash`` in
``vllm/v1/core/kv_cache_utils.py``): vLLM sends the SHA-256 bytes by default and a 64-bit int
only under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``. pagedllm always sends the 32 bytes of
``BlockHash`` (``to_external_block_hash``)."""

ROOT_HASH: BlockHash = hashlib.sha256(b"pagedllm prefix cache root v1").digest()
"""The parent hash of a request's first block (a fixed constant, the same in every process)."""


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple | None = None) -> BlockHash:
    """The chained hash of one full block.

    Args:
        parent_hash: the previous block's hash, or ``None`` for the first block (``ROOT_HASH``).
        token_ids: the block's token ids (``block_size`` of them; not checked here).
        extra_keys: anything else its K/V depends on (LoRA id, multimodal hashes); ``None`` for
            plain text. Must have a deterministic ``repr`` (ints, strings, tuples of them).
    Returns:
        32 bytes (SHA-256 digest).
    Raises:
        struct.error: for a token id outside the signed 64-bit range.
    """
    h = hashlib.sha256(ROOT_HASH if parent_hash is None else parent_hash)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(b"\x00extra:" + repr(tuple(extra_keys)).encode("utf-8"))
    return h.digest()


def hash_request_tokens(block_size: int, token_ids: Sequence[int],
                        extra_keys: tuple | None = None) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block gets none).

    Raises:
        ValueError: if ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


def group_block_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of a hybrid KV cache group's block: the 32-byte chained hash followed
    by the group index as 2 big-endian bytes (34 bytes; ``HybridKVCacheManager``'s keys)."""
    return block_hash + group.to_bytes(2, "big")


def to_external_block_hash(key: BlockHash) -> tuple[ExternalBlockHash, int]:
    """Split a prefix-cache key into the hash a KV-cache event carries and its group.

    Args:
        key: a ``BlockPool`` key: a 32-byte ``BlockHash`` (one KV cache group) or a 34-byte
            ``group_block_hash``.
    Returns:
        ``(block_hash, group_idx)``: the 32 SHA-256 bytes and the group index (0 for a plain key),
        as vLLM's ``get_block_hash`` / ``get_group_id``.
    """
    if len(key) == len(ROOT_HASH) + 2:
        return key[:-2], int.from_bytes(key[-2:], "big")
    return key, 0


@dataclass
class ComputedBlocks:
    """The result of a prefix-cache lookup (``KVCacheManager.get_computed_blocks``).

    Attributes:
        block_ids: physical ids of the cached full blocks that start the request, logical order.
        num_computed_tokens: tokens they hold, ``len(block_ids) * block_size``.
        num_query_tokens: tokens looked up (the request's ``num_tokens``); 0 when the lookup was
            skipped (caching off, or the request wants prompt logprobs).
    """

    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_query_tokens: int = 0


@dataclass
class PrefixCacheStats:
    """Running totals of prefix-cache lookups, in tokens (as vLLM counts them).

    Attributes:
        num_requests: admissions that looked the cache up.
        queries: tokens looked up (each admitted request's ``num_tokens``).
        hits: tokens found cached (``num_computed_tokens`` of the lookups).
    """

    num_requests: int = 0
    queries: int = 0
    hits: int = 0
