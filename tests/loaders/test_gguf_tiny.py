"""GGUF conversion on tiny files written here with gguf.GGUFWriter, as llama.cpp's converter would
write them (Llama q/k rows permuted, Gemma norms stored as w + 1, mixed F32/F16/BF16/Q8_0/Q4_0/Q5_0
tensors). The converted folder must equal transformers' own GGUF loading bit for bit, and the
cache must be built once, atomically."""

from __future__ import annotations

import json
import os
import time

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagedllm.loaders import iterate_weights, load_config, resolve_model
from pagedllm.loaders import model_files
from pagedllm.loaders.gguf import compact_bpe_merges, read_gguf_header
from pagedllm.tokenizer import Tokenizer

TEXTS = [
    "hello world",
    "Hello World!",
    "  the world  ",
    "\nhello\n\nthe world\n",
    "in the hello, world.",
    "héllo wörld 🙂",
    "日本語 hello",
    "",
]

# HF per-layer names -> GGUF names (as llama.cpp's gguf-py tensor map writes them).
_LAYER_MAP = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "ffn_norm",
}
_GEMMA_LAYER_MAP = {
    **_LAYER_MAP,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _gguf_name(hf_name: str, arch: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    mapping = _GEMMA_LAYER_MAP if arch == "gemma3" else _LAYER_MAP
    return f"blk.{layer}.{mapping[module]}.{suffix}"


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF rotate-half -> interleaved rows)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _storage_type(arch: str, gguf_name: str) -> Q:
    """A mix of every float and a few block types, chosen per tensor."""
    if gguf_name.endswith("norm.weight") or gguf_name.endswith(".bias"):
        return Q.F32
    if ".attn_q." in gguf_name:
        return Q.F32  # exact: checks the un-permutation against the original weights
    if ".attn_k." in gguf_name:
        return Q.F16
    if ".attn_v." in gguf_name:
        return Q.BF16
    if ".ffn_up." in gguf_name:
        return Q.Q4_0
    if ".ffn_down." in gguf_name:
        return Q.Q5_0
    if gguf_name == "output.weight":
        return Q.F32
    return Q.Q8_0


def _sentencepiece_vocab(arch: str) -> tuple[list[str], list[float], list[int], dict[str, int]]:
    if arch == "gemma3":
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
        ids = {"pad": 0, "eos": 1, "bos": 2, "unk": 3}
    else:
        specials = ["<unk>", "<s>", "</s>"]
        ids = {"unk": 0, "bos": 1, "eos": 2}
    types = [2 if t == "<unk>" else 3 for t in specials]
    tokens = list(specials)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyzHW!,.", "▁t", "he", "▁the", "ll", "llo", "▁he", "▁hello",
              "or", "▁w", "▁wor", "ld", "▁world", "in", "▁in", "▁▁", "Hello", "▁Hello", "▁World"]
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types, ids


def _byte_level_vocab() -> tuple[list[str], list[int], list[str], dict[str, int]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "l l", "o r", "Ġ w", "Ġw or", "l d", "Ġwor ld", "i n", "Ġ h",
              "Ġh e", "Ġhe ll", "Ġhell o"]
    merged = [m.replace(" ", "") for m in merges]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = alphabet + merged + specials
    types = [1] * (len(alphabet) + len(merged)) + [3] * len(specials)
    eot = tokens.index("<|endoftext|>")
    return tokens, types, merges, {"eos": eot, "pad": eot, "bos": eot}


ARCHS = {
    # arch: (HF config kwargs, GGUF specifics)
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256,
                  rope_theta=50000.0, tie_word_embeddings=False),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=256,
                  rope_theta=1000000.0, tie_word_embeddings=True),
    # transformers' GGUF loader ignores qwen3.attention.key_length, so use its default head_dim 128
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=256,
                  rope_theta=1000000.0, tie_word_embeddings=True),
    "gemma3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=256,
                   sliding_window=16, query_pre_attn_scalar=32, tie_word_embeddings=True,
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


