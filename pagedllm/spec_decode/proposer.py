"""The proposer interface: draft tokens for a request from what it has generated so far.

A proposer in this module's sense runs in the engine process, next to the scheduler, on token ids
only (no torch, no model): n-gram prompt lookup and suffix decoding. Draft models run on the
worker instead (``spec_decode/draft_model.py``) and send their drafts back with the step's output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class Proposer(ABC):
    """Proposes draft tokens; the target model verifies them in the next step."""

    @abstractmethod
    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` draft tokens to follow ``token_ids``.

        Args:
            request_id: the request (a proposer may keep state per request).
            token_ids: the request's prompt followed by its outputs (read-only).
            max_tokens: most drafts wanted (>= 1).
        Returns:
            The drafts (possibly empty: nothing to propose).
        """

    def finish_request(self, request_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        """The request finished (or was aborted); ``token_ids`` is its prompt + outputs. Drop its
        state; a proposer that learns from earlier requests keeps its outputs."""


def earlier_matches(tokens: np.ndarray, n: int) -> np.ndarray:
    """Start positions ``i`` of the earlier occurrences of the last ``n`` tokens that are followed
    by at least one token (``i + n < len(tokens)``), in increasing order.

    Args:
        tokens: [L] int64 token ids.
        n: n-gram length (tokens), 1 <= n < L.
    Returns:
        [M] int64 positions.
    """
    length = len(tokens)
    if n < 1 or n >= length:
        return np.empty(0, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)   # [L - n, n]
    hits = (windows == tokens[length - n:]).all(axis=1)
    return np.flatnonzero(hits)
