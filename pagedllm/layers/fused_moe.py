"""Mixture-of-experts feed-forward: top-k routing and each expert run once over its rows.

``FusedMoE`` (vLLM's name) holds the experts of one layer stacked, ``w13_weight`` [E, 2I, H]
(each expert's gate rows, then its up rows) and ``w2_weight`` [E, H, I] (its down projection);
the checkpoint keeps one tensor per expert and part (``experts.<e>.gate_proj.weight``, Mixtral's
``w1`` / ``w3`` / ``w2``), copied into those rows by ``models.utils.load_named_weights`` through
``checkpoint_slots``.

Routing (``select_experts``, Shazeer et al. 2017; as transformers' ``*TopKRouter``): softmax of
the router logits over the E experts in float32, the k largest, renormalised to sum to 1 where
the family does it (Mixtral always; Qwen2-MoE / Qwen3-MoE / OLMoE by ``norm_topk_prob``).

The experts (``FusedMoE.forward``): the T x k (token, expert) pairs are sorted by expert
(one stable ``argsort``); each expert that received rows multiplies them once, ``down(silu(gate(x))
* up(x))``, through plain torch ops on its stacked weights or through the kernel layers that
replace them after loading (``replace_expert_layers``: oneDNN / the bf16 GEMM in float32 and
bfloat16, int8 / int4 weight-only); the outputs, scaled by the routing weights, go back to their
(token, slot) rows with one row copy and each token's k rows are summed. The only Python loop is over experts with rows, never over tokens.
Float32 experts in the float32 GEMM's layers (``F32Linear``) instead run in one C++ call per layer
(``layers/f32_moe.py``: every pair's gate/up, SiLU, down and weighted sum over the stacked packed
weights, the same bits as the sorted per-expert path, batch-invariant); ``use_f32_moe = False``
turns it off.

Tensor parallelism: by default every expert's width is sliced (rank ``r`` holds rows
``r I / T : (r + 1) I / T`` of each gate / up and the matching down columns), as the dense MLP;
with ``enable_expert_parallel`` rank ``r`` holds experts ``[r E / T, (r + 1) E / T)`` whole and
skips the pairs routed elsewhere. Either way a rank's output is a partial sum that the model
all-reduces once; the router is replicated, so every rank routes the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import ParallelContext
from pagedllm.layers.f32_moe import f32_moe, stack_f32_experts
from pagedllm.layers.fused_ops import fused_ops_for

# Checkpoint part names per family: (gate, up, down).
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing.

    Args:
        router_logits: [T, E] (any float dtype).
        top_k: experts per token.
        renormalize: divide the k probabilities by their sum.
    Returns:
        (weights [T, k] float32, expert ids [T, k] int64), by decreasing probability.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)        # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)                           # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class MoERouter(nn.Module):
    """The router (transformers' ``gate``): ``logits = x @ W^T``, W [E, H], kept in the model dtype
    (not an ``nn.Linear``, so no quantization or packing changes which experts a token picks).

    Shapes:
        x: [T, H] -> [T, E].
    """

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class FusedMoE(nn.Module):
    """The experts of one MoE layer (SwiGLU experts), this rank's share.

    Args:
        num_experts: E, all experts of the layer.
        top_k: experts per token.
        hidden_size: H.
        intermediate_size: I, one expert's width (all ranks).
        renormalize: renormalise the top-k weights (``select_experts``).
        ctx: this rank's place (``tp_size``, ``tp_rank``, ``enable_expert_parallel``).
        part_names: the checkpoint's (gate, up, down) module names of an expert.
    Attributes:
        expert_start, num_local_experts: this rank's experts ``[expert_start, expert_start + num_local_experts)``.
        local_intermediate_size: the width of each local expert (I, or I / T when sliced).
        w13_packed, w2_packed: after ``replace_expert_layers`` with float32 GEMM layers, the local
            experts' packed weights stacked, [E_local, 2I / 16, H, 16] and [E_local, ceil(H / 16), I, 16]
            float32, run in one call by ``layers.f32_moe.f32_moe`` (else None: the per-expert path).
    Shapes:
        forward: x [T, H], router_logits [T, E] -> [T, H] (this rank's partial sum, x's dtype).
    Raises:
        ValueError: if T does not divide E (expert parallelism) or I (slicing).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 ctx: ParallelContext | None = None, part_names: tuple[str, str, str] = QWEN_EXPERT_NAMES) -> None:
        super().__init__()
        self.ctx = ctx = ctx or ParallelContext()
        t, r = ctx.tp_size, ctx.tp_rank
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.part_names = hidden_size, tuple(part_names)
        self.expert_parallel = ctx.enable_expert_parallel and t > 1
        if self.expert_parallel:
            if num_experts % t:
                raise ValueError(f"enable_expert_parallel: tensor_parallel_size={t} must divide {num_experts} experts")
            self.num_local_experts, self.expert_start = num_experts // t, r * (num_experts // t)
            self.local_intermediate_size = intermediate_size
        else:
            if intermediate_size % t:
                raise ValueError(f"tensor_parallel_size={t} must divide moe_intermediate_size {intermediate_size}")
            self.num_local_experts, self.expert_start = num_experts, 0
            self.local_intermediate_size = intermediate_size // t
        e, i = self.num_local_experts, self.local_intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, hidden_size))   # [E_local, 2I, H]
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, i))        # [E_local, H, I]
        self.expert_layers: nn.ModuleList | None = None  # (gate_up, down) kernel layers per local expert
        # The float32 experts' packed weights stacked for the one-call kernel (``layers/f32_moe.py``):
        # [E_local, 2I / 16, H, 16] and [E_local, ceil(H / 16), I, 16], or None (per-expert path).
        self.w13_packed: torch.Tensor | None = None
        self.w2_packed: torch.Tensor | None = None
        self.use_f32_moe = True   # run the one-call kernel when the packed weights exist (tests turn it off)
        self.use_fused_ops = False   # set by the model (KernelConfig.cpu_fused_ops)

    def checkpoint_slots(self, prefix: str) -> dict[str, tuple | None]:
        """Where each checkpoint tensor of these experts goes (``models.utils.load_named_weights``).

        Args:
            prefix: this module's name in the model (``model.layers.0.mlp.experts``).
        Returns:
            checkpoint name -> (parameter name, local expert, first row or None (the whole
            expert), rows, this rank's slice of the checkpoint tensor ((dim, start, length) or
            None)); None for the experts another rank holds (expert parallelism: not read).
        """
        gate, up, down = self.part_names
        i, t, r = self.local_intermediate_size, self.ctx.tp_size, self.ctx.tp_rank
        sliced = not self.expert_parallel and t > 1
        row_rule = (0, r * i, i) if sliced else None
        col_rule = (1, r * i, i) if sliced else None
        slots: dict[str, tuple | None] = {}
        for expert in range(self.num_experts):
            local = expert - self.expert_start
            owned = 0 <= local < self.num_local_experts
            base = f"{prefix}.{expert}"
            slots[f"{base}.{gate}.weight"] = (f"{prefix}.w13_weight", local, 0, i, row_rule) if owned else None
            slots[f"{base}.{up}.weight"] = (f"{prefix}.w13_weight", local, i, i, row_rule) if owned else None
            slots[f"{base}.{down}.weight"] = (f"{prefix}.w2_weight", local, None, 0, col_rule) if owned else None
        return slots

    def replace_expert_layers(self, make_layer) -> int:
        """Move each local expert into ``make_layer(weight, None)`` layers (``layers.linear.replace_linear_layers``
        calls it with the model's kernel: oneDNN packing, the bf16 GEMM, int8 / int4 weight-only) and
        drop the stacked weights. Float32 GEMM layers (``F32Linear``) are then stacked again, packed,
        for the one-call kernel (``layers.f32_moe.stack_f32_experts``; the layers read slices of it).

        Returns:
            The number of layers made (2 per local expert).
        """
        with torch.no_grad():
            self.expert_layers = nn.ModuleList(
                nn.ModuleList([make_layer(self.w13_weight[e], None), make_layer(self.w2_weight[e], None)])
                for e in range(self.num_local_experts))
        del self.w13_weight, self.w2_weight
        self.w13_weight = self.w2_weight = None
        packed = stack_f32_experts(self.expert_layers, self.local_intermediate_size)
        if packed is not None:
            self.w13_packed, self.w2_packed = packed
        return 2 * self.num_local_experts

    def stacked_weight_bytes(self) -> int:
        """Bytes of the stacked expert weights (0 once moved into kernel layers)."""
        return sum(p.numel() * p.element_size() for p in (self.w13_weight, self.w2_weight) if p is not None)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``e`` over its rows: [n, H] -> [n, H]."""
        if self.expert_layers is not None:
            gate_up = self.expert_layers[e][0](x)                                # [n, 2I]
        else:
            gate_up = F.linear(x, self.w13_weight[e])
        fused = fused_ops_for(self.use_fused_ops, gate_up)
        if fused is not None:
            act = fused.silu_and_mul(gate_up)                                    # [n, I]
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self.expert_layers[e][1](act) if self.expert_layers is not None else F.linear(act, self.w2_weight[e])

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)   # [T, k] each
        return self.apply_experts(x, weights, ids)

    def apply_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sum over each token's experts held here of ``weight * expert(x)``.

        Args:
            x: [T, H]; weights: [T, k] float; ids: [T, k] int64 (global expert ids).
        Returns:
            [T, H] in x's dtype (zeros for tokens routed to no local expert).
        """
        if self.use_f32_moe and self.w13_packed is not None and x.dtype is torch.float32 and x.is_cpu:
            x = x.contiguous()
            fused_silu = fused_ops_for(self.use_fused_ops, x) is not None   # as ``_expert`` would run it
            return f32_moe(x, weights, ids, self.w13_packed, self.w2_packed, self.expert_start, fused_silu)
        k, hidden = ids.shape[1], x.shape[1]
        if x.shape[0] == 1:   # one token (a batch-1 decode): its k experts straight, no sorting
            return self._one_token(x, weights[0].tolist(), ids[0].tolist())
        flat = ids.reshape(-1)                                                    # [T k] pair -> expert
        order = torch.argsort(flat, stable=True)                                 # pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()       # pairs per expert (all E)
        x_sorted = x.index_select(0, order // k)                                  # [T k, H] each pair's token
        w_sorted = weights.reshape(-1)[order].to(x.dtype)[:, None]                # [T k, 1]
        # Pairs of experts held elsewhere (expert parallelism) stay zero.
        y_sorted = (x.new_zeros if self.expert_parallel else x.new_empty)(flat.shape[0], hidden)
        lo = sum(counts[: self.expert_start])
        for local in range(self.num_local_experts):
            hi = lo + counts[self.expert_start + local]
            if hi > lo:
                torch.mul(self._expert(local, x_sorted[lo:hi]), w_sorted[lo:hi], out=y_sorted[lo:hi])
            lo = hi
        # Back to (token, slot) order with one row copy (``index_add_``'s CPU scatter is far slower),
        # then each token's k rows summed: [T k, H] -> [T, H].
        y_pairs = torch.empty_like(y_sorted)
        y_pairs[order] = y_sorted
        return y_pairs.view(-1, k, hidden).sum(dim=1)

    def _one_token(self, x: torch.Tensor, weights: list[float], ids: list[int]) -> torch.Tensor:
        """``apply_experts`` for x [1, H]: ``sum_j weights[j] * expert_{ids[j]}(x)`` over the local
        experts among ``ids``, in slot order (2 ops per expert fewer than sorting)."""
        out = None
        for w, e in zip(weights, ids):
            local = e - self.expert_start
            if not 0 <= local < self.num_local_experts:
                continue
            y = self._expert(local, x)                                            # [1, H]
            out = y.mul_(w) if out is None else out.add_(y, alpha=w)
        return torch.zeros_like(x) if out is None else out

    def extra_repr(self) -> str:
        return (f"experts={self.num_local_experts}/{self.num_experts} from {self.expert_start}, top_k={self.top_k}, "
                f"hidden={self.hidden_size}, intermediate={self.local_intermediate_size}, "
                f"renormalize={self.renormalize}")


def _own_tensor_bytes(module: nn.Module, seen: set[int]) -> int:
    """Bytes of the tensors ``module`` itself holds (parameters, buffers and kernel layers' tensor
    attributes such as packed weights; not its children's), each storage counted once (``seen``)."""
    total = 0
    for t in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        try:
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):   # opaque layouts (e.g. an mkldnn tensor)
            key = id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def parameter_bytes(model: nn.Module) -> tuple[int, int]:
    """(all weight bytes, active weight bytes per token) of a model as it runs (after packing or
    quantization: the bytes its kernels read).

    Active: every weight outside the experts (attention, norms, routers, shared experts, embedding
    and LM head, counted whole), plus ``top_k / num_local_experts`` of each ``FusedMoE``'s experts:
    what one token's forward reads, as the "active parameters" of a MoE model are counted.
    """
    seen: set[int] = set()
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    experts = [sum(_own_tensor_bytes(sub, seen) for sub in m.modules()) for m in moes]
    inside = {id(sub) for m in moes for sub in m.modules()}
    rest = sum(_own_tensor_bytes(mod, seen) for mod in model.modules() if id(mod) not in inside)
    active = rest + sum(b * m.top_k // m.num_local_experts for b, m in zip(experts, moes))
    return rest + sum(experts), active
