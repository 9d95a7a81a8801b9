"""RoPE cos/sin (pagedllm/layers/rotary.py): the per-position table gives bitwise the values
transformers' rotary embedding computes for the same positions."""

import pytest
import torch

from pagedllm.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("theta", [10000.0, 1_000_000.0])
def test_table_rows_equal_transformers(dtype, theta):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_theta=theta,
                      max_position_embeddings=4096)
    hf = LlamaRotaryEmbedding(cfg)
    ours = RotaryEmbedding(64, theta)
    # A decode-like step, a prompt chunk, and a position past the table's first size (it grows).
    for positions in (torch.tensor([0, 7, 130]), torch.arange(40, 300), torch.tensor([3000, 2])):
        cos, sin = ours(positions, dtype)
        assert cos.shape == (len(positions), 1, 64) and cos.dtype == dtype
        x = torch.zeros(1, len(positions), 64, dtype=dtype)
        hf_cos, hf_sin = hf(x, positions[None])
        assert torch.equal(cos[:, 0], hf_cos[0]) and torch.equal(sin[:, 0], hf_sin[0])
    assert ours._table[dtype][0].shape[0] == 4096   # grown to the next power of two past 3000


def test_empty_positions():
    cos, sin = RotaryEmbedding(32, 10000.0)(torch.empty(0, dtype=torch.int64), torch.float32)
    assert cos.shape == (0, 1, 32) and sin.shape == (0, 1, 32)
