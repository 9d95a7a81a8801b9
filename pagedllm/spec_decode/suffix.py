"""Suffix decoding (vLLM's ``method="suffix"``; Oliaro et al. 2024, "SuffixDecoding", as in
Snowflake's Arctic Inference).

Two sources of continuations: the request's own tokens (prompt and output so far) and the outputs
of earlier requests (up to ``max_cached_requests``, oldest evicted first). In each, the longest
suffix of the request's tokens (fewer than ``max_tree_depth`` tokens) that occurred before is
matched; its occurrences are the candidate continuations. The draft walks them token by token,
taking the most frequent next token among the occurrences still consistent with the draft; each
token's estimated probability is the product along the path of (occurrences agreeing / occurrences
alive), and the walk stops below ``min_token_prob``, at ``max_spec_factor`` x the match length, or
where match + draft reach ``max_tree_depth`` (Arctic's tree depth bounds both). The source whose
draft has the larger expected number of accepted tokens (the sum of the path probabilities) wins.

Arctic keeps suffix trees; the same counts are read here straight from the token arrays (numpy
matching over the request's tokens; a trigram index over the cached outputs), so memory is one
entry per cached output token.
"""

from __future__ import annotations

from collections import Counter, deque

import numpy as np

from pagedllm.spec_decode.proposer import Proposer, earlier_matches

# Tokens of context that key the index of cached outputs (a match is at least this long there).
_INDEX_KEY_LEN = 3
# Most recent occurrences of a key examined per proposal.
_MAX_CANDIDATES = 256


def _walk(occurrences: list[tuple[np.ndarray, int]], max_len: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent continuation of ``occurrences`` ((tokens, index of the first token after
    the match)), at most ``max_len`` tokens, each with path probability >= ``min_prob``.

    Returns:
        (draft tokens, expected accepted tokens = sum of their path probabilities).
    """
    draft: list[int] = []
    prob, score = 1.0, 0.0
    alive = occurrences
    while len(draft) < max_len and alive:
        nexts = Counter(int(seq[p]) for seq, p in alive if p < len(seq))
        if not nexts:
            break
        token, count = nexts.most_common(1)[0]
        prob *= count / len(alive)
        if prob < min_prob:
            break
        draft.append(token)
        score += prob
        alive = [(seq, p + 1) for seq, p in alive if p < len(seq) and seq[p] == token]
    return draft, score


class SuffixDecodingProposer(Proposer):
    """Suffix decoding over the request's tokens and earlier requests' outputs.

    Args:
        max_tree_depth: match + draft length bound (tokens).
        max_cached_requests: finished requests whose outputs are kept (0: none).
        max_spec_factor: at most this many draft tokens per matched token.
        min_token_prob: the path probability below which a draft stops.
    """

    def __init__(self, max_tree_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float) -> None:
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        # Cached outputs: id -> tokens; key (the _INDEX_KEY_LEN tokens before a position) -> [(id, position)].
        self._outputs: dict[int, np.ndarray] = {}
        self._order: deque[int] = deque()
        self._index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self._next_id = 0

    def _max_draft(self, match_len: int, max_tokens: int) -> int:
        return min(max_tokens, int(self.max_spec_factor * match_len), self.max_tree_depth - match_len)

    def _own(self, tokens: np.ndarray, max_tokens: int) -> tuple[list[int], float]:
        """The draft from the request's own earlier tokens (longest match by bisection: a suffix
        that occurred before has every shorter suffix occurring before too)."""
        lo, hi = 0, min(self.max_tree_depth - 1, len(tokens) - 1)
        starts = np.empty(0, dtype=np.int64)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = earlier_matches(tokens, mid)
            if len(found):
                lo, starts = mid, found
            else:
                hi = mid - 1
        if lo == 0:
            return [], 0.0
        if len(starts) == 0:
            starts = earlier_matches(tokens, lo)
        return _walk([(tokens, int(s) + lo) for s in starts[-_MAX_CANDIDATES:]], self._max_draft(lo, max_tokens),
                     self.min_token_prob)

    def _cached(self, tokens: np.ndarray, max_tokens: int) -> tuple[list[int], float]:
        """The draft from the cached outputs of earlier requests."""
        if len(tokens) < _INDEX_KEY_LEN or not self._index:
            return [], 0.0
        candidates = self._index.get(tuple(tokens[-_INDEX_KEY_LEN:].tolist()), [])[-_MAX_CANDIDATES:]
        if not candidates:
            return [], 0.0
        limit = min(self.max_tree_depth - 1, len(tokens))
        best, occurrences = 0, []
        for out_id, pos in candidates:
            seq = self._outputs[out_id]
            n = _INDEX_KEY_LEN
            while n < limit and n < pos and seq[pos - n - 1] == tokens[-n - 1]:
                n += 1
            if n > best:
                best, occurrences = n, [(seq, pos)]
            elif n == best:
                occurrences.append((seq, pos))
        return _walk(occurrences, self._max_draft(best, max_tokens), self.min_token_prob)

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        tokens = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
        own, own_score = self._own(tokens, max_tokens)
        cached, cached_score = self._cached(tokens, max_tokens)
        return cached if cached_score > own_score else own

    def finish_request(self, request_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        """Keep the request's output (its tokens after the prompt) for later requests."""
        if self.max_cached_requests == 0 or len(token_ids) - num_prompt_tokens <= _INDEX_KEY_LEN:
            return
        seq = np.asarray(token_ids[num_prompt_tokens:], dtype=np.int64)
        out_id = self._next_id
        self._next_id += 1
        self._outputs[out_id] = seq
        self._order.append(out_id)
        values = seq.tolist()
        for pos in range(_INDEX_KEY_LEN, len(values)):
            self._index.setdefault(tuple(values[pos - _INDEX_KEY_LEN: pos]), []).append((out_id, pos))
        while len(self._order) > self.max_cached_requests:
            self._evict(self._order.popleft())

    def _evict(self, out_id: int) -> None:
        values = self._outputs.pop(out_id).tolist()
        for pos in range(_INDEX_KEY_LEN, len(values)):
            key = tuple(values[pos - _INDEX_KEY_LEN: pos])
            entries = [e for e in self._index.get(key, ()) if e[0] != out_id]
            if entries:
                self._index[key] = entries
            else:
                self._index.pop(key, None)

    @property
    def num_cached_requests(self) -> int:
        return len(self._outputs)
