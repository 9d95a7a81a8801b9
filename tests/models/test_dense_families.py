"""Dense families beyond Llama / Qwen / Gemma 3 against transformers, float32, on tiny random
checkpoints built here from transformers' config classes with every family quirk switched on:

- Gemma 2: attention-logit and final-logit soft caps small enough to bend the scores, sliding
  windows (8 tokens) shorter than the prompts, sandwich norms with random weights;
- OLMo 2: q/k RMSNorm over the whole projections, norms after attention and MLP;
- Granite 3: embedding / residual / attention multipliers and logits scaling far from 1;
- SmolLM3: NoPE layers (no RoPE) that are also sliding-window layers;
- Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj tensors, partial rotary (3/4 of each head),
  LongRoPE's short factors and attention factor, a sliding window on every layer, tied or not;
- Llama with RoPE scaling "yarn" (and "linear", "llama3"), short original contexts so the
  scaling changes the frequencies the prompts use; "dynamic" within its context (plain RoPE there).

For each: the engine's batched greedy tokens equal transformers' ``generate`` on each prompt alone,
and the logits of every step of one request (prefill's last position, then each decode) are within
``LOGIT_RTOL`` x max |logit| of transformers' full forward over the same tokens (max abs difference
asserted). Unsupported architectures and config fields are ``ValueError``s naming what is supported.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig

MAX_NEW = 10
# float32: max abs difference of any logit at any step, relative to the largest |logit| (about 10
# here). Sum-order noise alone (eager torch ops against transformers') measures ~4e-6 of it.
LOGIT_RTOL = 2e-5
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3,
              bos_token_id=2, eos_token_id=1, pad_token_id=0)
SLIDING = ["sliding_attention", "full_attention"] * 2


def _config(family: str, vocab: int):
    import transformers as tf

    common = {**COMMON, "vocab_size": vocab}
    if family == "gemma2":
        return tf.Gemma2Config(**common, head_dim=16, sliding_window=8, layer_types=SLIDING,
                               query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
                               final_logit_softcapping=6.0, tie_word_embeddings=True)
    if family == "olmo2":
        return tf.Olmo2Config(**common, tie_word_embeddings=False, rms_norm_eps=1e-6)
    if family == "granite":
        return tf.GraniteConfig(**common, embedding_multiplier=3.0, residual_multiplier=0.4,
                                attention_multiplier=0.05, logits_scaling=4.0, attention_bias=True,
                                tie_word_embeddings=True)
    if family == "smollm3":
        return tf.SmolLM3Config(**common, no_rope_layers=[1, 0, 1, 0], use_sliding_window=True,
                                sliding_window=8, layer_types=["full_attention", "sliding_attention"] * 2,
                                tie_word_embeddings=False)
    if family == "phi3":   # Phi-3 128k style: LongRoPE (within its original context), partial rotary
        short = [1.0, 1.3, 1.9, 2.6, 3.5, 5.0]   # rotary dim 12 of head_dim 16 -> 6 frequencies
        return tf.Phi3Config(**{**common, "max_position_embeddings": 1024}, original_max_position_embeddings=256,
                             sliding_window=8, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
                                              "long_factor": [x * 4 for x in short], "partial_rotary_factor": 0.75})
    if family == "phi4_mini":   # Phi-4-mini style: tied embeddings, partial rotary, no sliding window
        return tf.Phi3Config(**common, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.75})
    rope = {
        "llama_yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                       "original_max_position_embeddings": 16},
        "llama_linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0},
        "llama_dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0},
        "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    }[family]
    return tf.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False)


FAMILIES = ["gemma2", "olmo2", "granite", "smollm3", "phi3", "phi4_mini", "llama_yarn", "llama_linear", "llama_dynamic",
            "llama3"]


@pytest.fixture(scope="module")
def checkpoint(tiny_tokenizer_dir, save_tiny_checkpoint):
    """Factory: family -> folder (config.json, model.safetensors, the tiny tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache: dict[str, str] = {}
    vocab = len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))

    def make(family: str) -> str:
        if family not in cache:
            torch.manual_seed(1234)
            model = AutoModelForCausalLM.from_config(_config(family, vocab), dtype=torch.float32)
            with torch.no_grad():   # norms init to 1 (Gemma: 0 offsets); random so the test sees them
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.normal_(0.0 if family == "gemma2" else 1.0, 0.3)
            cache[family] = save_tiny_checkpoint(model, family)
        return cache[family]

    return make


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 40, 17, 29, 1)]


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    # eager: the attention that applies Gemma 2's attention-logit soft cap
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, min_new_tokens=0,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def _engine(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", max_model_len=128, seed=0, kv_cache_memory_bytes=16 << 20,
               exact_greedy_head="off", **kwargs)


