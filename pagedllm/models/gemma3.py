"""Gemma 3 text decoder (``gemma3_text``, Gemma Team 2025) and Gemma 2 (Gemma Team 2024) over the
paged KV cache.

Differences from Llama, each matched to transformers' ``modeling_gemma3.py``:
- embeddings scaled by sqrt(hidden_size) (cast to the weight dtype first);
- RMSNorm as ``x_hat * (1 + w)`` in float32; "sandwich" norms around attention and MLP;
- per-head q/k RMSNorm before RoPE; attention scale ``query_pre_attn_scalar ** -0.5``;
- sliding-window layers (``layer_types``) with their own RoPE base (``rope_local_base_freq``);
- gelu(tanh) gated MLP; tied embeddings; optional final / attention logit soft caps.

Gemma 2 (``modeling_gemma2.py``) is the same block without the q/k norms (``qk_norm = False``),
with one RoPE base for both layer types and, in its checkpoints, both soft caps on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention import Attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import KernelConfig, ModelConfig
from pagedllm.distributed.communication import tensor_parallel_all_gather, tensor_parallel_all_reduce
from pagedllm.distributed.parallel_state import ParallelContext
from pagedllm.layers.linear import MergedLinear, lm_head_logits
from pagedllm.layers.fused_ops import fused_ops_for
from pagedllm.layers.norm import GemmaRMSNorm, gemma_add_rms_norm
from pagedllm.layers.parallel import (PPMissingLayer, TensorParallelSizes, VocabParallelEmbedding, checkpoint_shard,
                                      init_attention_projections, init_stage_and_lm_head,
                                      zero_row_parallel_biases)
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary
from pagedllm.models.utils import load_named_weights, pp_missing_prefixes, run_decoder_layers

KVCache = tuple[torch.Tensor, torch.Tensor]


class Gemma3MLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))``; [T, H] -> [T, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str,
                 ctx: ParallelContext | None = None) -> None:
        super().__init__()
        self.ctx = ctx or ParallelContext()
        if activation not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"hidden_activation {activation!r} is not supported for Gemma 3")
        self.approximate = "tanh" if activation == "gelu_pytorch_tanh" else "none"
        # gate_proj and up_proj as one layer (checkpoint names kept; models/utils.py).
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size],
                                         ("gate_proj", "up_proj"), bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.use_fused_ops = False   # set by the model (KernelConfig.cpu_fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)                                            # [T, 2I]
        fused = fused_ops_for(self.use_fused_ops and self.approximate == "tanh", gate_up)
        if fused is not None:
            act = fused.gelu_tanh_and_mul(gate_up)                                # [T, I], one pass
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate=self.approximate) * up
        # down_proj is row-parallel (``intermediate_size`` is this rank's share): sum the ranks.
        return tensor_parallel_all_reduce(self.down_proj(act), self.ctx)


class Gemma3Attention(nn.Module):
    """Gemma attention: (per-head q/k norms when ``qk_norm``,) RoPE, scale
    ``query_pre_attn_scalar ** -0.5``, optional sliding window and attention-logit soft cap."""

    def __init__(self, config: ModelConfig, sliding_window: int | None, ctx: ParallelContext | None = None,
                 qk_norm: bool = True, kernel_config: KernelConfig | None = None) -> None:
        super().__init__()
        kernel_config = kernel_config or KernelConfig()
        init_attention_projections(self, config, ctx, config.attention_bias, config.attention_bias)
        eps = config.rms_norm_eps
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps)
        self.sliding_window = sliding_window
        scalar = config.query_pre_attn_scalar or float(self.head_dim)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, scale=scalar ** -0.5,
                              sliding_window=self.sliding_window,
                              logits_soft_cap=config.attn_logit_softcapping,
                              backend=kernel_config.attention_backend, cpu_isa=kernel_config.cpu_isa)
        self.use_fused_ops = False   # set by the model (KernelConfig.cpu_fused_ops)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor,
                kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        T = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)                # [T, (Hq + 2 Hkv) D]
        fused = fused_ops_for(self.use_fused_ops, qkv, *rope)
        if fused is not None and self.qk_norm:  # q/k norms and RoPE in place on qkv, one pass per token
            fused.gemma_qk_norm_rope_(qkv, self.q_norm.scale(), self.k_norm.scale(), rope[0], rope[1],
                                      self.num_heads, self.num_kv_heads, self.q_norm.eps, self.k_norm.eps)
        elif fused is not None:  # Gemma 2: RoPE alone, in place
            fused.qk_norm_rope_(qkv, None, None, rope[0], rope[1], self.num_heads, self.num_kv_heads,
                                self.head_dim, 0.0)
        # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]: views of the merged output, split by heads.
        q, k, v = qkv.view(T, -1, self.head_dim).split_with_sizes(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if fused is None:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, k, *rope)
        out = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)         # [T, Hq, D]
        return tensor_parallel_all_reduce(self.o_proj(out.reshape(T, self.num_heads * self.head_dim)), self.ctx)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, ctx: ParallelContext | None = None,
                 qk_norm: bool = True, kernel_config: KernelConfig | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.layer_type = config.layer_types[layer_idx]
        eps = config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, config.layer_sliding_windows[layer_idx], ctx, qk_norm, kernel_config)
        self.mlp = Gemma3MLP(hidden, TensorParallelSizes.of(config, self.self_attn.ctx).intermediate_size,
                             config.hidden_act, ctx)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, rope, hidden_states, kv_cache, attn_metadata):
        residual = hidden_states
        h = self.self_attn(rope, self.input_layernorm(hidden_states), kv_cache, attn_metadata)
        hidden_states = residual + self.post_attention_layernorm(h)
        residual = hidden_states
        h = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return residual + self.post_feedforward_layernorm(h)

    def forward_fused(self, rope, x: torch.Tensor, residual: torch.Tensor, kv_cache, attn_metadata,
                      next_norm: GemmaRMSNorm | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward`` with the residual adds fused into the norms around them (C++ ops,
        ``layers/fused_ops.py``; the same values as ``forward`` up to the sum order of the norms).

        Args:
            x: [T, hidden], ``input_layernorm(residual)`` (the previous step's fused output).
            residual: [T, hidden], this layer's input.
            next_norm: the norm applied next to this layer's output (the next layer's
                ``input_layernorm`` or the final norm), or None (the last layer of a pipeline stage).
        Returns:
            (this layer's output, ``next_norm`` of it or None).
        """
        h = self.self_attn(rope, x, kv_cache, attn_metadata)
        residual, x = gemma_add_rms_norm(h, residual, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                                         True)
        h = self.mlp(x)
        if next_norm is None:
            return residual + self.post_feedforward_layernorm(h), None
        return gemma_add_rms_norm(h, residual, self.post_feedforward_layernorm, next_norm, True)


