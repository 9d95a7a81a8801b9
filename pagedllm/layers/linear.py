"""Linear layers on the CPU through oneDNN with weights reordered once after loading.

torch's ``F.linear`` on the CPU calls MKL's sgemm, which is slow at the row counts of a decode
step; oneDNN's inner product with the weight reordered ("packed") into its blocked layout is
several times faster for the same shapes (the numbers: docs/performance.md). The packed weight is made once, after the
checkpoint is loaded (vLLM's ``process_weights_after_loading``), and replaces the plain weight,
so the model holds no second copy; only a tied LM head keeps both, because the embedding lookup
needs the plain matrix.

The kernel is chosen by ``KernelConfig.cpu_gemm`` (``EngineArgs`` defaults it to
``$PAGEDLLM_CPU_GEMM``): ``onednn`` (default where it works) or ``torch`` (plain ``F.linear``, the
reference). oneDNN is used for float32 everywhere, and for bfloat16 where the CPU multiplies it
natively (``avx512_bf16`` or AMX, ``platforms/cpu.py``: oneDNN then runs AVX-512 bf16 or AMX tile
kernels; elsewhere it has no bf16 inner product, and bfloat16 runs our AVX2 GEMM where the CPU has
AVX2 + FMA, ``layers/bf16_gemm.py``); each dtype is probed once with a tiny call before use. The tied LM head gets the same packed kernel in every dtype (``replace_linear_layers``).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.f32_gemm import F32_KERNEL
from pagedllm.layers.kernel_linear import KernelLinear
from pagedllm.platforms.cpu import CPU_GEMM_ENV, CpuGemm, parse_cpu_gemm  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def onednn_linear_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed inner product runs here for ``dtype`` (probed with a 2x4x3 call
    checked against ``F.linear``): float32, and bfloat16 on CPUs with native bf16."""
    from pagedllm.platforms.cpu import native_bf16

    if not torch.backends.mkldnn.is_available():
        return False
    if dtype != torch.float32 and not (dtype == torch.bfloat16 and native_bf16("auto")[0]):
        return False
    try:
        w = torch.arange(12, dtype=dtype).reshape(3, 4) / 7
        x = torch.arange(8, dtype=dtype).reshape(2, 4) / 5
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        return bool(torch.allclose(y.float(), F.linear(x, w).float(), rtol=tol, atol=tol))
    except (RuntimeError, AttributeError) as exc:  # no kernel for this CPU/dtype, or an old torch
        logger.info("oneDNN linear unavailable for %s: %s", dtype, exc)
        return False


class MergedLinear(nn.Linear):
    """Linear layers that read the same input, held as one: ``y = x @ [W_0; W_1; ...]^T + [b_0; b_1; ...]``
    (vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` on one device). One GEMM over
    the stacked weight replaces two or three smaller ones, and whatever a kernel does per call
    (oneDNN dispatch, the int8 layer's per-token scaling) happens once; the caller splits ``y``
    by ``output_sizes``.

    The checkpoint keeps the parts' names: ``models.utils.load_named_weights`` copies
    ``<parent>.<shard_names[i]>.weight`` (and ``.bias``) into rows
    ``sum(output_sizes[:i]) : sum(output_sizes[:i + 1])`` of this layer.

    Args:
        in_features: input width.
        output_sizes: out_features of each part, in order.
        shard_names: the parts' module names in the checkpoint (e.g. ``("q_proj", "k_proj", "v_proj")``).
        bias: whether the parts have biases.
    Shapes:
        x: [..., in_features] -> [..., sum(output_sizes)].
    Raises:
        ValueError: if ``output_sizes`` and ``shard_names`` differ in length.
    """

    def __init__(self, in_features: int, output_sizes: list[int], shard_names: tuple[str, ...],
                 bias: bool = False) -> None:
        if len(output_sizes) != len(shard_names):
            raise ValueError(f"{len(output_sizes)} output sizes for {len(shard_names)} shard names")
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = [int(n) for n in output_sizes]
        self.shard_names = tuple(shard_names)

    def shard_rows(self) -> dict[str, tuple[int, int]]:
        """Shard name -> (first row, row count) in the stacked weight."""
        rows, start = {}, 0
        for name, size in zip(self.shard_names, self.output_sizes):
            rows[name] = (start, size)
            start += size
        return rows


