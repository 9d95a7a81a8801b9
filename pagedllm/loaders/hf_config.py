"""A checkpoint's config.json -> ``ModelConfig``'s architecture fields (``hf_architecture_fields``).

Every family default for a missing key is resolved here, next to the loaders that read the
file, so that ``config.py`` holds only the engine's own settings.
"""

from __future__ import annotations

from typing import Any

from pagedllm.config import SUPPORTED_ROPE_TYPES


def _text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The text model's part of a config.json dict (multimodal checkpoints nest it in ``text_config``)."""
    if "text_config" in hf_config:
        return {**hf_config["text_config"], "architectures": hf_config.get("architectures")}
    return hf_config


def _rope_params(config: dict[str, Any], layer_type: str | None, default_theta: float) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling dict or None) of one layer type.

    Reads transformers 5's ``rope_parameters`` (flat, or keyed by layer type as Gemma 3 writes it)
    and the legacy ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq`` keys.
    """
    params = config.get("rope_parameters")
    if isinstance(params, dict) and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = params if params.get("rope_type", "default") != "default" else None
        return theta, scaling
    if layer_type == "sliding_attention" and "rope_local_base_freq" in config:
        return float(config["rope_local_base_freq"]), None
    return float(config.get("rope_theta", default_theta)), config.get("rope_scaling")


def _layer_types(config: dict[str, Any], default_pattern: int | None) -> tuple[str, ...]:
    """Per-layer attention type ("full_attention" / "sliding_attention")."""
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types:
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        return tuple(types)
    pattern = config.get("sliding_window_pattern", default_pattern)
    if pattern:
        return tuple("sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(n))
    return ("full_attention",) * n


def _check_implemented(cfg: dict[str, Any], rope: dict[str, tuple[float, dict | None]]) -> None:
    """Reject config.json fields whose effect we do not implement (never silently wrong output).

    Raises:
        ValueError: naming the field and its value: a RoPE type outside ``SUPPORTED_ROPE_TYPES``,
            bidirectional attention, a ``no_rope_layers`` list of the wrong length.
    """
    for layer_type, (_, scaling) in rope.items():
        if scaling:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"rope_scaling rope_type {rope_type!r} ({layer_type}) is not supported; "
                                 f"supported: {SUPPORTED_ROPE_TYPES}")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported (causal attention only)")
    no_rope = cfg.get("no_rope_layers")
    if no_rope is not None and len(no_rope) != int(cfg["num_hidden_layers"]):
        raise ValueError(f"no_rope_layers has {len(no_rope)} entries for {cfg['num_hidden_layers']} layers")


def _float_or_none(cfg: dict[str, Any], key: str) -> float | None:
    return None if cfg.get(key) is None else float(cfg[key])


def _partial_rotary_factor(cfg: dict[str, Any], rope: dict[str, tuple[float, dict | None]]) -> float:
    """The fraction of each head RoPE rotates (Phi-3 / Phi-4-mini; top level or in ``rope_parameters``).

    Raises:
        ValueError: unless in (0, 1].
    """
    factor = cfg.get("partial_rotary_factor")
    params = cfg.get("rope_parameters")
    if factor is None and isinstance(params, dict):
        factor = params.get("partial_rotary_factor")
    factor = 1.0 if factor is None else float(factor)
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}")
    return factor


def _with_rope_fields(cfg: dict[str, Any], scaling: dict | None) -> dict | None:
    """A RoPE scaling dict with the top-level fields its type reads filled in as transformers does:
    dynamic: ``max_position_embeddings``; longrope: ``original_max_position_embeddings`` and
    ``factor`` (max_position_embeddings / original when absent)."""
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if rope_type == "dynamic":
        return {**scaling, "max_position_embeddings": int(cfg.get("max_position_embeddings") or 2048)}
    if rope_type not in ("longrope", "su"):
        return scaling
    original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("rope_scaling rope_type 'longrope' needs original_max_position_embeddings")
    factor = scaling.get("factor") or float(cfg.get("max_position_embeddings") or original) / float(original)
    return {**scaling, "original_max_position_embeddings": int(original), "factor": float(factor)}


def _moe_fields(cfg: dict[str, Any], num_layers: int, intermediate: int) -> dict[str, Any]:
    """Mixture-of-experts fields (``ModelConfig.num_experts`` ...; none for a dense model).

    Mixtral: ``num_local_experts`` experts of width ``intermediate_size``, top-k weights always
    renormalised; OLMoE: ``num_experts`` of width ``intermediate_size``; Qwen2-MoE / Qwen3-MoE:
    ``num_experts`` of width ``moe_intermediate_size``, MoE on layer ``i`` unless ``i`` is in
    ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``; Qwen2-MoE adds a shared expert
    (``shared_expert_intermediate_size``) and reads ``qkv_bias``.
    """
    model_type = str(cfg.get("model_type") or "")
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if not experts or model_type not in ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe"):
        return {}
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    fields_ = dict(num_experts=experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 2),
                   moe_intermediate_size=int(cfg.get("moe_intermediate_size") or intermediate),
                   norm_topk_prob=True if model_type == "mixtral" else bool(cfg.get("norm_topk_prob", False)),
                   shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                   moe_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
                   clip_qkv=None if cfg.get("clip_qkv") is None else float(cfg["clip_qkv"]))
    if model_type == "qwen2_moe":
        fields_["attention_bias"] = bool(cfg.get("qkv_bias", True))
    return fields_


def hf_architecture_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The architecture fields of ``ModelConfig``, read once from a checkpoint's config.json.

    Every default a model family applies to a missing key is resolved here (Gemma 3: head_dim 256,
    tied embeddings, a sliding layer pattern of 6 and RoPE bases 10 000 / 1 000 000; Gemma 2:
    head_dim 256, tied, every other layer sliding; Llama family: head_dim = hidden_size /
    num_attention_heads, untied; Granite's multipliers 1; SmolLM3's ``no_rope_layers``), so models
    read plain values.

    Args:
        hf_config: config.json as a dict (a multimodal one's ``text_config`` is used).
    Returns:
        Keyword arguments for ``ModelConfig``.
    Raises:
        ValueError: if a required key is missing, ``layer_types`` disagrees with the layer count, or
            a field asks for something not implemented (``_check_implemented``).
    """
    archs = tuple(hf_config.get("architectures") or ())
    cfg = _text_config(hf_config)
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        vocab_size = int(cfg["vocab_size"])
        intermediate = int(cfg["intermediate_size"])
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r}") from None
    is_gemma3 = any(a.startswith("Gemma3") for a in archs) or str(cfg.get("model_type", "")).startswith("gemma3")
    is_gemma2 = any(a.startswith("Gemma2") for a in archs) or cfg.get("model_type") == "gemma2"
    is_gemma = is_gemma3 or is_gemma2
    types = _layer_types(cfg, 6 if is_gemma3 else 2 if is_gemma2 else None)
    window = cfg.get("sliding_window")
    if is_gemma or cfg.get("layer_types") or cfg.get("use_sliding_window") is not None:
        windows = tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    else:  # Mistral style: a window on every layer
        windows = tuple(int(window) if window else None for _ in types)
    rope = {}
    for t in sorted(set(types)):
        default_theta = (10_000.0 if t == "sliding_attention" else 1_000_000.0) if is_gemma3 else 10_000.0
        rope[t] = _rope_params(cfg, t if is_gemma3 else None, default_theta)
    _check_implemented(cfg, rope)
    rope = {t: (theta, _with_rope_fields(cfg, scaling)) for t, (theta, scaling) in rope.items()}
    head_dim = cfg.get("head_dim") or (256 if is_gemma else hidden // num_heads)
    dtype = hf_config.get("dtype") or hf_config.get("torch_dtype")
    no_rope = cfg.get("no_rope_layers")  # SmolLM3: 1 = the layer uses RoPE, 0 = NoPE
    moe = _moe_fields(cfg, num_layers, intermediate)
    attention_bias = bool(moe.pop("attention_bias", cfg.get("attention_bias", False)))
    return dict(
        **moe,
        architectures=archs,
        model_type=str(cfg.get("model_type") or ""),
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", is_gemma)),
        attention_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        hidden_act=str((cfg.get("hidden_activation") or "gelu_pytorch_tanh") if is_gemma
                       else (cfg.get("hidden_act") or "silu")),
        layer_types=types,
        layer_sliding_windows=windows,
        rope_parameters=rope,
        query_pre_attn_scalar=_float_or_none(cfg, "query_pre_attn_scalar"),
        attn_logit_softcapping=_float_or_none(cfg, "attn_logit_softcapping"),
        final_logit_softcapping=_float_or_none(cfg, "final_logit_softcapping"),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        attention_multiplier=_float_or_none(cfg, "attention_multiplier"),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        layer_use_rope=() if no_rope is None else tuple(bool(x) for x in no_rope),
        partial_rotary_factor=_partial_rotary_factor(cfg, rope),
        checkpoint_dtype=None if dtype is None else str(dtype).replace("torch.", ""),
    )
