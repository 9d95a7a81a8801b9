"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE over the Llama code.

Each family is its dense relative (``models/llama.py``) with the feed-forward of its MoE layers
(``ModelConfig.moe_layers``) replaced by a ``SparseMoeBlock``: the router (``gate``), the experts
(``layers.fused_moe.FusedMoE``) and, for Qwen2-MoE, a shared expert scaled by
``sigmoid(shared_expert_gate(x))``; the block's partial sums meet in one all-reduce. Module names
follow transformers' (``mlp.gate``, ``mlp.experts.<e>.gate_proj``, ``mlp.shared_expert``; Mixtral's
``block_sparse_moe`` is read as ``mlp``). OLMoE differs in attention too: its q/k RMSNorm runs over
all heads at once (``OlmoeAttention``), and ``clip_qkv`` clamps q/k/v.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.config import KernelConfig, ModelConfig
from pagedllm.distributed.communication import tensor_parallel_all_reduce
from pagedllm.distributed.parallel_state import ParallelContext
from pagedllm.layers.fused_moe import MIXTRAL_EXPERT_NAMES, QWEN_EXPERT_NAMES, FusedMoE, MoERouter
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.parallel import PPMissingLayer, TensorParallelSizes
from pagedllm.layers.rotary import apply_rotary
from pagedllm.models.llama import (LlamaAttention, LlamaForCausalLM, LlamaMLP, MistralForCausalLM,
                                   Qwen2ForCausalLM, Qwen3ForCausalLM)


class SparseMoeBlock(nn.Module):
    """``sum_k w_k expert_k(x)`` (+ ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``); [T, H] -> [T, H].

    Args:
        config: ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``,
            ``shared_expert_intermediate_size`` (0: no shared expert).
        ctx: this rank's place; the experts are sliced or placed whole (``FusedMoE``), the shared
            expert's width sliced; the router and the shared gate are replicated.
        part_names: the experts' (gate, up, down) checkpoint names.
    Raises:
        ValueError: as ``FusedMoE``, or a shared expert width ``tp_size`` does not divide.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext | None,
                 part_names: tuple[str, str, str] = QWEN_EXPERT_NAMES) -> None:
        super().__init__()
        self.ctx = ctx = ctx or ParallelContext()
        hidden = config.hidden_size
        self.gate = MoERouter(config.num_experts, hidden)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, hidden, config.moe_intermediate_size,
                                config.norm_topk_prob, ctx, part_names)
        shared = config.shared_expert_intermediate_size
        self.has_shared_expert = shared > 0
        if self.has_shared_expert:
            if shared % ctx.tp_size:
                raise ValueError(f"tensor_parallel_size={ctx.tp_size} must divide shared_expert_intermediate_size "
                                 f"{shared}")
            # This rank's slice, unreduced (one rank's context: its all-reduce is the identity).
            self.shared_expert = LlamaMLP(hidden, shared // ctx.tp_size, ctx=ParallelContext())
            self.shared_expert_gate = MoERouter(1, hidden)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the block's output ([T, H]; the ranks' shares sum to it)."""
        out = self.experts(x, self.gate(x))                                            # [T, H]
        if self.has_shared_expert:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # gate [T, 1]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tensor_parallel_all_reduce(self.partial(x), self.ctx)


def full_width_rms_norm(x: torch.Tensor, norm: RMSNorm, ctx: ParallelContext) -> torch.Tensor:
    """RMSNorm over the whole feature width when each tensor rank holds a slice of it (OLMoE's q/k
    norms): the squares' sums are all-reduced, so ``mean = sum / (local width x T)`` (a KV head
    replicated on ``T / H_kv`` ranks is counted that many times in both the sum and the width).

    Shapes:
        x: [T, local width] -> the same, x's dtype; ``norm.weight``: this rank's slice.
    """
    x32 = x.float()
    sums = tensor_parallel_all_reduce(x32.pow(2).sum(-1, keepdim=True), ctx)            # [T, 1]
    x32 = x32 * torch.rsqrt(sums / (x.shape[-1] * ctx.tp_size) + norm.eps)
    return norm.weight * x32.to(x.dtype)


class OlmoeAttention(LlamaAttention):
    """OLMoE attention: RMSNorm over all query (key) features before splitting heads, then
    ``clip_qkv`` clamping, then RoPE (transformers' ``OlmoeAttention``)."""

    def __init__(self, config: ModelConfig, layer_idx: int, ctx: ParallelContext | None,
                 kernel_config: KernelConfig | None = None) -> None:
        bias = config.attention_bias
        super().__init__(config, layer_idx, (bias, bias), None, None, ctx, kernel_config)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        self.clip_qkv = config.clip_qkv

    def forward(self, rope, hidden_states, kv_cache, attn_metadata):
        T = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = full_width_rms_norm(q, self.q_norm, self.ctx), full_width_rms_norm(k, self.k_norm, self.ctx)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(T, self.num_heads, self.head_dim)                               # [T, Hq, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)                            # [T, Hkv, D]
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, *rope)
        out = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)           # [T, Hq, D]
        return tensor_parallel_all_reduce(self.o_proj(out.reshape(T, self.num_heads * self.head_dim)), self.ctx)