def replace_linear_layers(model: nn.Module, make_layer, make_head=None) -> tuple[int, bool]:
    """Replace every ``nn.Linear`` of ``model`` (and each expert of a ``FusedMoE``, through its
    ``replace_expert_layers``) by ``make_layer(weight, bias)`` and, for a model
    with a tied LM head, set ``model.packed_lm_head = make_layer(embedding matrix, None)`` (read by
    ``lm_head_logits``; the embedding stays for the token lookup). The model exposes its embedding
    through ``get_input_embeddings()`` and its head through ``get_lm_head()``. ``make_head``, when
    given, makes the LM head's layer instead (tied or not).

    Returns:
        (layers replaced, whether the tied head was set).
    """
    make_head = make_head or make_layer
    head = model.get_lm_head() if hasattr(model, "get_lm_head") else None
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                make = make_head if child is head else make_layer
                setattr(parent, name, make(child.weight, child.bias))
                replaced += 1
    for module in list(model.modules()):  # stacked experts (layers/fused_moe.py): one layer per expert and part
        if hasattr(module, "replace_expert_layers"):
            replaced += module.replace_expert_layers(make_layer)
    # A pipeline stage without the LM head (``model.ctx``: not the last stage) packs none.
    ctx = getattr(model, "ctx", None)
    tied = bool(getattr(model, "tie_word_embeddings", False)) and hasattr(model, "packed_lm_head") \
        and (ctx is None or ctx.is_last_stage)
    if tied:
        model.packed_lm_head = make_head(model.get_input_embeddings().weight, None)
    return replaced, tied