def _hf_model(arch: str, vocab_size: int, ids: dict[str, int], config_overrides: dict | None = None):
    import transformers

    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
               "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}
    config_cls, model_cls = (getattr(transformers, name) for name in classes[arch])
    config = config_cls(vocab_size=vocab_size, bos_token_id=ids.get("bos"), eos_token_id=ids["eos"],
                        pad_token_id=ids.get("pad"), **{**ARCHS[arch], **(config_overrides or {})})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # random norms (they init to 1 / 0) so the +1 offset shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn_like(param) * 0.1)
    return model


def new_writer(path: str, arch: str, cfg) -> gguf.GGUFWriter:
    """A GGUFWriter with the shape keys every llama.cpp architecture writes, from HF config ``cfg``."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return writer


def add_tokenizer(writer: gguf.GGUFWriter, tokens, types, ids, scores=None, merges=None,
                  chat_template: str | None = None) -> None:
    """The ``tokenizer.ggml.*`` keys: SentencePiece (``scores``) or byte-level BPE (``merges``),
    and ``tokenizer.chat_template`` when given."""
    writer.add_tokenizer_model("llama" if merges is None else "gpt2")
    writer.add_tokenizer_pre("default" if merges is None else "qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores)
    if merges is not None:
        writer.add_token_merges(merges)
    writer.add_bos_token_id(ids["bos"])
    writer.add_eos_token_id(ids["eos"])
    if "unk" in ids:
        writer.add_unk_token_id(ids["unk"])
    if "pad" in ids:
        writer.add_pad_token_id(ids["pad"])
    writer.add_add_bos_token(merges is None)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def write_tiny_gguf(arch: str, path: str, encode=None, config_overrides: dict | None = None,
                    chat_template: str | None = None):
    """Write a tiny ``arch`` model as llama.cpp would; returns the HF model it came from.

    ``encode(gguf_name, float32 array) -> (array, ggml type or None)`` overrides the per-tensor
    storage (:func:`_storage_type`); ``config_overrides`` update the HF config kwargs;
    ``chat_template`` is written as ``tokenizer.chat_template``.
    """
    if arch in ("llama", "gemma3"):
        tokens, scores, types, ids = _sentencepiece_vocab(arch)
        merges = None
    else:
        tokens, types, merges, ids = _byte_level_vocab()
        scores = None
    model = _hf_model(arch, len(tokens), ids, config_overrides)
    cfg = model.config
    writer = new_writer(path, arch, cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "gemma3":
        writer.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(cfg.sliding_window)
    else:
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        if arch == "llama":
            writer.add_rope_dimension_count(head_dim)
        else:
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
    add_tokenizer(writer, tokens, types, ids, scores, merges, chat_template)

    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf_name, tensor in state.items():
        name = _gguf_name(hf_name, arch)
        data = tensor.detach().float().numpy().copy()
        if arch == "llama" and ".attn_q." in name:
            data = _llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp's Gemma converter
        if encode is not None:
            array, raw_dtype = encode(name, data)
            writer.add_tensor(name, array, raw_dtype=raw_dtype)
            continue
        qtype = _storage_type(arch, name)
        if qtype == Q.F32:
            writer.add_tensor(name, data)
        elif qtype == Q.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="module", params=sorted(ARCHS))
def converted(request, tmp_path_factory):
    """(arch, gguf path, HF model it came from, ModelFiles) for each tiny architecture."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"tiny_{arch}")
    path = str(root / f"tiny-{arch}.gguf")
    model = write_tiny_gguf(arch, path)
    files = resolve_model(path, cache_dir=str(root / "cache"))
    return arch, path, model, files


