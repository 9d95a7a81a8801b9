"""The default model (Gemma 3 270M Q4_K_M GGUF): converted once into a temporary cache, then
compared with transformers' own GGUF loading (weights bit for bit, config, tokenizer).

Costs ~1.5 min on 2 cores: our conversion ~15 s; transformers' reference ~60 s, most of it
``gguf.GGUFReader`` parsing the 262k-token vocabulary (cached across the reference calls below so
it runs once instead of three times).
"""

from __future__ import annotations

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

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    " one leading space",
    "line one\nline two\n\n\ttabbed\r\n",
    "emoji 🙂👍🏽 and 🇫🇷 flags",
    "日本語のテキストと中文文本",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad> literal special tokens",
    "numbers 1234567890 and code: def f(x): return x**2",
    "",
    " ",
]


@pytest.fixture(scope="module")
def default_files(tmp_path_factory):
    cache_dir = str(tmp_path_factory.mktemp("pagedllm_cache"))
    t0 = time.perf_counter()
    files = resolve_model(None, cache_dir=cache_dir)
    seconds = time.perf_counter() - t0
    logger.info("first resolve_model(None) (conversion) took %.2f s", seconds)
    return files, cache_dir, seconds


@pytest.fixture(scope="module")
def hf_reference(hf_default_model):
    """transformers' GGUF loading of the same file: (state_dict, config, tokenizer)."""
    model, tokenizer, config = hf_default_model
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return state, config, tokenizer


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


def test_weights_equal_transformers(default_files, hf_reference):
    files, _, _ = default_files
    ref_state, _, _ = hf_reference
    ours = dict(iterate_weights(files.folder))
    assert len(ours) == 236
    assert set(ours) == set(ref_state) - {"lm_head.weight"}  # tied to the embedding
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert tensor.shape == ref_state[name].shape, name
        assert torch.equal(tensor, ref_state[name]), name
    assert torch.equal(ref_state["lm_head.weight"], ours["model.embed_tokens.weight"])
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


def test_config_matches_transformers(default_files, hf_reference):
    from transformers import AutoConfig

    files, _, _ = default_files
    _, ref_config, _ = hf_reference
    raw = load_config(files.folder)
    ref = ref_config.to_dict()
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
    reread = AutoConfig.from_pretrained(files.folder).to_dict()
    for key in _GEMMA3_KEYS:
        assert reread[key] == ref[key], key


def test_tokenizer_matches_transformers(default_files, hf_reference):
    from transformers import AutoTokenizer

    files, _, _ = default_files
    _, _, ref_tok = hf_reference
    ours = Tokenizer.from_pretrained(files.folder)
    from_folder = AutoTokenizer.from_pretrained(files.folder)
    for text in TEXTS:
        expected = ref_tok.encode(text)
        assert ours.encode(text) == expected, text
        assert from_folder.encode(text) == expected, text
        assert ours.encode(text, add_special_tokens=False) == ref_tok.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert ours.decode(expected, skip_special_tokens=skip) == ref_tok.decode(
                expected, skip_special_tokens=skip), (text, skip)
        assert ours.convert_ids_to_tokens(expected) == ref_tok.convert_ids_to_tokens(expected)
    assert ours.encode("Hello")[0] == 2  # <bos>, added by tokenizer.json's post-processor
    assert ours.decode(ours.encode(" x  y\n")) == " x  y\n"
    assert ours.bos_token_id == ref_tok.bos_token_id == 2
    assert ours.eos_token_id == ref_tok.eos_token_id == 1
    assert ours.pad_token_id == ref_tok.pad_token_id == 0
    end_of_turn = ref_tok.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn == 106
    assert ours.eos_token_ids == [1, 106]
    assert ours.vocab_size == len(ref_tok) == 262144
    assert set(ref_tok.all_special_ids) <= ours.all_special_ids
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
