"""A test proposer that knows a reference continuation and corrupts some of its drafts, so that
verification sees accepted prefixes of every length and rejections at every position."""

from __future__ import annotations

import random

from pagedllm.spec_decode.proposer import Proposer


class OracleProposer(Proposer):
    """Drafts the reference continuation of each known prompt, each draft token replaced by
    another with probability ``wrong`` (seeded).

    Args:
        references: (prompt token ids, reference output token ids) pairs.
        wrong: probability of corrupting each draft token.
        vocab_size: corrupted tokens stay below it.
    """

    def __init__(self, references: list[tuple[list[int], list[int]]], wrong: float = 0.3,
                 vocab_size: int = 300, seed: int = 0) -> None:
        self.references = references
        self.wrong = wrong
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.num_proposed = 0

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        for prompt, ref in self.references:
            if token_ids[:len(prompt)] == prompt:
                done = len(token_ids) - len(prompt)
                drafts = list(ref[done:done + max_tokens])
                for j in range(len(drafts)):
                    if self.rng.random() < self.wrong:
                        drafts[j] = (drafts[j] + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
                self.num_proposed += len(drafts)
                return drafts
        return []