class Gemma3TextModel(nn.Module):
    def __init__(self, config: ModelConfig, ctx: ParallelContext, qk_norm: bool = True,
                 kernel_config: KernelConfig | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        # Modules of other pipeline stages are placeholders without parameters; the tied
        # embedding lives on the first stage (lookup) and the last (LM head).
        needs_embedding = ctx.is_first_stage or (ctx.is_last_stage and config.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, ctx) if needs_embedding \
            else PPMissingLayer()
        self.embed_scale = hidden ** 0.5
        self.layers = nn.ModuleList([Gemma3DecoderLayer(config, i, ctx, qk_norm, kernel_config) if ctx.owns_layer(i)
                                     else PPMissingLayer() for i in range(config.num_hidden_layers)])
        self.norm = GemmaRMSNorm(hidden, config.rms_norm_eps) if ctx.is_last_stage else PPMissingLayer()
        # One RoPE per layer type: global layers and sliding layers have their own base.
        self.rotary_emb = nn.ModuleDict()
        for layer_type, (theta, scaling) in sorted(config.rope_parameters.items()):
            self.rotary_emb[layer_type] = RotaryEmbedding(config.head_dim, theta, scaling)


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3 causal LM (text only) over the paged KV cache.

    Args:
        config: the model's architecture (``ModelConfig.from_hf_config`` of a ``gemma3_text``
            config, or a multimodal one's ``text_config``).
        ctx: this rank's place among tensor / pipeline ranks (None: the whole model here).
        kernel_config: the attention backend, ``cpu_isa`` and fused ops (None: ``KernelConfig()``).
    """

    qk_norm = True   # per-head q/k norms (Gemma 3; not Gemma 2)

    def __init__(self, config: ModelConfig, ctx: ParallelContext | None = None,
                 kernel_config: KernelConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.kernel_config = kernel_config = kernel_config or KernelConfig()
        self.ctx = ctx = ctx or ParallelContext(layer_end=config.num_hidden_layers)
        self.model = Gemma3TextModel(config, ctx, self.qk_norm, kernel_config)
        init_stage_and_lm_head(self, config, ctx)
        self.final_logit_softcapping = config.final_logit_softcapping
        self.layer_sliding_windows = [layer.self_attn.sliding_window for layer in self.stage_layers]
        self._embed_scales: dict[torch.dtype, torch.Tensor] = {}   # see _embed_scale
        # CPU float32 / bfloat16: fused C++ ops between the GEMMs (layers/fused_ops.py).
        self.use_fused_ops = kernel_config.cpu_fused_ops != "off"
        for module in self.modules():
            if isinstance(module, (GemmaRMSNorm, Gemma3MLP, Gemma3Attention)):
                module.use_fused_ops = self.use_fused_ops

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata, hidden_states: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm (the last stage), or after this stage's layers.

        Args:
            input_ids, positions: [num_tokens] int64 (the flattened batch).
            kv_caches: per layer of this stage (k_cache, v_cache), each [num_blocks, block_size, Hkv, D].
            hidden_states: [num_tokens, hidden_size], the previous stage's output (later stages only).
            inputs_embeds: [num_tokens, hidden_size] model dtype, used instead of
                ``embed_input_ids(input_ids)`` (first stage; prompt embeddings), or None.
        Returns:
            [num_tokens, hidden_size] in the model dtype.
        """
        if self.ctx.is_first_stage:
            hidden_states = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        ropes = {t: rotary(positions, hidden_states.dtype) for t, rotary in self.model.rotary_emb.items()}
        return run_decoder_layers(self, self.stage_layers, lambda layer: ropes[layer.layer_type], hidden_states, kv_caches,
                                  attn_metadata, fused_ops_for(self.use_fused_ops, hidden_states) is not None)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] int64 -> [num_tokens, hidden_size]: the scaled embedding, what transformers'
        ``get_input_embeddings()(input_ids)`` returns (``Gemma3TextScaledWordEmbedding``)."""
        embed = self.model.embed_tokens
        return embed(input_ids) * self._embed_scale(embed.weight.dtype)

    def _embed_scale(self, dtype: torch.dtype) -> torch.Tensor:
        """sqrt(hidden_size) as a 0-d tensor in ``dtype``, cast as transformers does (a float32
        tensor first, then the weight dtype); built once per dtype, not per step."""
        scale = self._embed_scales.get(dtype)
        if scale is None:
            scale = self._embed_scales[dtype] = torch.tensor(self.model.embed_scale).to(dtype)
        return scale

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding ([vocab, hidden]); with tied embeddings also the LM head's weight."""
        return self.model.embed_tokens

    def get_lm_head(self) -> nn.Module:
        """The LM head: the ``lm_head`` linear, or the embedding when tied."""
        return self.model.embed_tokens if self.tie_word_embeddings else self.lm_head

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits (model dtype), soft-capped if the config says so; under
        tensor parallelism every rank of the last stage calls it (all-gather of the vocabulary shards)."""
        logits = tensor_parallel_all_gather(lm_head_logits(self, hidden_states), self.ctx)
        if self.ctx.tp_size > 1:
            logits = logits[:, : self.config.vocab_size]
        if self.final_logit_softcapping:
            cap = float(self.final_logit_softcapping)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights) -> None:
        """Load (HF name, tensor) pairs. Accepts multimodal-checkpoint names
        (``model.language_model.*``) and ignores vision tensors and a tied ``lm_head``."""
        def _filtered():
            for name, tensor in weights:
                if name.startswith(("model.vision_tower", "vision_tower", "multi_modal_projector",
                                    "model.multi_modal_projector")):
                    continue
                name = name.replace("model.language_model.", "model.").replace("language_model.model.", "model.")
                if self.tie_word_embeddings and name.endswith("lm_head.weight"):
                    continue
                yield name, tensor
        load_named_weights(self, _filtered(), skip=("rotary_emb.inv_freq",),
                           shard=lambda name: checkpoint_shard(name, self.config, self.ctx),
                           skip_prefixes=pp_missing_prefixes(self))
        zero_row_parallel_biases(self, self.ctx)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: Gemma 3's block without q/k norms; attention-logit soft cap inside attention (every
    backend: ``attention.backends``), final-logit soft cap on the LM head, alternating sliding layers."""

    qk_norm = False
