"""GGUF files of the families beyond test_gguf_tiny.py's, written with gguf-py as llama.cpp's
converter writes them (``convert_hf_to_gguf.py``: its metadata keys, gguf-py's own HF -> GGUF tensor
name map, its weight transforms; the converter itself is not installed). The engine loads the file
and must give transformers' greedy tokens and logits of the HF model the file was written from
(float32 tensors, so the file holds those weights exactly).

- Gemma 2 (``Gemma2Model``): norms stored as ``w + 1``, both soft caps and the sliding window in
  ``gemma2.*`` keys, the even layers sliding; queries scaled by ``1/sqrt(head_dim)``;
- OLMo 2 (``Olmo2Model``, a plain ``TextModel``): post-norms and whole-projection q/k norms as
  ``post_attention_norm`` / ``post_ffw_norm`` / ``attn_q_norm`` / ``attn_k_norm``, rows as in HF;
- Granite 3 (``GraniteModel(LlamaModel)``): q/k rows interleaved (``LlamaModel.permute``), the four
  multipliers as ``granite.{attention.scale, embedding_scale, residual_scale, logit_scale}``;
- Phi-3 (``Phi3MiniModel``): fused ``attn_qkv`` / ``ffn_up`` (gate and up) tensors, the rotary dim
  as ``rope.dimension_count``, LongRoPE factors as ``rope_factors_long`` / ``rope_factors_short``
  tensors with ``rope.scaling.{original_context_length, attn_factor}``.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.loaders import load_config, resolve_model
from pagedllm.loaders import model_files

from test_gguf_tiny import _byte_level_vocab, _llama_cpp_permute, _sentencepiece_vocab, add_tokenizer, new_writer

MAX_NEW = 8


SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, rms_norm_eps=1e-6)


def _hf_config(family: str, vocab_size: int, ids: dict[str, int]):
    import transformers as tf

    common = dict(SHAPE, vocab_size=vocab_size, bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                  pad_token_id=ids["pad"])
    if family == "gemma2":
        return tf.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                               attn_logit_softcapping=4.0, final_logit_softcapping=6.0)
    if family == "olmo2":
        return tf.Olmo2Config(**common, tie_word_embeddings=False)
    if family == "phi3":   # LongRoPE (within its original context), partial rotary, a window on every layer
        short = [1.0, 1.3, 1.9, 2.6, 3.5, 5.0]
        return tf.Phi3Config(**{**common, "max_position_embeddings": 1024}, original_max_position_embeddings=256,
                             sliding_window=8, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
                                              "long_factor": [x * 4 for x in short], "partial_rotary_factor": 0.75})
    return tf.GraniteConfig(**common, embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.05,
                            logits_scaling=4.0, tie_word_embeddings=True)


def _add_family_keys(writer: gguf.GGUFWriter, family: str, cfg) -> None:
    """The keys llama.cpp's converter class of ``family`` writes beyond the shape keys."""
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if family == "gemma2":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    elif family == "phi3":
        rope = cfg.rope_parameters
        writer.add_rope_dimension_count(int(rope["partial_rotary_factor"] * cfg.hidden_size) // cfg.num_attention_heads)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_sliding_window(cfg.sliding_window or 0)
        scale = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(
            rope["original_max_position_embeddings"])))
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    elif family == "granite":
        writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)


def _write_gguf(family: str, path: str):
    """Write a tiny random ``family`` model as llama.cpp would; returns the HF model."""
    from transformers import AutoModelForCausalLM

    if family == "gemma2":
        tokens, scores, types, ids = _sentencepiece_vocab("gemma3")  # Gemma's specials and byte tokens
        merges = None
    else:
        (tokens, types, merges, ids), scores = _byte_level_vocab(), None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(family, len(tokens), ids), dtype=torch.float32).eval()
    with torch.no_grad():  # random norms (Gemma: offsets from 1) so the transforms show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if family == "gemma2" else 1.0, 0.3)
    cfg = model.config
    writer = new_writer(path, family, cfg)
    _add_family_keys(writer, family, cfg)
    add_tokenizer(writer, tokens, types, ids, scores, merges)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[family.upper()], cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:  # llama.cpp writes no output tensor
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = tensor.detach().float().numpy().copy()
        if family == "gemma2" and name.endswith("norm.weight"):
            data = data + 1
        elif family == "granite" and ".attn_q." in name:
            data = _llama_cpp_permute(data, cfg.num_attention_heads)
        elif family == "granite" and ".attn_k." in name:
            data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="module", params=["gemma2", "olmo2", "granite", "phi3"])
def written(request, tmp_path_factory):
    """(family, gguf path, HF model it came from, cache folder)."""
    root = tmp_path_factory.mktemp(f"gguf_{request.param}")
    path = str(root / f"tiny-{request.param}.gguf")
    return request.param, path, _write_gguf(request.param, path), str(root / "cache")


_FAMILY_KEYS = {
    "gemma2": ("head_dim", "sliding_window", "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
               "query_pre_attn_scalar", "hidden_activation"),
    "olmo2": ("hidden_act",),
    "phi3": ("sliding_window", "original_max_position_embeddings"),
    "granite": ("attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling"),
}


def test_config_from_gguf(written):
    family, path, model, cache = written
    raw = load_config(resolve_model(path, cache_dir=cache).folder)
    cfg = model.config
    assert raw["architectures"] == [type(model).__name__] and raw["model_type"] == cfg.model_type
    for key in ("hidden_size", "num_key_value_heads", "vocab_size", "tie_word_embeddings", *_FAMILY_KEYS[family]):
        assert raw[key] == pytest.approx(getattr(cfg, key)) if isinstance(raw[key], float) \
            else raw[key] == getattr(cfg, key), key
    assert raw["rope_parameters"]["rope_theta"] == cfg.rope_parameters["rope_theta"]
    if family == "phi3":
        for key in ("rope_type", "partial_rotary_factor", "original_max_position_embeddings"):
            assert raw["rope_parameters"][key] == cfg.rope_parameters[key], key
        for key in ("short_factor", "long_factor"):
            assert raw["rope_parameters"][key] == pytest.approx(cfg.rope_parameters[key], rel=1e-7), key


def test_gguf_runs_as_transformers(written, monkeypatch, tmp_path):
    """Greedy tokens and every step's logits from the GGUF equal transformers' on the original."""
    family, path, model, _ = written
    monkeypatch.setenv(model_files.CACHE_DIR_ENV, str(tmp_path / "cache"))
    hf = model.float().eval()
    hf.config._attn_implementation = "eager"   # the attention that applies the soft cap
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(3, hf.config.vocab_size, size=30)]
    x = torch.tensor([prompt])
    with torch.inference_mode():
        ref_ids = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        ref_logits = hf(torch.tensor([prompt + ref_ids[:-1]])).logits[0, len(prompt) - 1:]
    llm = LLM(path, dtype="float32", max_model_len=64, kv_cache_memory_bytes=8 << 20, exact_greedy_head="off")
    lm = llm.llm_engine.executor.driver_worker.model
    steps: list[torch.Tensor] = []
    head = lm.compute_logits
    lm.compute_logits = lambda h: steps.append(head(h).clone()) or steps[-1]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                                                    ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref_ids
    ours = torch.cat(steps)
    assert ours.shape == ref_logits.shape
    diff = float((ours - ref_logits).abs().max())
    print(f"{family} gguf: max abs logit difference {diff:.2e}")
    assert diff < 2e-5 * max(1.0, float(ref_logits.abs().max())), diff
