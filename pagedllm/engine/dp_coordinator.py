"""Which data-parallel replica gets a request (vLLM's DP load balancing, ``DPLBAsyncMPClient``).

Rule, per request, among the replicas still alive:

1. **Load**: a replica's load is its requests in flight (sent and not yet finished: its waiting +
   running requests, plus those still on the way), then its last reported KV cache usage, then
   its index. The least-loaded replica is the default choice (never round robin: a replica slowed
   by long prompts gets fewer new requests).
2. **Prefix affinity** (with prefix caching): the content hashes of the request's first
   ``PREFIX_AFFINITY_BLOCKS`` full blocks (``core/kv_cache_utils.hash_request_tokens``, SHA-256,
   the same in every process) are looked up in a small per-replica LRU of hashes recently sent
   there (``PREFIX_LRU_SIZE`` entries). The replica matching the most leading blocks wins when its
   in-flight count is at most the least load + ``PREFIX_AFFINITY_MARGIN`` requests; past that
   margin, spreading the load is worth more than a cache hit.

No processes here: the client (``engine/dp_client.py``) tells the balancer what it sent, what
finished and what died.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from pagedllm.core.kv_cache_utils import hash_request_tokens

# Leading full blocks of a prompt whose hashes the balancer compares (a shared system prompt or
# conversation head, not the whole prompt).
PREFIX_AFFINITY_BLOCKS = 4
# Requests in flight a replica holding the prefix may carry above the least-loaded replica and
# still be chosen.
PREFIX_AFFINITY_MARGIN = 4
# Recent prefix hashes remembered per replica (least recently used dropped first).
PREFIX_LRU_SIZE = 1024


@dataclass
class ReplicaLoad:
    """What the balancer knows about one replica.

    Attributes:
        alive: False once the replica died or left (never chosen again, unless it rejoins: ``revive``).
        draining: True while it finishes its requests before leaving (not chosen for new ones).
        in_flight: request ids sent to it and not yet finished or aborted.
        kv_cache_usage: its last reported fraction of KV blocks in use.
        num_served: requests ever sent to it.
        recent_prefixes: block hashes of recently sent prompts (an LRU; values unused).
    """

    alive: bool = True
    draining: bool = False
    in_flight: set[str] = field(default_factory=set)
    kv_cache_usage: float = 0.0
    num_served: int = 0
    recent_prefixes: OrderedDict = field(default_factory=OrderedDict)


class DPLoadBalancer:
    """Least-load routing with prefix affinity over ``num_replicas`` replicas.

    Args:
        num_replicas: data_parallel_size.
        block_size: tokens per KV block (the replicas' ``CacheConfig.block_size``).
        enable_prefix_affinity: compare prefix hashes (on with prefix caching).
    """

    def __init__(self, num_replicas: int, block_size: int, enable_prefix_affinity: bool = True) -> None:
        self.replicas = [ReplicaLoad() for _ in range(num_replicas)]
        self.block_size = block_size
        self.enable_prefix_affinity = enable_prefix_affinity
        self._owner: dict[str, int] = {}

    def alive(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.alive]

    def prefix_hashes(self, prompt_token_ids: Sequence[int]) -> list[bytes]:
        """Hashes of the first ``PREFIX_AFFINITY_BLOCKS`` full blocks (fewer for short prompts)."""
        if not self.enable_prefix_affinity:
            return []
        head = prompt_token_ids[:PREFIX_AFFINITY_BLOCKS * self.block_size]
        return hash_request_tokens(self.block_size, head)

    def choose(self, prompt_token_ids: Sequence[int]) -> int:
        """The replica for a new request (does not record it; see ``assign``).

        Raises:
            RuntimeError: if no replica is alive.
        """
        alive = [i for i in self.alive() if not self.replicas[i].draining]
        if not alive:
            raise RuntimeError("no data-parallel replica is alive" if not self.alive()
                               else "every live data-parallel replica is shutting down")
        key = lambda i: (len(self.replicas[i].in_flight), self.replicas[i].kv_cache_usage, i)  # noqa: E731
        best = min(alive, key=key)
        hashes = self.prefix_hashes(prompt_token_ids)
        if not hashes:
            return best
        min_load = len(self.replicas[best].in_flight)
        best_match, best_depth = None, 0
        for i in alive:
            lru = self.replicas[i].recent_prefixes
            depth = 0
            while depth < len(hashes) and hashes[depth] in lru:
                depth += 1
            if depth > best_depth or (depth == best_depth and depth and key(i) < key(best_match)):
                best_match, best_depth = i, depth
        if best_match is not None and len(self.replicas[best_match].in_flight) <= min_load + PREFIX_AFFINITY_MARGIN:
            return best_match
        return best

    def assign(self, request_id: str, replica: int, prompt_token_ids: Sequence[int]) -> None:
        """Record that ``request_id`` was sent to ``replica`` (its prefix hashes join the LRU)."""
        r = self.replicas[replica]
        r.in_flight.add(request_id)
        r.num_served += 1
        self._owner[request_id] = replica
        for h in self.prefix_hashes(prompt_token_ids):
            r.recent_prefixes[h] = None
            r.recent_prefixes.move_to_end(h)
        while len(r.recent_prefixes) > PREFIX_LRU_SIZE:
            r.recent_prefixes.popitem(last=False)

    def owner(self, request_id: str) -> int | None:
        """The replica serving ``request_id`` (None when unknown or done)."""
        return self._owner.get(request_id)

    def finish(self, request_id: str) -> None:
        """The request finished or was aborted (unknown ids are ignored)."""
        replica = self._owner.pop(request_id, None)
        if replica is not None:
            self.replicas[replica].in_flight.discard(request_id)

    def update_kv_usage(self, replica: int, kv_cache_usage: float) -> None:
        self.replicas[replica].kv_cache_usage = kv_cache_usage

    def revive(self, replica: int) -> None:
        """``replica`` rejoined (a restarted remote rank): fresh state, nothing in flight, counts reset."""
        for rid in self.replicas[replica].in_flight:
            self._owner.pop(rid, None)
        self.replicas[replica] = ReplicaLoad()

    def mark_dead(self, replica: int) -> list[str]:
        """Take ``replica`` out of rotation.

        Returns:
            Its requests in flight (now forgotten), for the caller to fail.
        """
        r = self.replicas[replica]
        r.alive = False
        lost = sorted(r.in_flight)
        r.in_flight.clear()
        r.recent_prefixes.clear()
        for rid in lost:
            self._owner.pop(rid, None)
        return lost