def replaceable_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights ``replace_linear_layers`` moves: every ``nn.Linear``'s parameters and
    the stacked experts of each ``FusedMoE``."""
    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, nn.Linear)
               for p in m.parameters()) + \
        sum(m.stacked_weight_bytes() for m in model.modules() if hasattr(m, "stacked_weight_bytes"))


class PackedLinear(KernelLinear):
    """``y = x @ W^T + b`` with ``W`` held in oneDNN's blocked layout (CPU; float32, or bfloat16
    with float32 accumulation on CPUs with native bf16).

    Args:
        weight: [out_features, in_features] float32 / bfloat16 on the CPU (copied into the packed layout).
        bias: [out_features] or None.
        batch_hint: the row count the layout is tuned for (``max_num_seqs``: decode steps).
    Shapes:
        x: [..., in_features] -> [..., out_features], the weight's dtype.

    Batch invariance: oneDNN runs a one-row call through another kernel than every larger row
    count, and at some shapes it rounds differently (float32, K = 2048 on AVX-512: M = 1 against
    M = 2..1100, which all agree); a lone row is therefore computed as two copies of itself and
    the first kept, so a row's result does not depend on how many rows share the call (the call
    stays bound by reading the weight: a second row costs little). Checked per shape by
    ``tests/layers/test_linear_batch_invariance.py``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int) -> None:
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        lone = x2.shape[0] == 1
        x2 = x2.expand(2, -1).contiguous() if lone else x2.contiguous()   # a lone row as two (class docstring)
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed_weight, self.bias, "none", [], "")
        return (y[:1] if lone else y).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packed_kernel_for(dtype: torch.dtype, device: torch.device, cpu_gemm: str = CpuGemm.ONEDNN.value,
                      cpu_isa: str = "auto", flags: frozenset[str] | None = None,
                      cpu_bf16_gemm: str = "auto", cpu_f32_gemm: str = "auto") -> tuple[str, str]:
    """Which kernel runs an unquantized model's linear layers here, and why.

    Args:
        dtype, device: the model's.
        cpu_gemm: ``KernelConfig.cpu_gemm``.
        cpu_isa: ``KernelConfig.cpu_isa`` (a bf16 model's choice between oneDNN and the bf16 GEMM).
        flags: the CPU's flags (default: this machine's).
        cpu_bf16_gemm: ``KernelConfig.cpu_bf16_gemm`` (a bf16 kernel forced, for comparisons).
        cpu_f32_gemm: ``KernelConfig.cpu_f32_gemm`` (a float32 kernel forced, for comparisons).
    Returns:
        (``"torch"`` (``F.linear``, nothing packed), ``"onednn"`` (``PackedLinear``), ``"amx_bf16"``,
        ``"avx512_bf16"`` or ``"avx2_bf16"`` (``layers.bf16_gemm.Bf16Linear``), ``"f32_gemm"``
        (``layers.f32_gemm.F32Linear``, float32); the reason in words).
    Raises:
        ValueError: for a bad ``cpu_gemm``, ``cpu_bf16_gemm`` or ``cpu_f32_gemm``, or as
            ``bf16_kernel_for`` / ``f32_kernel_for`` for a ``cpu_isa`` the CPU lacks.
    """
    if device.type != "cpu":
        return CpuGemm.TORCH.value, f"not on the CPU ({device.type})"
    if parse_cpu_gemm(cpu_gemm) is not CpuGemm.ONEDNN:
        return CpuGemm.TORCH.value, f"cpu_gemm={cpu_gemm!r} (${CPU_GEMM_ENV})"
    if dtype == torch.bfloat16:   # our GEMMs first: the AVX2 one runs where oneDNN has no bf16 kernel
        from pagedllm.layers.bf16_gemm import bf16_kernel_for

        kernel, why = bf16_kernel_for(cpu_isa, flags, kernel=cpu_bf16_gemm)
        if kernel != CpuGemm.ONEDNN.value:
            return kernel, why
        if not onednn_linear_available(dtype):
            return CpuGemm.TORCH.value, f"oneDNN has no bfloat16 inner product here; not the bf16 GEMM: {why}"
        return kernel, f"not the bf16 GEMM: {why}"
    if not onednn_linear_available(dtype):
        return CpuGemm.TORCH.value, f"oneDNN has no {str(dtype).replace('torch.', '')} inner product here"
    if dtype == torch.float32:
        from pagedllm.layers.f32_gemm import f32_kernel_for

        return f32_kernel_for(cpu_isa, flags, kernel=cpu_f32_gemm)
    return CpuGemm.ONEDNN.value, f"{str(dtype).replace('torch.', '')}: oneDNN's packed inner product"


