"""The default model (Gemma 3 270M Q4_K_M GGUF): converted once into a temporary cache, then
compared with transformers' own GGUF loading (weights bit for bit, config, tokenizer), recorded in
tests/golden/default_model.json by tests/golden/record_default_model.py (transformers' load takes
~60 s and ~2 GB, so the suite reads what it gave instead of loading it again).

Our conversion takes ~15 s on 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

import pytest
import torch

from pagedllm.loaders import iterate_weights, load_config, resolve_model
from pagedllm.loaders.model_files import CACHE_MARKER_NAME
from pagedllm.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
logger = logging.getLogger(__name__)



def tensor_sha256(tensor: torch.Tensor) -> str:
    """As the recording script hashes: sha256 of the float32 bytes, C order."""
    return hashlib.sha256(tensor.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def default_files(tmp_path_factory):
    cache_dir = str(tmp_path_factory.mktemp("pagedllm_cache"))
    t0 = time.perf_counter()
    files = resolve_model(None, cache_dir=cache_dir)
    seconds = time.perf_counter() - t0
    logger.info("first resolve_model(None) (conversion) took %.2f s", seconds)
    return files, cache_dir, seconds


def test_cache_layout(default_files):
    files, cache_dir, _ = default_files
    assert files.source == "default"
    assert files.gguf_path.endswith("gemma-3-270m-q4_k_m.gguf")
    assert os.path.dirname(files.folder) == cache_dir
    assert os.path.basename(files.folder) == "a5fd3b62230aa5ec"  # sha256 of the file, 16 hex digits
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", CACHE_MARKER_NAME):
        assert os.path.isfile(os.path.join(files.folder, name)), name
    assert sorted(os.listdir(cache_dir)) == ["a5fd3b62230aa5ec"]  # no temp folders left


def test_reference_is_of_this_file(default_files, default_model_reference):
    files, _, _ = default_files
    with open(files.gguf_path, "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == default_model_reference["gguf_sha256"]


def test_weights_equal_transformers(default_files, default_model_reference):
    files, _, _ = default_files
    ref = default_model_reference["weights"]
    ours = dict(iterate_weights(files.folder))
    assert len(ours) == 236
    assert set(ours) == set(ref) - {"lm_head.weight"}  # tied to the embedding
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert list(tensor.shape) == ref[name]["shape"], name
        assert tensor_sha256(tensor) == ref[name]["sha256"], name  # bit for bit
    assert ref["lm_head.weight"] == ref["model.embed_tokens.weight"]
    assert ours["model.embed_tokens.weight"].shape == (262144, 640)
    # llama.cpp stored Gemma norms as w + 1; the converted ones are centred near 0, not 1
    assert ours["model.norm.weight"].abs().mean() < ours["model.norm.weight"].add(1).abs().mean()


_GEMMA3_KEYS = [
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "sliding_window",
    "layer_types", "max_position_embeddings", "vocab_size", "query_pre_attn_scalar",
    "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias", "use_bidirectional_attention",
]


def test_config_matches_transformers(default_files, default_model_reference):
    from transformers import AutoConfig

    files, _, _ = default_files
    raw = load_config(files.folder)
    ref = default_model_reference["config"]
    assert raw["architectures"] == ["Gemma3ForCausalLM"]
    for key in _GEMMA3_KEYS:
        assert raw[key] == ref[key], key
    assert raw["rope_theta"] == 1_000_000.0 and raw["rope_local_base_freq"] == 10_000.0
    assert raw["rope_parameters"] == {
        "full_attention": {"rope_theta": 1_000_000.0, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
    }
    assert raw["layer_types"].count("full_attention") == 3 and raw["sliding_window"] == 512
    # transformers reads our config.json back into the same config
    reread = json.loads(AutoConfig.from_pretrained(files.folder).to_json_string(use_diff=False))
    for key in _GEMMA3_KEYS:
        assert reread[key] == ref[key], key


def test_tokenizer_matches_transformers(default_files, default_model_reference):
    from transformers import AutoTokenizer

    files, _, _ = default_files
    ref = default_model_reference["tokenizer"]
    ours = Tokenizer.from_pretrained(files.folder)
    from_folder = AutoTokenizer.from_pretrained(files.folder)
    assert len(ref["texts"]) == 12
    for case in ref["texts"]:
        text, expected = case["text"], case["ids"]
        assert ours.encode(text) == expected, text
        assert from_folder.encode(text) == expected, text
        assert ours.encode(text, add_special_tokens=False) == case["ids_no_special"], text
        assert ours.decode(expected, skip_special_tokens=False) == case["decode"], text
        assert ours.decode(expected, skip_special_tokens=True) == case["decode_skip_special"], text
        assert ours.convert_ids_to_tokens(expected) == case["tokens"], text
    assert ours.encode("Hello")[0] == 2  # <bos>, added by tokenizer.json's post-processor
    assert ours.decode(ours.encode(" x  y\n")) == " x  y\n"
    assert ours.bos_token_id == ref["bos_token_id"] == 2
    assert ours.eos_token_id == ref["eos_token_id"] == 1
    assert ours.pad_token_id == ref["pad_token_id"] == 0
    assert ref["end_of_turn_id"] == 106
    assert ours.eos_token_ids == [1, 106]
    assert ours.vocab_size == ref["len"] == 262144
    assert set(ref["all_special_ids"]) <= ours.all_special_ids
    assert ours.chat_template is None  # this GGUF carries no tokenizer.chat_template


def test_second_resolve_is_fast_and_reuses_cache(default_files):
    files, cache_dir, first_seconds = default_files
    mtimes = {n: os.stat(os.path.join(files.folder, n)).st_mtime_ns for n in os.listdir(files.folder)}

    t0 = time.perf_counter()
    again = resolve_model(None, cache_dir=cache_dir)
    resolve_seconds = time.perf_counter() - t0
    tokenizer = Tokenizer.from_pretrained(again.folder)
    count = 0
    for _, tensor in iterate_weights(again.folder):
        count += 1
        assert tensor.dtype == torch.float32
    total_seconds = time.perf_counter() - t0

    assert again == files
    assert count == 236 and tokenizer.vocab_size == 262144
    assert resolve_seconds < 2.0
    after = {n: os.stat(os.path.join(files.folder, n)).st_mtime_ns for n in os.listdir(files.folder)}
    assert after == mtimes
    logger.info("first conversion %.2f s; second resolve %.2f s; resolve + tokenizer + iterate all "
                "weights %.2f s", first_seconds, resolve_seconds, total_seconds)