class _MoEForCausalLM:
    """Mixin over a Llama-family class: the MoE layers' ``mlp`` becomes a ``SparseMoeBlock``.

    Class attributes: ``expert_names`` (the experts' checkpoint names), ``moe_module`` (the
    checkpoint's name of the block when it is not ``mlp``).
    """

    expert_names = QWEN_EXPERT_NAMES
    moe_module: str | None = None

    def __init__(self, config: ModelConfig, ctx: ParallelContext | None = None,
                 kernel_config: KernelConfig | None = None) -> None:
        super().__init__(config, ctx, kernel_config)
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer, PPMissingLayer):
                continue
            self.adapt_layer(i, layer)
            if i in config.moe_layers:
                layer.mlp = SparseMoeBlock(config, self.ctx, self.expert_names)
        for module in self.modules():
            if isinstance(module, (FusedMoE, LlamaMLP, RMSNorm)):
                module.use_fused_ops = self.use_fused_ops

    def adapt_layer(self, index: int, layer: nn.Module) -> None:
        """Change a decoder layer other than its MLP (OLMoE: its attention); none by default."""

    def moe_blocks(self) -> list[SparseMoeBlock]:
        """This stage's MoE blocks, in layer order."""
        return [layer.mlp for layer in self.stage_layers if isinstance(layer.mlp, SparseMoeBlock)]

    def checkpoint_shard(self, name: str):
        """As the dense model's, and the shared expert's width (``shared_expert_intermediate_size / T``)."""
        ctx = self.ctx
        if ".shared_expert." in name and ctx.tp_size > 1:
            width = self.config.shared_expert_intermediate_size // ctx.tp_size
            if name.endswith(("gate_proj.weight", "up_proj.weight")):
                return 0, ctx.tp_rank * width, width
            if name.endswith("down_proj.weight"):
                return 1, ctx.tp_rank * width, width
        return super().checkpoint_shard(name)

    def load_weights(self, weights) -> None:
        """As the dense model's; the MoE block's checkpoint name (``moe_module``) is read as ``mlp``."""
        if self.moe_module is not None:
            old, new = f".{self.moe_module}.", ".mlp."
            weights = ((name.replace(old, new), tensor) for name, tensor in weights)
        super().load_weights(weights)


class Qwen3MoeForCausalLM(_MoEForCausalLM, Qwen3ForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B): Qwen3 attention (per-head q/k norm), top-k experts,
    ``norm_topk_prob`` renormalisation, dense layers at ``mlp_only_layers`` / off ``decoder_sparse_step``."""


class Qwen2MoeForCausalLM(_MoEForCausalLM, Qwen2ForCausalLM):
    """Qwen2-MoE: Qwen2 attention (q/k/v biases as ``qkv_bias``), top-k experts plus a shared expert
    scaled by ``sigmoid(shared_expert_gate(x))``."""

    @staticmethod
    def bias_flags(config: ModelConfig) -> tuple[bool, bool]:
        return config.attention_bias, False


class MixtralForCausalLM(_MoEForCausalLM, MistralForCausalLM):
    """Mixtral: Mistral attention, 8 experts (``w1`` gate, ``w3`` up, ``w2`` down) in
    ``block_sparse_moe``, top-2 weights renormalised."""

    expert_names = MIXTRAL_EXPERT_NAMES
    moe_module = "block_sparse_moe"


class OlmoeForCausalLM(_MoEForCausalLM, LlamaForCausalLM):
    """OLMoE: Llama with full-width q/k RMSNorm (``OlmoeAttention``), ``clip_qkv``, top-k experts
    (``norm_topk_prob``)."""

    def adapt_layer(self, index: int, layer: nn.Module) -> None:
        layer.self_attn = OlmoeAttention(self.config, index, self.ctx, self.kernel_config)

    def checkpoint_shard(self, name: str):
        """As the others, and the q / k norms' weights sliced with their heads."""
        if self.ctx.tp_size > 1 and name.endswith(("q_norm.weight", "k_norm.weight")):
            sizes, d = TensorParallelSizes.of(self.config, self.ctx), self.config.head_dim
            if name.endswith("q_norm.weight"):
                return 0, self.ctx.tp_rank * sizes.num_heads * d, sizes.num_heads * d
            return 0, sizes.kv_head_start * d, sizes.num_kv_heads * d
        return super().checkpoint_shard(name)