@pytest.fixture(scope="module")
def hf_reference(converted):
    """transformers' own loading of the GGUF file: (model, config, tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _, path, _, _ = converted
    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, config, tokenizer


def test_folder_layout(converted):
    arch, path, _, files = converted
    assert files.gguf_path == path and files.source == path
    names = set(os.listdir(files.folder))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", model_files.CACHE_MARKER_NAME} <= names
    key = model_files.sha256_file(path)[:16]
    assert os.path.basename(files.folder) == key
    assert not [n for n in os.listdir(os.path.dirname(files.folder)) if n.startswith(".")]


def test_weights_equal_transformers_gguf_loading(converted, hf_reference):
    arch, _, _, files = converted
    ref_model, _, _ = hf_reference
    ours = dict(iterate_weights(files.folder))
    ref = ref_model.state_dict()
    tied = load_config(files.folder)["tie_word_embeddings"]
    assert set(ours) == set(ref) - ({"lm_head.weight"} if tied else set())
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, ref[name]), name
    if tied:
        assert torch.equal(ref["lm_head.weight"], ours["model.embed_tokens.weight"])


def test_weights_recover_the_original(converted):
    """F32/F16 tensors come back exactly (proves the q/k un-permutation and -1 norm offset)."""
    arch, path, model, files = converted
    ours = dict(iterate_weights(files.folder))
    types = {t.name: t.ggml_type for t in read_gguf_header(path).tensors}
    for hf_name, original in model.state_dict().items():
        if hf_name not in ours:
            continue
        qtype = types[_gguf_name(hf_name, arch)]
        if qtype == Q.F32 and arch == "gemma3" and "norm" in hf_name:
            # (w + 1) - 1 in float32 rounds w to the float32 grid near 1.0 (step 2**-23 ~ 1.2e-7)
            torch.testing.assert_close(ours[hf_name], original, atol=2e-7, rtol=0)
        elif qtype == Q.F32:
            assert torch.equal(ours[hf_name], original), hf_name
        elif qtype == Q.F16:
            assert torch.equal(ours[hf_name], original.half().float()), hf_name
        elif qtype == Q.BF16:
            assert torch.equal(ours[hf_name], original.bfloat16().float()), hf_name
        else:  # block-quantized: close to the original
            torch.testing.assert_close(ours[hf_name], original, atol=0.05, rtol=0.1)


_CONFIG_KEYS = [
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings",
    "tie_word_embeddings", "rope_parameters", "sliding_window", "layer_types", "query_pre_attn_scalar",
    "hidden_activation", "hidden_act", "final_logit_softcapping", "attn_logit_softcapping",
    "attention_bias", "use_sliding_window",
]


def test_config_matches_transformers(converted, hf_reference):
    """config.json, read back by transformers, equals transformers' config of the GGUF file."""
    from transformers import AutoConfig

    arch, _, model, files = converted
    _, ref_config, _ = hf_reference
    ours = AutoConfig.from_pretrained(files.folder)
    assert type(ours) is type(ref_config)
    raw = load_config(files.folder)
    assert raw["architectures"] == [type(model).__name__]
    for key in _CONFIG_KEYS:
        if hasattr(ref_config, key):
            expected = getattr(ref_config, key)
            if key == "query_pre_attn_scalar":
                # transformers' GGUF loader keeps Gemma3TextConfig's default 256 whatever the
                # head_dim; llama.cpp scales queries by 1/sqrt(head_dim) (hidden/heads for 27B).
                expected = raw["head_dim"]
            assert getattr(ours, key) == expected, key
            if key in raw and key != "rope_parameters":
                assert raw[key] == expected, key
    # and the shape fields equal the model the file was written from
    for key in ("hidden_size", "num_key_value_heads", "head_dim", "vocab_size"):
        if hasattr(model.config, key):
            assert raw[key] == getattr(model.config, key), key


