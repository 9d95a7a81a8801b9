"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, OLMo 2, Granite 3, SmolLM3, Phi-3) over
the paged KV cache.

Module names follow Hugging Face's ``LlamaForCausalLM`` so checkpoint keys map 1:1. The families
differ by a few named options (the shared layer vocabulary), each matched to its transformers
``modeling_*.py``:
- ``bias_flags``: Qwen2 adds q/k/v biases;
- ``qk_norm``: "head" (Qwen3: per-head q/k RMSNorm before RoPE) or "full" (OLMo 2: RMSNorm over
  the whole q and k projections);
- ``post_norms``: OLMo 2 normalises each sub-block's output instead of its input;
- config multipliers (Granite 3): ``embedding_multiplier``, ``residual_multiplier``,
  ``attention_multiplier`` (the attention scale), ``logits_scaling``;
- ``layer_use_rope`` (SmolLM3): NoPE layers skip RoPE;
- Phi-3 / Phi-4-mini: fused q/k/v and gate/up checkpoint tensors (split on loading), partial
  rotary (``partial_rotary_factor``), LongRoPE;
- ``layer_sliding_windows``: Mistral-style configs give every layer a window, ``layer_types`` some.
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
from pagedllm.layers.fused_ops import fused_ops_for
from pagedllm.layers.linear import MergedLinear, lm_head_logits
from pagedllm.layers.norm import RMSNorm, add_rms_norm
from pagedllm.layers.parallel import (PPMissingLayer, TensorParallelSizes, VocabParallelEmbedding, checkpoint_shard,
                                      init_attention_projections, init_stage_and_lm_head,
                                      zero_row_parallel_biases)
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary
from pagedllm.models.utils import load_named_weights, pp_missing_prefixes, run_decoder_layers

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``; [T, H] -> [T, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 ctx: ParallelContext | None = None) -> None:
        super().__init__()
        self.ctx = ctx or ParallelContext()
        # gate_proj and up_proj as one column-parallel layer (checkpoint names kept; models/utils.py),
        # down_proj row-parallel: ``intermediate_size`` is this rank's share (layers/parallel.py).
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size],
                                         ("gate_proj", "up_proj"), bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.use_fused_ops = False   # set by the model (KernelConfig.cpu_fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)                                            # [T, 2I]
        fused = fused_ops_for(self.use_fused_ops, gate_up)
        if fused is not None:
            act = fused.silu_and_mul(gate_up)                                     # [T, I], one pass
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return tensor_parallel_all_reduce(self.down_proj(act), self.ctx)


QK_NORMS = (None, "head", "full")


