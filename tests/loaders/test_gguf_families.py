"""GGUF files of the families beyond test_gguf_tiny.py's, written with gguf-py as llama.cpp's
converter writes them (``convert_hf_to_gguf.py``: its metadata keys, tensor names and weight
transforms; the converter itself is not installed). The engine loads the file and must give
transformers' greedy tokens and logits of the HF model the file was written from (float32
tensors, so the file holds those weights exactly).

Gemma 2 (llama.cpp ``Gemma2Model``): norms stored as ``w + 1``, both soft caps and the sliding
window in ``gemma2.*`` keys, the even layers sliding; queries scaled by ``1/sqrt(head_dim)``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.loaders import load_config, resolve_model
from pagedllm.loaders import model_files

from test_gguf_tiny import _gguf_name, _sentencepiece_vocab, add_tokenizer, new_writer

MAX_NEW = 8


def _tiny_gemma2(vocab_size: int, ids: dict[str, int]):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                          sliding_window=8, attn_logit_softcapping=4.0, final_logit_softcapping=6.0,
                          max_position_embeddings=256, initializer_range=0.3, rms_norm_eps=1e-6,
                          bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():  # random norm offsets so the +1 shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model


def _write_gemma2_gguf(path: str):
    tokens, scores, types, ids = _sentencepiece_vocab("gemma3")  # Gemma's specials and byte tokens
    model = _tiny_gemma2(len(tokens), ids)
    cfg = model.config
    writer = new_writer(path, "gemma2", cfg)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)
    add_tokenizer(writer, tokens, types, ids, scores)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":  # tied: llama.cpp writes no output tensor
            continue
        data = tensor.detach().float().numpy().copy()
        name = _gguf_name(hf_name, "gemma3")  # Gemma 2 and 3 share the four-norm tensor names
        writer.add_tensor(name, data + 1 if name.endswith("norm.weight") else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="module")
def gemma2_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_gemma2")
    path = str(root / "tiny-gemma2.gguf")
    return path, _write_gemma2_gguf(path), str(root / "cache")


def test_gemma2_config_from_gguf(gemma2_gguf):
    path, model, cache = gemma2_gguf
    raw = load_config(resolve_model(path, cache_dir=cache).folder)
    cfg = model.config
    assert raw["architectures"] == ["Gemma2ForCausalLM"] and raw["model_type"] == "gemma2"
    for key in ("hidden_size", "num_key_value_heads", "head_dim", "vocab_size", "sliding_window", "layer_types",
                "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                "tie_word_embeddings", "hidden_activation"):
        assert raw[key] == getattr(cfg, key), key
    assert raw["rope_parameters"]["rope_theta"] == cfg.rope_parameters["rope_theta"]


def test_gemma2_gguf_runs_as_transformers(gemma2_gguf, monkeypatch, tmp_path):
    """Greedy tokens and every step's logits from the GGUF equal transformers' on the original."""
    path, model, _ = gemma2_gguf
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
    print(f"gemma2 gguf: max abs logit difference {diff:.2e}")
    assert diff < 2e-5 * max(1.0, float(ref_logits.abs().max())), diff
