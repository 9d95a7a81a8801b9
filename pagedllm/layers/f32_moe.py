"""All of a float32 MoE layer's experts in one C++ call (``csrc/f32_moe.cpp``), over the experts'
float32 GEMM weights (``layers/f32_gemm.py``) stacked.

Why: with its experts as ``F32Linear`` layers, ``FusedMoE`` makes 2 GEMM calls per chosen expert
plus the sort / gather / scale / scatter / sum ops around them; at a decode step's few rows each
call's fixed cost, not the weight bytes, is what separates a MoE step from a dense one of the same
active bytes (docs/benchmarks.md, "Mixture of experts"). The kernel runs every (token, expert)
pair of the step in one call: gate and up GEMMs, ``silu(gate) * up``, the down GEMM, each scaled
by its routing weight and summed per token (threads split the output blocks).

Arithmetic: the same bits as ``FusedMoE``'s per-expert path at T >= 2 (sorted pairs, the float32
GEMM's one FMA chain per output, torch's SiLU, the weighted rows summed in slot order), and a
token's result does not depend on the other rows (batch-invariant; at T = 1 too, where the
per-expert path's one-token shortcut adds the second expert with an FMA and so rounds differently).

It runs when every expert is an ``F32Linear`` without bias, the local expert width is a multiple
of 16 and the extension builds; otherwise ``FusedMoE`` keeps its per-expert path (bfloat16, int8,
oneDNN, no compiler, other devices).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from pagedllm.layers.f32_gemm import F32Linear
from pagedllm.platforms.cpu_extension import DEFAULT_CFLAGS, CpuExtension, load_extension

SOURCE = Path(__file__).resolve().parent / "csrc" / "f32_moe.cpp"
# ``-ffp-contract=off``: the activation and the weighted sum round each product, as torch does.
EXTENSION = CpuExtension("f32_moe", SOURCE, "float32 MoE kernel", "the per-expert float32 GEMM layers",
                         extra_cflags=DEFAULT_CFLAGS + ("-ffp-contract=off",),
                         headers=(SOURCE.parent / "f32_gemm.h", SOURCE.parent / "vec_isa.h"))
BLOCK = 16   # outputs per packed block (``F32Linear``'s layout)


@functools.cache
def load_f32_moe() -> ModuleType | None:
    """The C++ kernel (``f32_moe``, ``compiled_isas``), compiled first on a machine that has not
    yet; None (one WARNING) if that fails."""
    return load_extension(EXTENSION)


def stack_f32_experts(expert_layers, intermediate_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Stack the experts' packed weights for ``f32_moe`` and point each layer at its slice (no copy
    kept: the layers still run, reading the stacked tensors).

    Args:
        expert_layers: per local expert, its (gate_up [2I, H], down [H, I]) kernel layers.
        intermediate_size: I, a local expert's width.
    Returns:
        (w13 [E, 2I / 16, H, 16], w2 [E, ceil(H / 16), I, 16]) float32, or None where the kernel
        cannot run them (a layer that is not a bias-free ``F32Linear``, I not a multiple of 16,
        the extension not built: the caller keeps its per-expert path).
    """
    layers = [layer for pair in expert_layers for layer in pair]
    if (not layers or intermediate_size % BLOCK
            or any(not isinstance(layer, F32Linear) or layer.bias is not None for layer in layers)):
        return None
    module = load_f32_moe()
    if module is None or not module.compiled_isas():
        return None
    stacked = []
    for part in (0, 1):
        weight = torch.stack([pair[part].packed_weight for pair in expert_layers])   # [E, blocks, K, 16]
        for e, pair in enumerate(expert_layers):
            pair[part].packed_weight = weight[e]
        stacked.append(weight)
    return stacked[0], stacked[1]


@functools.cache
def torch_silu_vector_span() -> int:
    """float32 elements per vector step of torch's own elementwise kernels here (2 vectors: 32 with
    its AVX-512 code, 16 with AVX2; 1 for its portable code, which computes each element as the
    scalar formula does): a row's elements past the last full step take the scalar formula."""
    capability = torch.backends.cpu.get_cpu_capability()
    return 32 if capability.startswith("AVX512") else 16 if capability == "AVX2" else 1


def f32_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            first_expert: int, fused_silu: bool) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` over the local experts, in one call.

    Args:
        x: [T, H] float32, contiguous, on the CPU.
        weights: [T, k] float32; ids: [T, k] int64 (global expert ids; those outside
            ``[first_expert, first_expert + E)`` are held by other ranks and add nothing).
        w13, w2: ``stack_f32_experts``'s tensors.
        first_expert: the global id of local expert 0.
        fused_silu: round the activation as ``fused_ops``' ``silu_and_mul`` (the per-expert path with
            the fused ops), else as ``F.silu(gate) * up`` (torch's kernel: its scalar tail per row).
    Returns:
        [T, H] float32 (zeros for a token routed to no local expert).
    """
    inter = w2.shape[2]
    scalar_from = inter if fused_silu else inter - inter % torch_silu_vector_span()
    return load_f32_moe().f32_moe(x, weights.contiguous(), ids.contiguous(), w13, w2, first_expert, scalar_from)