class LlamaAttention(nn.Module):
    """Self-attention with RoPE and GQA reading/writing the paged KV cache.

    Args:
        qk_norm: None, "head" (RMSNorm over each head's ``head_dim`` channels, Qwen3) or "full"
            (RMSNorm over all of q's ``Hq * D`` and k's ``Hkv * D`` channels, OLMo 2).
        kernel_config: the attention backend and ``cpu_isa`` (None: ``KernelConfig()``).
    Raises:
        ValueError: an unknown ``qk_norm``, or "full" with tensor parallelism (the norm would
            span the ranks' heads).
    """

    def __init__(self, config: ModelConfig, layer_idx: int, bias: tuple[bool, bool], qk_norm: str | None,
                 sliding_window: int | None, ctx: ParallelContext | None = None,
                 kernel_config: KernelConfig | None = None) -> None:
        super().__init__()
        kernel_config = kernel_config or KernelConfig()
        qkv_bias, o_bias = bias
        init_attention_projections(self, config, ctx, qkv_bias, o_bias)
        eps = config.rms_norm_eps
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {qk_norm!r}")
        if qk_norm == "full" and self.ctx.tp_size > 1:
            raise ValueError(f"q/k norms over all heads (OLMo 2) need tensor_parallel_size 1, got {self.ctx.tp_size}")
        if qk_norm:
            full = qk_norm == "full"
            self.q_norm = RMSNorm(self.q_size if full else self.head_dim, eps)
            self.k_norm = RMSNorm(self.kv_size if full else self.head_dim, eps)
        self.qk_norm = qk_norm
        self.use_rope = config.layer_use_rope[layer_idx] if config.layer_use_rope else True
        # The fused q/k norm + RoPE op rotates whole heads; partial rotary (Phi-3) runs the eager ops.
        self.whole_head_rope = config.partial_rotary_factor == 1.0
        scale = config.attention_multiplier if config.attention_multiplier is not None else self.head_dim ** -0.5
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads,
                              scale=scale, sliding_window=sliding_window,
                              backend=kernel_config.attention_backend, cpu_isa=kernel_config.cpu_isa)
        self.use_fused_ops = False   # set by the model (KernelConfig.cpu_fused_ops)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor,
                kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        T = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)                # [T, (Hq + 2 Hkv) D]
        if self.qk_norm == "full":                        # OLMo 2: norms over the whole projections
            q, k, v = qkv.split_with_sizes([self.q_size, self.kv_size, self.kv_size], dim=-1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        head_norms = self.qk_norm == "head"
        norms = (self.q_norm.weight, self.k_norm.weight) if head_norms else ()
        fused = fused_ops_for(self.use_fused_ops and self.use_rope and self.whole_head_rope, qkv, *rope, *norms)
        if fused is not None:  # (Qwen3's q/k norms and) RoPE in place on qkv, one pass per token
            fused.qk_norm_rope_(qkv, *(norms or (None, None)), rope[0], rope[1], self.num_heads, self.num_kv_heads,
                                self.head_dim, self.q_norm.eps if head_norms else 0.0)
        # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]: views of the merged output, split by heads.
        q, k, v = qkv.view(T, -1, self.head_dim).split_with_sizes(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if fused is None:
            if head_norms:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.use_rope:  # SmolLM3's NoPE layers skip it
                q, k = apply_rotary(q, k, *rope)
        out = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)         # [T, Hq, D]
        return tensor_parallel_all_reduce(self.o_proj(out.reshape(T, self.num_heads * self.head_dim)), self.ctx)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + m * attn(norm(x)), then x + m * mlp(norm(x)) (m: Granite's
    ``residual_multiplier``, else 1). With ``post_norms`` (OLMo 2): x + norm(attn(x)), then
    x + norm(mlp(x)), the norms named ``post_attention_layernorm`` / ``post_feedforward_layernorm``
    and no ``input_layernorm``."""

    def __init__(self, config: ModelConfig, layer_idx: int, bias: tuple[bool, bool], qk_norm: str | None,
                 sliding_window: int | None, ctx: ParallelContext | None = None, post_norms: bool = False,
                 kernel_config: KernelConfig | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        eps = config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_idx, bias, qk_norm, sliding_window, ctx, kernel_config)
        self.mlp = LlamaMLP(hidden, TensorParallelSizes.of(config, self.self_attn.ctx).intermediate_size,
                            bias=config.mlp_bias, ctx=ctx)
        self.post_norms = post_norms
        self.residual_multiplier = config.residual_multiplier
        if post_norms:
            self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        else:
            self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier

    def forward(self, rope, hidden_states, kv_cache, attn_metadata):
        residual = hidden_states
        if self.post_norms:
            h = self.self_attn(rope, hidden_states, kv_cache, attn_metadata)
            hidden_states = residual + self.post_attention_layernorm(h)
            return hidden_states + self.post_feedforward_layernorm(self.mlp(hidden_states))
        hidden_states = self.self_attn(rope, self.input_layernorm(hidden_states), kv_cache, attn_metadata)
        hidden_states = residual + self._scaled(hidden_states)
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + self._scaled(hidden_states)

    def forward_fused(self, rope, x: torch.Tensor, residual: torch.Tensor, kv_cache, attn_metadata,
                      next_norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward`` with each residual add fused into the norm after it (C++ ops,
        ``layers/fused_ops.py``; the same values as ``forward`` up to the norms' sum order). Arguments
        and result as ``Gemma3DecoderLayer.forward_fused``: ``x`` = ``input_layernorm(residual)``,
        returns (this layer's output, ``next_norm`` of it, or None without a next norm). Pre-norm
        layers only (the model runs ``post_norms`` layers through ``forward``)."""
        h = self._scaled(self.self_attn(rope, x, kv_cache, attn_metadata))
        residual, x = add_rms_norm(h, residual, self.post_attention_layernorm, True)
        h = self._scaled(self.mlp(x))
        if next_norm is None:
            return residual + h, None
        return add_rms_norm(h, residual, next_norm, True)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, bias: tuple[bool, bool], qk_norm: str | None,
                 sliding_windows: list[int | None], ctx: ParallelContext, post_norms: bool = False,
                 kernel_config: KernelConfig | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        # Modules of other pipeline stages are placeholders without parameters.
        needs_embedding = ctx.is_first_stage or (ctx.is_last_stage and config.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, ctx) if needs_embedding \
            else PPMissingLayer()
        self.layers = nn.ModuleList([
            LlamaDecoderLayer(config, i, bias, qk_norm, sliding_windows[i], ctx, post_norms, kernel_config)
            if ctx.owns_layer(i)
            else PPMissingLayer() for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(hidden, config.rms_norm_eps) if ctx.is_last_stage else PPMissingLayer()
        # One RoPE for all layers (the Llama family reads no per-layer-type parameters).
        theta, scaling = next(iter(config.rope_parameters.values()))
        self.rotary_emb = RotaryEmbedding(int(config.head_dim * config.partial_rotary_factor), theta, scaling)


class LlamaForCausalLM(nn.Module):
    """Causal LM over the paged KV cache.

    Args:
        config: the model's architecture (``ModelConfig.from_hf_config``).
        ctx: this rank's place among tensor / pipeline ranks (None: the whole model here).
        kernel_config: the attention backend, ``cpu_isa`` and fused ops (None: ``KernelConfig()``).
    """

    qk_norm: str | None = None   # LlamaAttention's q/k norms: None, "head" or "full"
    post_norms = False           # LlamaDecoderLayer: norms after the sub-blocks (OLMo 2)

    @staticmethod
    def bias_flags(config: ModelConfig) -> tuple[bool, bool]:
        """(q/k/v bias, o bias): Llama and Qwen3 put ``attention_bias`` on all four."""
        return config.attention_bias, config.attention_bias

    def __init__(self, config: ModelConfig, ctx: ParallelContext | None = None,
                 kernel_config: KernelConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.kernel_config = kernel_config = kernel_config or KernelConfig()
        self.ctx = ctx = ctx or ParallelContext(layer_end=config.num_hidden_layers)
        windows = list(config.layer_sliding_windows)
        self.model = LlamaModel(config, self.bias_flags(config), self.qk_norm, windows, ctx, self.post_norms,
                                kernel_config)
        init_stage_and_lm_head(self, config, ctx)
        self.layer_sliding_windows = windows[ctx.layer_start: ctx.layer_start + self.num_layers]
        # CPU float32 / bfloat16: fused C++ norms, residual adds, RoPE and SiLU x up (layers/fused_ops.py).
        self.use_fused_ops = kernel_config.cpu_fused_ops != "off"
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaMLP, LlamaAttention)):
                module.use_fused_ops = self.use_fused_ops
        # Residual adds fused into the next pre-norm: only where the layers have pre-norms.
        self.fuse_residual_norms = self.use_fused_ops and not self.post_norms
        self.embedding_multiplier = config.embedding_multiplier   # Granite; 1 elsewhere
        self.logits_scaling = config.logits_scaling               # Granite: logits / it; 1 elsewhere

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
            if self.embedding_multiplier != 1.0:
                hidden_states = hidden_states * self.embedding_multiplier
        rope = self.model.rotary_emb(positions, hidden_states.dtype)
        return run_decoder_layers(self, self.stage_layers, lambda layer: rope, hidden_states, kv_caches,
                                  attn_metadata, fused_ops_for(self.fuse_residual_norms, hidden_states) is not None)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] int64 -> [num_tokens, hidden_size]: what transformers'
        ``get_input_embeddings()(input_ids)`` returns (Granite's multiplier comes after, in ``forward``)."""
        return self.model.embed_tokens(input_ids)

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding ([vocab, hidden]); with tied embeddings also the LM head's weight."""
        return self.model.embed_tokens

    def get_lm_head(self) -> nn.Module:
        """The LM head: the ``lm_head`` linear, or the embedding when tied."""
        return self.model.embed_tokens if self.tie_word_embeddings else self.lm_head

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits (model dtype), divided by Granite's ``logits_scaling``;
        under tensor parallelism every rank of the last stage calls it (all-gather of the
        vocabulary shards)."""
        logits = tensor_parallel_all_gather(lm_head_logits(self, hidden_states), self.ctx)
        if self.ctx.tp_size > 1:
            logits = logits[:, : self.config.vocab_size]
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling

    def checkpoint_shard(self, name: str):
        """This rank's slice of checkpoint tensor ``name`` (``layers.parallel.checkpoint_shard``)."""
        return checkpoint_shard(name, self.config, self.ctx)

    def load_weights(self, weights) -> None:
        """Load (HF name, tensor) pairs; a tied ``lm_head.weight`` is ignored."""
        def _filtered():
            for name, tensor in weights:
                if self.tie_word_embeddings and name == "lm_head.weight":
                    continue
                yield name, tensor
        load_named_weights(self, _filtered(), skip=("rotary_emb.inv_freq",),
                           shard=self.checkpoint_shard,
                           skip_prefixes=pp_missing_prefixes(self))
        zero_row_parallel_biases(self, self.ctx)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with a sliding window on every layer (``sliding_window`` in config)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with q/k/v biases (no o_proj bias)."""

    @staticmethod
    def bias_flags(config: ModelConfig) -> tuple[bool, bool]:
        return True, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head q/k RMSNorm before RoPE (and ``attention_bias`` on q/k/v/o)."""

    qk_norm = "head"


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 (OLMo et al. 2024): RMSNorm over the whole q / k projections before RoPE, and norms
    after attention and MLP instead of before (``post_attention_layernorm``,
    ``post_feedforward_layernorm``)."""

    qk_norm = "full"
    post_norms = True


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3: Llama with ``embedding_multiplier``, ``residual_multiplier``,
    ``attention_multiplier`` (the attention scale) and ``logits_scaling`` (all from config.json)."""


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4-mini: Llama whose checkpoints hold q/k/v as one ``self_attn.qkv_proj`` and
    gate/up as one ``mlp.gate_up_proj`` (split here into the parts ``MergedLinear`` loads, so tensor
    parallelism shards them as Llama's), with partial rotary and LongRoPE from config.json."""

    def load_weights(self, weights) -> None:
        """Load (HF name, tensor) pairs, the fused q/k/v and gate/up tensors split by rows
        ([(Hq + 2 Hkv) D, H] -> q, k, v; [2 I, H] -> gate, up)."""
        c = self.config
        qkv_rows = [c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
                    c.num_key_value_heads * c.head_dim]

        def _split():
            for name, tensor in weights:
                parent, _, kind = name.rpartition(".")
                if parent.endswith(("self_attn.qkv_proj", "mlp.gate_up_proj")):
                    tensor = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
                    base = parent.rpartition(".")[0]
                    if parent.endswith("qkv_proj"):
                        parts, rows = ("q_proj", "k_proj", "v_proj"), qkv_rows
                    else:
                        parts, rows = ("gate_proj", "up_proj"), [c.intermediate_size] * 2
                    for part, piece in zip(parts, tensor.split(rows, dim=0)):
                        yield f"{base}.{part}.{kind}", piece
                else:
                    yield name, tensor
        super().load_weights(_split())


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: Llama whose ``no_rope_layers`` entries of 0 mark NoPE layers (no RoPE on q / k)."""