def pack_linear_layers(model: nn.Module, dtype: torch.dtype, device: torch.device, batch_hint: int,
                       cpu_gemm: str = CpuGemm.ONEDNN.value, cpu_isa: str = "auto", kernel: str | None = None,
                       cpu_bf16_gemm: str = "auto", cpu_f32_gemm: str = "auto") -> int:
    """Replace every ``nn.Linear`` of ``model`` by a packed layer and, for a model with a tied
    LM head, set ``model.packed_lm_head`` (read by ``compute_logits``), with the kernel
    ``packed_kernel_for`` picks: a no-op for ``"torch"`` (off the CPU, ``cpu_gemm`` ``torch``, or
    no oneDNN inner product for ``dtype``).

    The packed layer is ``PackedLinear`` (oneDNN), for float32 on AVX-512 / AVX2 + FMA CPUs the
    batch-invariant ``layers.f32_gemm.F32Linear``, or for bfloat16 the batch-invariant
    ``layers.bf16_gemm.Bf16Linear`` on the AMX GEMM (AMX CPUs), the AVX-512 GEMM (other AVX-512 BF16
    CPUs) or the AVX2 GEMM (AVX2 + FMA CPUs without native bf16) (``packed_kernel_for``). A layer
    whose input width the kernel cannot take (AMX: not a multiple of 32; AVX-512, AVX2: odd) runs
    the next one (AVX-512 GEMM, then oneDNN, or ``F.linear`` where oneDNN has no bf16 kernel), fixed
    per layer, so the model stays batch-invariant wherever a GEMM of ours runs.

    Args:
        kernel: the kernel already chosen (the kernel plan's); None: ``packed_kernel_for(dtype,
            device, cpu_gemm, cpu_isa, cpu_bf16_gemm=cpu_bf16_gemm, cpu_f32_gemm=cpu_f32_gemm)``.
    Returns:
        Bytes of packed copies added next to the weights the model keeps (the tied LM head), 0
        when nothing was packed.
    Raises:
        ValueError: for a bad ``cpu_gemm``, ``cpu_bf16_gemm`` or ``cpu_f32_gemm``.
    """
    if kernel is None:
        kernel = packed_kernel_for(dtype, device, cpu_gemm, cpu_isa, cpu_bf16_gemm=cpu_bf16_gemm,
                                   cpu_f32_gemm=cpu_f32_gemm)[0]
    if kernel == CpuGemm.TORCH.value:
        return 0
    hint = max(1, int(batch_hint))
    if kernel == CpuGemm.ONEDNN.value:
        def make(weight, bias):
            return PackedLinear(weight, bias, hint)
    elif kernel == F32_KERNEL:
        from pagedllm.layers.f32_gemm import F32Linear, load_f32_gemm

        module = load_f32_gemm()

        def make(weight, bias):
            return F32Linear(weight, bias, module)
    else:
        from pagedllm.layers.bf16_gemm import (AMX_KERNEL, BF16_KERNEL, Bf16Linear, bf16_kernel_for, bf16_module,
                                               k_multiple, load_bf16_gemm)

        module = bf16_module(kernel)

        def make(weight, bias):
            # the chosen GEMM, then (for input widths it cannot take) the AVX-512 GEMM, then oneDNN
            if weight.shape[1] % k_multiple(module) == 0:
                return Bf16Linear(weight, bias, module)
            if kernel == AMX_KERNEL and weight.shape[1] % 2 == 0 \
                    and bf16_kernel_for(cpu_isa, kernel=BF16_KERNEL)[0] == BF16_KERNEL:
                return Bf16Linear(weight, bias, load_bf16_gemm())
            if onednn_linear_available(weight.dtype):
                return PackedLinear(weight, bias, hint)
            return plain_linear(weight, bias)
    replaced, tied = replace_linear_layers(model, make)
    weight = model.get_input_embeddings().weight if tied else None
    extra = weight.numel() * weight.element_size() if tied else 0
    logger.debug("%s packed %d linear layers%s", kernel, replaced,
                 f" and the tied LM head (+{extra / 2**20:.0f} MiB)" if extra else "")
    return extra


def plain_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` (``F.linear``) holding ``weight`` [out, in] and ``bias`` [out] or None as they
    are (no copy): what ``pack_linear_layers`` keeps for a layer no packed kernel can take."""
    layer = nn.Linear(int(weight.shape[1]), int(weight.shape[0]), bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return layer


def lm_head_logits(model: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """[N, hidden] -> [N, vocab] through the tied head's kernel copy (``packed_lm_head``: oneDNN or
    int8), else ``model.get_lm_head()``: the ``lm_head`` module, or the embedding matrix (tied)."""
    packed = getattr(model, "packed_lm_head", None)
    if packed is not None:
        return packed(hidden_states)
    head = model.get_lm_head()
    if isinstance(head, nn.Embedding):
        return F.linear(hidden_states, head.weight)
    return head(hidden_states)
