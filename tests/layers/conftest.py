"""A toy model with the attributes the linear-layer replacements read (``get_input_embeddings()``,
``get_lm_head()``, ``tie_word_embeddings``, ``packed_lm_head``)."""

import pytest
from torch import nn


class TiedToy(nn.Module):
    """Embedding [50, hidden] (the tied head) and one ``proj`` linear [out_features, hidden] with bias."""

    def __init__(self, out_features: int = 16, hidden: int = 16):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(50, hidden)
        self.model.proj = nn.Linear(hidden, out_features)
        self.tie_word_embeddings = True
        self.packed_lm_head = None

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_lm_head(self):
        return self.model.embed_tokens


@pytest.fixture
def tied_toy():
    """Factory: ``tied_toy(out_features=16, hidden=16)`` -> a fresh ``TiedToy``."""
    return TiedToy