def _vocab(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["vocab_size"]


def _check_family(path: str, **engine_kwargs) -> float:
    """Assert greedy tokens and per-step logits equal transformers'; returns the max abs logit diff."""
    prompts = _prompts(_vocab(path))
    hf = _hf_model(path)
    expected = _hf_greedy(hf, prompts)
    llm = _engine(path, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                       use_tqdm=False)]
    assert got == expected

    # Logits of every step of the 40-token prompt's request, recorded at the model's head.
    model = llm.llm_engine.executor.driver_worker.model
    steps: list[torch.Tensor] = []
    head = model.compute_logits
    model.compute_logits = lambda h: steps.append(head(h).clone()) or steps[-1]
    ids = prompts[1]
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == expected[1]
    ours = torch.cat(steps)                                                   # [MAX_NEW, V]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids + out[:-1]])).logits[0, len(ids) - 1:]    # [MAX_NEW, V]
    assert ours.shape == ref.shape
    diff = float((ours - ref).abs().max())
    bound = LOGIT_RTOL * max(1.0, float(ref.abs().max()))
    assert diff < bound, f"max abs logit difference {diff} (bound {bound})"
    return diff


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers(family, checkpoint):
    diff = _check_family(checkpoint(family))
    print(f"{family}: max abs logit difference {diff:.2e}")


@pytest.mark.parametrize("backend", ["torch_ref", "cpu_sdpa"])
def test_gemma2_softcap_other_attention_backends(backend, checkpoint):
    """The attention-logit soft cap on the reference and SDPA backends too (the default is the C++
    paged kernel, which applies it in its score loop), and the eager (unfused) ops."""
    _check_family(checkpoint("gemma2"), attention_backend=backend, cpu_fused_ops="off")


def test_softcaps_matter(checkpoint):
    """The soft caps change the tiny Gemma 2's output: without them the logits differ (so the parity
    test above checks them)."""
    path = checkpoint("gemma2")
    hf = _hf_model(path)
    ids = torch.tensor([_prompts(_vocab(path))[1]])
    with torch.inference_mode():
        capped = hf(ids).logits
        hf.config.final_logit_softcapping = None
        hf.config.attn_logit_softcapping = None
        for layer in hf.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = hf(ids).logits
    assert float((capped - uncapped).abs().max()) > 0.5


def _hf_dict(**over) -> dict:
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    return {**base, **over}


def test_unsupported_architecture_names_supported_ones(tmp_path):
    from pagedllm.models.registry import get_model_class, supported_architectures

    config = ModelConfig.from_hf_config(_hf_dict(architectures=["FancyNewForCausalLM"]))
    with pytest.raises(ValueError, match="FancyNewForCausalLM") as err:
        get_model_class(config)
    for arch in ("Gemma2ForCausalLM", "Olmo2ForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM",
                 "LlamaForCausalLM"):
        assert arch in supported_architectures()
        assert arch in str(err.value)


@pytest.mark.parametrize("rope_type", ["ntk_fancy", "mrope"])
def test_unimplemented_rope_type_is_value_error(rope_type):
    with pytest.raises(ValueError, match=f"rope_type '{rope_type}'"):
        ModelConfig.from_hf_config(_hf_dict(rope_scaling={"rope_type": rope_type, "factor": 2.0}))
    with pytest.raises(ValueError, match=f"rope_type '{rope_type}'"):
        ModelConfig.from_hf_config(_hf_dict(rope_parameters={"rope_type": rope_type, "rope_theta": 1e4,
                                                             "factor": 2.0}))


@pytest.mark.parametrize("field, value, message", [
    ("partial_rotary_factor", 1.5, r"partial_rotary_factor must be in \(0, 1\], got 1.5"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("no_rope_layers", [1, 0, 1], "no_rope_layers has 3 entries for 2 layers"),
])
def test_unimplemented_config_field_is_value_error(field, value, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(_hf_dict(**{field: value}))


def test_dynamic_rope_past_context_is_value_error():
    """Within max_position_embeddings transformers' dynamic NTK is plain RoPE; past it, it rescales per
    batch, which we do not implement."""
    hf = _hf_dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=64)
    assert ModelConfig.from_hf_config(hf, max_model_len=64).max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len=65 exceeds it"):
        ModelConfig.from_hf_config(hf, max_model_len=65)


def test_longrope_past_original_context_is_value_error():
    """transformers switches every position to the long factors once a sequence passes the
    original context; we implement the short factors only, so a longer max_model_len is refused."""
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    hf = _hf_dict(architectures=["Phi3ForCausalLM"], model_type="phi3", rope_scaling=rope,
                  max_position_embeddings=1024, original_max_position_embeddings=256)
    assert ModelConfig.from_hf_config(hf, max_model_len=256).rope_parameters["full_attention"][1]["factor"] == 4.0
    with pytest.raises(ValueError, match="max_model_len=257 exceeds it"):
        ModelConfig.from_hf_config(hf, max_model_len=257)


def test_yarn_without_its_fields_is_value_error():
    from pagedllm.layers.rotary import compute_inv_freq

    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        compute_inv_freq(16, 1e4, {"rope_type": "yarn", "factor": 2.0})


def test_yarn_inv_freq_equals_transformers():
    """Bitwise: the yarn frequencies and attention factor are transformers' (several settings)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pagedllm.layers.rotary import compute_inv_freq

    for extra in ({}, {"beta_fast": 16, "beta_slow": 2}, {"mscale": 1.0, "mscale_all_dim": 0.5},
                  {"attention_factor": 0.7}, {"truncate": False}):
        rope = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "original_max_position_embeddings": 64,
                **extra}
        config = LlamaConfig(hidden_size=128, num_attention_heads=4, rope_parameters=dict(rope),
                             max_position_embeddings=512)
        ref, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        ours, factor = compute_inv_freq(32, 50000.0, rope)
        assert torch.equal(ours, ref), extra
        assert factor == pytest.approx(ref_factor, rel=1e-12), extra
