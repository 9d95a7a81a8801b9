"""Tensor- and pipeline-parallel building blocks (Megatron-LM, Shoeybi et al. 2019; vLLM's
``vocab_parallel_embedding.py`` / ``linear.py`` for the layouts).

Models build every layer at its per-rank size (``TensorParallelSizes``) out of the ordinary
modules (``MergedLinear`` for the column-parallel q/k/v and gate/up, ``nn.Linear`` for the
row-parallel o_proj and down_proj and the LM head), so the CPU kernels that replace ``nn.Linear``
after loading (oneDNN packing, int8) see plain, smaller matrices. What makes them parallel:

- column-parallel (q/k/v, gate/up): rank ``r`` holds rows ``r * n/T : (r + 1) * n/T`` of each part
  (its query heads, its KV heads, its slice of the MLP width) and needs no communication;
- row-parallel (o_proj, down_proj): rank ``r`` holds the matching input columns; its output is a
  partial sum, and the model all-reduces it (``tensor_parallel_all_reduce``) right after;
- KV heads: with ``H_kv >= T`` each rank holds ``H_kv / T``; with fewer (Gemma 3 270M: 1 KV head)
  each rank holds one, head ``r // (T / H_kv)``, replicated on ``T / H_kv`` ranks;
- vocabulary-parallel embedding and LM head: rank ``r`` holds rows ``r * V_p : (r + 1) * V_p`` with
  ``V_p = ceil(V / T)`` (the last rank's tail rows are zero padding); a lookup outside the range
  gives zeros and the ranks all-reduce; the head's logits are all-gathered and cut back to ``V``.

``checkpoint_shard`` tells the loader which slice of each checkpoint tensor a rank reads
(``models.utils.load_named_weights`` reads only that slice from the mmap'd safetensors file).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed.communication import tensor_parallel_all_reduce
from pagedllm.distributed.parallel_state import ParallelContext

# (dim, start, length): rank's slice of a checkpoint tensor.
Shard = tuple[int, int, int]


@dataclass(frozen=True)
class TensorParallelSizes:
    """Per-rank sizes of a model split ``tp_size`` ways.

    Attributes:
        num_heads: query heads on this rank (``H / T``).
        num_kv_heads: KV heads on this rank (``H_kv / T``, or 1 when replicated).
        kv_head_start: index of this rank's first KV head in the checkpoint.
        intermediate_size: MLP width on this rank (``I / T``).
        vocab_per_rank: embedding / LM-head rows on this rank (``ceil(V / T)``, padding included).
    """

    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    vocab_per_rank: int

    @classmethod
    def of(cls, config: ModelConfig, ctx: ParallelContext) -> "TensorParallelSizes":
        """Raises:
            ValueError: if the heads or the MLP width do not split ``ctx.tp_size`` ways."""
        t, r = ctx.tp_size, ctx.tp_rank
        hq, hkv = config.num_attention_heads, config.num_key_value_heads
        if hq % t or config.intermediate_size % t or (hkv % t and t % hkv):
            raise ValueError(f"tensor_parallel_size={t} does not split {hq} heads / {hkv} KV heads / "
                             f"intermediate_size {config.intermediate_size}")
        if hkv >= t:
            kv_local, kv_start = hkv // t, r * (hkv // t)
        else:  # replicated: T / H_kv ranks share a KV head
            kv_local, kv_start = 1, r // (t // hkv)
        return cls(num_heads=hq // t, num_kv_heads=kv_local, kv_head_start=kv_start,
                   intermediate_size=config.intermediate_size // t,
                   vocab_per_rank=-(-config.vocab_size // t))


def init_attention_projections(attn: nn.Module, config: ModelConfig, ctx: ParallelContext | None,
                                qkv_bias: bool, o_bias: bool) -> None:
    """Give an attention module this rank's sizes and projections (Llama, Qwen, Gemma 3 alike).

    Sets ``ctx``, ``num_heads`` (this rank's query heads), ``num_kv_heads`` (its KV heads,
    replicated when ``H_kv < T``), ``head_dim``, ``q_size`` / ``kv_size`` (features), the
    column-parallel ``qkv_proj`` (q/k/v as one ``MergedLinear``, checkpoint names kept) and the
    row-parallel ``o_proj`` (the caller all-reduces its output).

    Raises:
        ValueError: as :meth:`TensorParallelSizes.of`.
    """
    from pagedllm.layers.linear import MergedLinear

    attn.ctx = ctx or ParallelContext()
    sizes = TensorParallelSizes.of(config, attn.ctx)
    attn.num_heads, attn.num_kv_heads, attn.head_dim = sizes.num_heads, sizes.num_kv_heads, config.head_dim
    attn.q_size, attn.kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    attn.qkv_proj = MergedLinear(config.hidden_size, [attn.q_size, attn.kv_size, attn.kv_size],
                                 ("q_proj", "k_proj", "v_proj"), bias=qkv_bias)
    attn.o_proj = nn.Linear(attn.q_size, config.hidden_size, bias=o_bias)


def init_stage_and_lm_head(lm: nn.Module, config: ModelConfig, ctx: ParallelContext) -> None:
    """Finish a ``*ForCausalLM`` module for this rank, once its ``model`` (with ``layers``) is built.

    Sets ``tie_word_embeddings``, ``lm_head`` (untied: a vocabulary-parallel ``nn.Linear`` of
    ``ceil(V / T)`` rows on the last stage, a ``PPMissingLayer`` elsewhere; tied: none, the head is
    the embedding), ``packed_lm_head`` (None until ``pack_linear_layers``), ``stage_layers`` (this
    stage's decoder layers), and the per-rank KV shape the worker sizes its pool by:
    ``num_kv_heads``, ``head_dim``, ``num_layers``.
    """
    sizes = TensorParallelSizes.of(config, ctx)
    lm.tie_word_embeddings = config.tie_word_embeddings
    if not lm.tie_word_embeddings:
        lm.lm_head = (nn.Linear(config.hidden_size, sizes.vocab_per_rank, bias=False) if ctx.is_last_stage
                      else PPMissingLayer())
    lm.packed_lm_head = None  # set by pack_linear_layers (tied head on the CPU: oneDNN or the bf16 GEMM)
    lm.stage_layers = [layer for layer in lm.model.layers if not isinstance(layer, PPMissingLayer)]
    lm.num_kv_heads, lm.head_dim = sizes.num_kv_heads, config.head_dim   # per rank
    lm.num_layers = len(lm.stage_layers)                                  # this stage's


def checkpoint_shard(name: str, config: ModelConfig, ctx: ParallelContext) -> Shard | None:
    """The slice of checkpoint tensor ``name`` (Hugging Face names) that this rank loads.

    Returns:
        (dim, start, length), or None to load the whole tensor (replicated: norms, row-parallel
        biases, everything when ``tp_size`` is 1).
    """
    if ctx.tp_size == 1:
        return None
    sizes = TensorParallelSizes.of(config, ctx)
    r, d = ctx.tp_rank, config.head_dim
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    q_local = sizes.num_heads * d
    if module == "q_proj":
        return 0, r * q_local, q_local
    if module in ("k_proj", "v_proj"):
        return 0, sizes.kv_head_start * d, sizes.num_kv_heads * d
    if module in ("gate_proj", "up_proj"):
        return 0, r * sizes.intermediate_size, sizes.intermediate_size
    if module == "o_proj" and kind == "weight":
        return 1, r * q_local, q_local
    if module == "down_proj" and kind == "weight":
        return 1, r * sizes.intermediate_size, sizes.intermediate_size
    if module in ("embed_tokens", "lm_head") and kind == "weight":
        start = r * sizes.vocab_per_rank
        return 0, start, max(0, min(sizes.vocab_per_rank, config.vocab_size - start))
    return None


def zero_row_parallel_biases(model: nn.Module, ctx: ParallelContext) -> None:
    """A row-parallel layer's bias is added once: kept on tensor rank 0, zeroed on the others (its
    output is summed over the ranks)."""
    if ctx.tp_size == 1 or ctx.tp_rank == 0:
        return
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(("o_proj", "down_proj")) and isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()


class VocabParallelEmbedding(nn.Embedding):
    """Token embedding whose rows are split over the tensor-parallel ranks.

    Holds rows ``[tp_rank * V_p, (tp_rank + 1) * V_p)`` (``V_p = ceil(V / T)``) as an ordinary
    ``nn.Embedding`` weight, so a tied LM head (``layers.linear.lm_head_logits``) uses the local
    rows directly.

    Args:
        vocab_size: the full vocabulary.
        hidden_size: embedding width.
        ctx: this rank's ``ParallelContext``.
    Shapes:
        input_ids: [num_tokens] int64 (full-vocabulary ids) -> [num_tokens, hidden_size].
    """

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext | None = None) -> None:
        ctx = ctx or ParallelContext()
        per_rank = -(-vocab_size // ctx.tp_size)
        super().__init__(per_rank, hidden_size)
        self.ctx = ctx
        self.vocab_size = vocab_size
        self.vocab_start = ctx.tp_rank * per_rank

    def reset_parameters(self) -> None:
        """No random init: the weight always comes from the checkpoint (the model is built on the
        meta device). ``nn.Embedding``'s ``normal_`` would import ``torch._dynamo`` on its first
        call, most of a second of every start (docs/performance.md, warm start)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return tensor_parallel_all_reduce(out, self.ctx)


class PPMissingLayer(nn.Module):
    """Placeholder for a module another pipeline stage owns (no parameters; never called)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage")