def test_transformers_runs_the_converted_folder_like_the_gguf(converted, hf_reference):
    from transformers import AutoModelForCausalLM

    _, _, _, files = converted
    ref_model, _, _ = hf_reference
    ours = AutoModelForCausalLM.from_pretrained(files.folder, dtype=torch.float32).eval()
    if ours.config.model_type == "gemma3_text":  # see query_pre_attn_scalar above
        for layer in ref_model.model.layers:
            layer.self_attn.scaling = ours.config.query_pre_attn_scalar ** -0.5
    ids = torch.tensor([[1, 5, 9, 30, 200, 7, 3, 12]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref_model(ids).logits)


def test_tokenizer_matches_transformers(converted, hf_reference):
    from transformers import AutoTokenizer

    arch, _, _, files = converted
    _, _, ref_tok = hf_reference
    ours = Tokenizer.from_pretrained(files.folder)
    from_folder = AutoTokenizer.from_pretrained(files.folder)
    specials = "<|im_start|>hello<|im_end|>" if arch.startswith("qwen") else (
        "<start_of_turn>hello<end_of_turn>" if arch == "gemma3" else "<s>hello</s>")
    for text in [*TEXTS, specials]:
        expected = ref_tok.encode(text)
        assert ours.encode(text) == expected, text
        assert from_folder.encode(text) == expected, text
        assert ours.encode(text, add_special_tokens=False) == ref_tok.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert ours.decode(expected, skip_special_tokens=skip) == ref_tok.decode(
                expected, skip_special_tokens=skip), (text, skip)
        assert ours.convert_ids_to_tokens(expected) == ref_tok.convert_ids_to_tokens(expected)
    assert ours.vocab_size == len(ref_tok)
    assert ours.bos_token_id == ref_tok.bos_token_id
    assert ours.eos_token_id == ref_tok.eos_token_id
    assert set(ref_tok.all_special_ids) <= ours.all_special_ids
    assert ours.eos_token_ids[0] == ref_tok.eos_token_id
    if arch == "gemma3":
        assert ours.eos_token_ids == [1, ref_tok.convert_tokens_to_ids("<end_of_turn>")]
        assert ours.encode("hello")[0] == 2  # <bos> from the post-processor
    if arch.startswith("qwen"):
        assert ours.encode("hello")[0] != ours.bos_token_id  # Qwen adds no BOS


def test_tokenizer_file_is_transformers_own_with_compact_merges(converted, hf_reference):
    """The saved tokenizer.json loads to exactly transformers' tokenizer of the GGUF (the same
    canonical JSON), its BPE merges written as "a b" strings (``compact_bpe_merges``)."""
    import tokenizers

    _, _, _, files = converted
    _, _, ref_tok = hf_reference
    path = os.path.join(files.folder, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        model = json.load(f)["model"]
    loaded = tokenizers.Tokenizer.from_file(path)
    assert json.loads(loaded.to_str()) == json.loads(ref_tok.backend_tokenizer.to_str())
    if model["type"] == "BPE":
        assert model["merges"] and all(isinstance(m, str) and m.count(" ") == 1 for m in model["merges"])
        assert not compact_bpe_merges(path)   # already compact: left as is


def test_merges_holding_a_space_stay_pairs(tmp_path):
    spec = {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, " ": 1, "a ": 2, "b": 3, "ab": 4},
                                        "merges": [["a", " "], ["a", "b"]]}}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    assert not compact_bpe_merges(str(path))
    assert json.loads(path.read_text()) == spec
    spec["model"]["merges"] = [["a", "b"]]
    path.write_text(json.dumps(spec))
    assert compact_bpe_merges(str(path))
    assert json.loads(path.read_text())["model"]["merges"] == ["a b"]


def test_second_resolve_reuses_cache(converted):
    _, path, _, files = converted
    cache_dir = os.path.dirname(files.folder)
    before = {n: os.stat(os.path.join(files.folder, n)).st_mtime_ns for n in os.listdir(files.folder)}
    again = resolve_model(path, cache_dir=cache_dir)
    assert again == files
    after = {n: os.stat(os.path.join(files.folder, n)).st_mtime_ns for n in os.listdir(files.folder)}
    assert after == before


# --- cache behaviour (one architecture is enough) -------------------------------------------

@pytest.fixture()
def tiny_llama_gguf(tmp_path):
    path = str(tmp_path / "src" / "tiny.gguf")
    os.makedirs(os.path.dirname(path))
    write_tiny_gguf("llama", path)
    return path


