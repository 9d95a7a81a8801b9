"""N-gram prompt lookup (vLLM's ``method="ngram"``; Saxena 2023, "Prompt Lookup Decoding").

The longest suffix of the request's tokens, between ``prompt_lookup_min`` and
``prompt_lookup_max`` tokens long, that occurred earlier in its prompt or output is matched, and
the tokens that followed its most recent earlier occurrence are the drafts. Good where the output
quotes its input: summaries, edits, code completion, extraction, multi-turn chat.
"""

from __future__ import annotations

import numpy as np

from pagedllm.spec_decode.proposer import Proposer, earlier_matches


class NgramProposer(Proposer):
    """Prompt lookup over the request's own tokens (no state between steps).

    Args:
        prompt_lookup_min: shortest n-gram matched (tokens, >= 1).
        prompt_lookup_max: longest n-gram matched (tokens, >= prompt_lookup_min).
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        """The tokens after the most recent earlier occurrence of the longest matching suffix
        n-gram (longest n first), at most ``max_tokens``; [] without a match."""
        tokens = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
        for n in range(min(self.prompt_lookup_max, len(tokens) - 1), self.prompt_lookup_min - 1, -1):
            starts = earlier_matches(tokens, n)
            if len(starts):
                follow = int(starts[-1]) + n
                return tokens[follow: follow + max_tokens].tolist()
        return []
