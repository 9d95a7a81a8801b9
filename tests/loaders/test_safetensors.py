"""Safetensors folders: iterate_weights equals the saved state dict; resolve_model/load_config
on plain folders; the streaming writer. Tiny random checkpoints made with transformers."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from pagedllm.loaders import ModelFiles, iterate_weights, load_config, resolve_model
from pagedllm.loaders.safetensors import TensorSpec, list_safetensors_files, write_safetensors_streaming


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def _tiny_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(1)
    config = Gemma3TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8)
    return Gemma3ForCausalLM(config).eval()


def _expected_state_dict(model) -> dict[str, torch.Tensor]:
    """What save_pretrained writes: the state dict minus a tied lm_head."""
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


@pytest.mark.parametrize("make_model", [_tiny_llama, _tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["single", "sharded"])
def test_iterate_weights_equals_state_dict(tmp_path, make_model, max_shard_size):
    model = make_model()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(tmp_path, **kwargs)
    if max_shard_size is not None:
        assert os.path.isfile(tmp_path / "model.safetensors.index.json")
        assert len(list_safetensors_files(str(tmp_path))) > 1

    expected = _expected_state_dict(model)
    got = dict(iterate_weights(str(tmp_path)))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name

    files = resolve_model(str(tmp_path))
    assert files == ModelFiles(folder=str(tmp_path), source=str(tmp_path), gguf_path=None)
    config = load_config(files.folder)
    assert config["model_type"] == model.config.model_type
    assert config["hidden_size"] == 32


def test_resolve_model_rejects_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(empty))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="safetensors"):
        resolve_model(str(no_weights))
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="not a GGUF"):
        resolve_model(str(not_gguf))
    with pytest.raises(ValueError, match="config.json"):
        load_config(str(empty))
    (empty / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_config(str(empty))


def test_sharded_index_naming_missing_shard_is_rejected(tmp_path):
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="do not exist"):
        list(iterate_weights(str(tmp_path)))


def test_streaming_writer_round_trips(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "a.weight": torch.randn(3, 5),
        "b.bias": torch.randn(7).to(torch.bfloat16),
        "c.half": torch.randn(2, 2, 2).to(torch.float16),
        "d.ids": torch.arange(6, dtype=torch.int64),
    }
    specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    path = str(tmp_path / "model.safetensors")
    nbytes = write_safetensors_streaming(path, specs, iter(tensors.values()))
    assert nbytes == os.path.getsize(path)
    loaded = load_file(path)
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name], tensor), name


def test_streaming_writer_checks_specs(tmp_path):
    path = str(tmp_path / "x.safetensors")
    spec = TensorSpec("w", torch.float32, (2, 2))
    with pytest.raises(ValueError, match="spec says"):
        write_safetensors_streaming(path, [spec], [torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="missing 'w'"):
        write_safetensors_streaming(path, [spec], [])
    with pytest.raises(ValueError, match="more tensors"):
        write_safetensors_streaming(path, [spec], [torch.zeros(2, 2), torch.zeros(1)])
    with pytest.raises(ValueError, match="duplicate"):
        write_safetensors_streaming(path, [spec, spec], [torch.zeros(2, 2)] * 2)