def test_cache_dir_from_environment_and_gguf_folder(tiny_llama_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv(model_files.CACHE_DIR_ENV, str(tmp_path / "envcache"))
    files = resolve_model(os.path.dirname(tiny_llama_gguf))  # a folder holding only the .gguf
    assert files.folder.startswith(str(tmp_path / "envcache") + os.sep)
    assert files.gguf_path == tiny_llama_gguf


def test_failed_conversion_leaves_no_cache(tiny_llama_gguf, tmp_path, monkeypatch):
    def broken(gguf_path, out_dir, header=None):
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_files, "convert_gguf_to_hf_folder", broken)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model(tiny_llama_gguf, cache_dir=str(cache))
    assert os.listdir(cache) == []


def test_stale_converter_version_is_rebuilt(tiny_llama_gguf, tmp_path):
    cache = str(tmp_path / "cache")
    files = resolve_model(tiny_llama_gguf, cache_dir=cache)
    marker_path = os.path.join(files.folder, model_files.CACHE_MARKER_NAME)
    with open(marker_path) as f:
        marker = json.load(f)
    marker["converter_version"] = -1
    with open(marker_path, "w") as f:
        json.dump(marker, f)
    again = resolve_model(tiny_llama_gguf, cache_dir=cache)
    assert again.folder == files.folder
    with open(marker_path) as f:
        assert json.load(f)["converter_version"] == model_files.GGUF_CONVERTER_VERSION
    assert sorted(os.listdir(cache)) == [os.path.basename(files.folder)]


def test_unchanged_file_is_not_hashed_again(tiny_llama_gguf, tmp_path, monkeypatch):
    """A warm start takes the SHA-256 from the marker while the file's fingerprint is unchanged;
    a write (even one that restores size and mtime) changes the ctime, and the file is hashed."""
    cache = str(tmp_path / "cache")
    files = resolve_model(tiny_llama_gguf, cache_dir=cache)
    digest = model_files.sha256_file(tiny_llama_gguf)
    hashed = []
    real_sha256_file = model_files.sha256_file
    monkeypatch.setattr(model_files, "sha256_file", lambda path: hashed.append(path) or real_sha256_file(path))
    assert resolve_model(tiny_llama_gguf, cache_dir=cache) == files
    assert hashed == []
    assert model_files.recorded_sha256(tiny_llama_gguf, cache) == digest

    st = os.stat(tiny_llama_gguf)
    with open(tiny_llama_gguf, "r+b") as f:  # same bytes, same size, mtime put back
        data = f.read()
        f.seek(0)
        f.write(data)
    os.utime(tiny_llama_gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    if os.stat(tiny_llama_gguf).st_ctime_ns == st.st_ctime_ns:
        time.sleep(0.01)  # a coarse ctime clock: touch again
        os.utime(tiny_llama_gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_files.recorded_sha256(tiny_llama_gguf, cache) is None
    assert resolve_model(tiny_llama_gguf, cache_dir=cache) == files
    assert hashed == [tiny_llama_gguf]
    # the marker now holds the new fingerprint: the next start reads nothing again
    assert model_files.recorded_sha256(tiny_llama_gguf, cache) == digest
    assert resolve_model(tiny_llama_gguf, cache_dir=cache) == files
    assert hashed == [tiny_llama_gguf]
    assert not [n for n in os.listdir(files.folder) if n.startswith(".")]


def test_edited_file_misses_the_recorded_hash(tiny_llama_gguf, tmp_path):
    cache = str(tmp_path / "cache")
    files = resolve_model(tiny_llama_gguf, cache_dir=cache)
    with open(tiny_llama_gguf, "ab") as f:
        f.write(b"\0" * 32)  # padding after the tensor data: same model, other bytes
    assert model_files.recorded_sha256(tiny_llama_gguf, cache) is None
    again = resolve_model(tiny_llama_gguf, cache_dir=cache)
    assert os.path.basename(again.folder) == model_files.sha256_file(tiny_llama_gguf)[:16] != \
        os.path.basename(files.folder)


def test_unsupported_architecture_is_a_value_error(tmp_path):
    path = str(tmp_path / "x.gguf")
    writer = gguf.GGUFWriter(path, "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="mamba"):
        resolve_model(path, cache_dir=str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache") == []
