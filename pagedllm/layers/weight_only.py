"""Opt-in weight-only quantization on the CPU: int8 or 4-bit weights, float activations.

Two modes (``ModelConfig.quantization``), named as torchao and Hugging Face's ``TorchAoConfig``
name them (``Int8WeightOnlyConfig`` / ``"int8_weight_only"``, ``Int4WeightOnlyConfig`` /
``"int4_weight_only"``):

- ``int8_weight_only``: ``W[o, i] ~= q[o, i] * s[o]`` with ``q`` int8 in [-127, 127] and one
  scale per output channel, ``s[o] = max_i |W[o, i]| / 127`` (symmetric, zero point 0). Kernels:
  on CPUs with AVX-512 VNNI our own (``layers/int8_gemm.py``: the activation row in 16-bit fixed
  point, exact integer sums, faster than torch's at decode row counts); elsewhere, or with
  ``cpu_isa`` below ``avx512``, torch's ``aten._weight_int8pack_mm(x, q, s)`` (the kernel behind
  torchao's int8 weight-only layout on the CPU).
- ``int4_weight_only``: ``W[o, i] ~= (q[o, i] - 8) * s[o, g] + z[o, g]`` with ``q`` in [0, 15]
  and one (scale, zero) pair per output channel and group ``g = i // group_size`` of input
  columns (asymmetric min/max per group: ``s = (max - min) / 15``, ``z = min + 8 s``; torchao's
  ``int4_weight_only`` with its float zero-point domain; GGUF's Q4_K uses 32-column blocks too).
  Kernel: ``aten._weight_int4pack_mm_for_cpu`` on weights packed once by
  ``aten._convert_weight_to_int4pack_for_cpu``.

Activations are not quantized to 8 or 4 bits: the error is the weights' rounding plus the
activation row's rounding to bfloat16 (torch's kernels) or to 16-bit fixed point (the VNNI kernel,
finer for every element above max|x| / 128), and a request's result does not depend on the rest of
the batch. torch's kernels take the activation in the same dtype as the scales (``compute_dtype``). In torch 2.13 their float32 paths are much slower than their
bfloat16 paths at decode row counts (docs/performance.md), so a float32 model runs
these layers with bfloat16 inputs and scales by default (``WEIGHT_ONLY_COMPUTE_DTYPE``): the
input row is rounded to bfloat16, products are accumulated in float32 by the kernel, and the
output is rounded to bfloat16, then widened back to the model dtype.

Every ``nn.Linear`` of the decoder and the LM head are replaced (a tied head gets its own
quantized copy; the float embedding stays for the token lookup). In ``int4_weight_only`` the LM
head is int8 per channel (``HEAD_MODE``), as llama.cpp's Q4_K_M files keep their output / token
embedding matrix at 8 bits: a 4-bit head costs perplexity (``bench accuracy``, docs/benchmarks.md). Most of int4's cost is the decoder
layers: the default model's "Q4_K_M" GGUF stores q/k/v/gate/up in Q5_0 and half of v / down in
Q8_0 / Q6_K, so 4 bits per weight is less than the file has.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from pagedllm.layers.int8_gemm import TORCH_KERNEL, VNNI_KERNEL, VNNI_MAX_COLUMNS, int8_kernel_for, load_int8_gemm
from pagedllm.layers.linear import KernelLinear, replace_linear_layers, replaceable_weight_bytes

logger = logging.getLogger(__name__)

INT8_WEIGHT_ONLY = "int8_weight_only"
INT4_WEIGHT_ONLY = "int4_weight_only"
WEIGHT_ONLY_MODES = (INT8_WEIGHT_ONLY, INT4_WEIGHT_ONLY)
# Input columns that share one (scale, zero) pair in int4 (GGUF Q4_K's sub-block; torchao's
# default is 128: docs/performance.md compares the perplexity cost).
INT4_GROUP_SIZE = 32
# The LM head's mode under each mode (see the module docstring).
HEAD_MODE = {INT8_WEIGHT_ONLY: INT8_WEIGHT_ONLY, INT4_WEIGHT_ONLY: INT8_WEIGHT_ONLY}
# int8 layers' in_features must be a multiple of this (both kernels step 16 columns at a time).
INT8_COLUMN_MULTIPLE = 16
# The dtype the kernels run in when the model is float32 (see the module docstring).
WEIGHT_ONLY_COMPUTE_DTYPE = torch.bfloat16
# ``_convert_weight_to_int4pack_for_cpu`` packs output rows in tiles of 16: a layer whose
# out_features is not a multiple gets zero rows appended, and its output is cut back.
_INT4_ROW_TILE = 16
# ``_convert_weight_to_int4pack_for_cpu``'s tiling argument (the CPU kernel accepts 1, 2, 4, 8
# and packs the same way for each).
_INNER_K_TILES = 1


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``s[o] = max_i |W[o, i]| / 127``, ``q = round(W / s)``.

    Args:
        weight: [out, in] float.
    Returns:
        (q [out, in] int8 in [-127, 127], s [out] float32) with ``W ~= q * s[:, None]``; an all-zero
        row gets scale 1.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4_groupwise(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization per output channel and group of ``group_size`` input columns
    (min/max per group): ``s = (max - min) / 15``, ``q = round((W - min) / s)`` in [0, 15],
    ``z = min + 8 s``, so that ``W ~= (q - 8) * s + z`` (the form ``_weight_int4pack_mm_for_cpu``
    computes).

    Args:
        weight: [out, in] float; ``in`` must be a multiple of ``group_size``.
        group_size: columns per group.
    Returns:
        (q [out, in] int32 in [0, 15], scale [out, in // group_size] float32,
        zero [out, in // group_size] float32); a constant group gets scale 1.
    Raises:
        ValueError: if ``in`` is not a multiple of ``group_size``.
    """
    w = weight.detach().float()
    out_features, in_features = w.shape
    if in_features % group_size:
        raise ValueError(f"int4 weight-only: in_features={in_features} is not a multiple of group_size={group_size}")
    g = w.view(out_features, in_features // group_size, group_size)          # [out, G, group]
    lo, hi = g.amin(dim=2), g.amax(dim=2)                                     # [out, G]
    scale = (hi - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32)
    zero = lo + 8.0 * scale
    return q.view(out_features, in_features), scale, zero


class _WeightOnlyLinear(KernelLinear):
    """Common parts: bias, compute dtype, reshaping. Subclasses set ``_matmul(x2)``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.compute_dtype = compute_dtype
        self.bias = None if bias is None else bias.detach().float().clone()
        self.bias_bytes = 0 if self.bias is None else 4 * self.bias.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.compute_dtype).contiguous()
        y = self._matmul(x2).to(x.dtype)
        if self.bias is not None:
            y = y.add_(self.bias.to(x.dtype))
        return y.view(*lead, self.out_features)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8WeightOnlyLinear(_WeightOnlyLinear):
    """``y = x @ (q * s[:, None])^T + b`` with ``q`` int8 per output channel (``int8_weight_only``).

    Args:
        weight: [out_features, in_features] float (quantized here; the float copy is not kept).
        bias: [out_features] or None (kept in float32, added after the kernel).
        compute_dtype: dtype of the torch kernel's input, scales and output (bfloat16 or float32).
        kernel: ``"torch"`` (``aten._weight_int8pack_mm``, any CPU) or ``"vnni"`` (``layers/int8_gemm.py``:
            AVX-512 VNNI, activations in 16-bit fixed point, output in the input's dtype; a layer
            wider than it sums in int32 falls back to "torch"). Both use the same codes and the
            same bfloat16-rounded scales, so the dequantized weight is the same.
    Shapes:
        x: [..., in_features] float -> [..., out_features], x's dtype.
    Raises:
        ValueError: for an unknown kernel, or in_features not a multiple of 16 (torch's kernel
            crashes on such rows in torch 2.13; ours reads 16 columns at a time).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype = WEIGHT_ONLY_COMPUTE_DTYPE, kernel: str = TORCH_KERNEL) -> None:
        super().__init__(weight, bias, compute_dtype)
        if kernel not in (TORCH_KERNEL, VNNI_KERNEL):
            raise ValueError(f"kernel must be {TORCH_KERNEL!r} or {VNNI_KERNEL!r}, got {kernel!r}")
        if self.in_features % INT8_COLUMN_MULTIPLE:
            raise ValueError(f"int8 weight-only: in_features={self.in_features} is not a multiple of "
                             f"{INT8_COLUMN_MULTIPLE} (both kernels read rows in 16-column steps)")
        if kernel == VNNI_KERNEL and self.in_features > VNNI_MAX_COLUMNS:
            kernel = TORCH_KERNEL
        self.kernel = kernel
        q, scale = quantize_int8_per_channel(weight)                          # [out, in] int8
        self.scales = scale.to(compute_dtype)                                  # [out]
        if kernel == VNNI_KERNEL:
            self.qweight = None
            self._ext = load_int8_gemm()                                       # looked up once, not per call
            self.packed_weight, self.row_sums = self._ext.pack_int8_weight(q)  # [out/16, in/4, 64], [out]
            self.scales_f32 = self.scales.float()                              # [out], bfloat16 values
            self.weight_bytes = self.packed_weight.numel() + 4 * self.row_sums.numel() + \
                4 * self.scales_f32.numel() + self.bias_bytes
        else:
            self.qweight = q
            self.weight_bytes = q.numel() + self.scales.numel() * self.scales.element_size() + self.bias_bytes

    def int8_codes(self) -> torch.Tensor:
        """[out, in] int8: the codes the kernel multiplies by."""
        if self.qweight is not None:
            return self.qweight
        return self._ext.unpack_int8_weight(self.packed_weight, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] float32: the weight this layer multiplies by (scales as the kernel sees them)."""
        return self.int8_codes().float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel != VNNI_KERNEL or x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
            return super().forward(x)
        lead = x.shape[:-1]
        y = self._ext.int8_weight_only_mm(x.reshape(-1, self.in_features).contiguous(), self.packed_weight,
                                          self.row_sums, self.scales_f32, self.bias, self.out_features)
        return y.view(*lead, self.out_features)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight-only ({self.kernel})"


class Int4WeightOnlyLinear(_WeightOnlyLinear):
    """``y = x @ W_dq^T + b`` with ``W_dq[o, i] = (q[o, i] - 8) * s[o, i // G] + z[o, i // G]`` and
    ``q`` 4-bit (``int4_weight_only``; packed two to a byte by torch's CPU int4 layout).

    Args:
        weight: [out_features, in_features] float; in_features a multiple of ``group_size``.
        bias: [out_features] or None.
        group_size: input columns per (scale, zero) pair.
        compute_dtype: dtype of the kernel's input, scales and output (bfloat16 or float32).
    Shapes:
        x: [..., in_features] float -> [..., out_features], x's dtype.
    Raises:
        ValueError: if in_features is not a multiple of ``group_size``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int = INT4_GROUP_SIZE,
                 compute_dtype: torch.dtype = WEIGHT_ONLY_COMPUTE_DTYPE) -> None:
        super().__init__(weight, bias, compute_dtype)
        self.group_size = int(group_size)
        q, scale, zero = quantize_int4_groupwise(weight, self.group_size)
        pad = -self.out_features % _INT4_ROW_TILE
        if pad:  # zero rows: code 8 with scale 1 and zero 0 (they are cut from the output)
            q = torch.cat([q, torch.full((pad, self.in_features), 8, dtype=q.dtype)])
            scale = torch.cat([scale, torch.ones(pad, scale.shape[1])])
            zero = torch.cat([zero, torch.zeros(pad, zero.shape[1])])
        self.padded_out_features = self.out_features + pad
        self.packed_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES)  # [out, in / 2] uint8
        # The kernel's layout: [in // G, out, 2] with (scale, zero) last.
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(compute_dtype).contiguous()
        self.weight_bytes = self.packed_weight.numel() + \
            self.scales_and_zeros.numel() * self.scales_and_zeros.element_size() + self.bias_bytes

    def int4_codes(self) -> torch.Tensor:
        """[out, in] int32 in [0, 15]: the codes the packed layout holds, read back through the
        kernel itself (identity input, scale 1 and zero 8 give ``(q - 8) * 1 + 8 = q``, exact in
        bfloat16)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        unit = torch.empty_like(self.scales_and_zeros, dtype=torch.bfloat16)
        unit[..., 0], unit[..., 1] = 1.0, 8.0
        q = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed_weight, self.group_size, unit)  # [in, out]
        return q.t().to(torch.int32)

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] float32: ``(q - 8) * s + z`` with the codes read back from the packed layout
        and the scales / zeros as the kernel sees them."""
        sz = self.scales_and_zeros.float()                                 # [G, out, 2]
        s = sz[..., 0].t().repeat_interleave(self.group_size, dim=1)       # [out, in]
        z = sz[..., 1].t().repeat_interleave(self.group_size, dim=1)
        return ((self.int4_codes().float() - 8.0) * s + z)[: self.out_features]

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed_weight, self.group_size,
                                                       self.scales_and_zeros)
        return y if self.padded_out_features == self.out_features else y[:, : self.out_features]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 weight-only, group_size={self.group_size}")


@functools.lru_cache(maxsize=None)
def weight_only_available(mode: str) -> bool:
    """Whether ``mode``'s kernel runs here (probed once with a small call checked against the
    dequantized float product)."""
    try:
        w = (torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64) % 13 - 6) / 7
        x = torch.arange(2 * 64, dtype=torch.float32).reshape(2, 64) / 50
        layer = make_weight_only_layer(mode, w, None, WEIGHT_ONLY_COMPUTE_DTYPE)
        ref = x.to(WEIGHT_ONLY_COMPUTE_DTYPE).float() @ layer.dequantized_weight().t()
        return bool(torch.allclose(layer(x), ref, rtol=2e-2, atol=2e-2))
    except (RuntimeError, AttributeError, NotImplementedError) as exc:  # no kernel here, or an old torch
        logger.warning("%s unavailable: %s", mode, exc)
        return False


def make_weight_only_layer(mode: str, weight: torch.Tensor, bias: torch.Tensor | None,
                           compute_dtype: torch.dtype, int8_kernel: str = TORCH_KERNEL) -> KernelLinear:
    """The ``mode`` layer for ``weight`` [out, in] and ``bias``; ``int8_kernel`` is the int8 layers'
    kernel (``Int8WeightOnlyLinear``'s ``kernel``).

    Raises:
        ValueError: for an unknown mode or kernel.
    """
    if mode == INT8_WEIGHT_ONLY:
        return Int8WeightOnlyLinear(weight, bias, compute_dtype, int8_kernel)
    if mode == INT4_WEIGHT_ONLY:
        return Int4WeightOnlyLinear(weight, bias, INT4_GROUP_SIZE, compute_dtype)
    raise ValueError(f"quantization must be one of {WEIGHT_ONLY_MODES} here, got {mode!r}")


def quantize_weight_only(model: nn.Module, mode: str, cpu_isa: str = "auto", int8_kernel: str | None = None) -> int:
    """Replace every ``nn.Linear`` of ``model`` by the ``mode`` weight-only layer and give a tied
    LM head its own quantized copy (``model.packed_lm_head``, read by ``lm_head_logits``), in
    ``HEAD_MODE[mode]``.

    The torch kernels run in bfloat16 for a float32 or bfloat16 model (``WEIGHT_ONLY_COMPUTE_DTYPE``);
    int8 layers (and the head) run ``int8_kernel`` (the kernel plan's; None: the one
    ``layers.int8_gemm.int8_kernel_for(cpu_isa)`` picks, the AVX-512 VNNI kernel where it can).

    Returns:
        Weight bytes held after quantization by the replaced layers and the head's copy, minus
        the bytes freed (negative when memory was saved).
    Raises:
        ValueError: if the model is not on the CPU in float32 or bfloat16, or the kernel does not
            run here.
    """
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantization={mode!r} needs a float32 or bfloat16 model on the CPU, "
                         f"got {param.dtype} on {param.device}")
    if not weight_only_available(mode):
        raise ValueError(f"quantization={mode!r}: torch's CPU kernel does not run here (torch {torch.__version__})")
    before = replaceable_weight_bytes(model)
    if int8_kernel is None:
        int8_kernel = int8_kernel_for(cpu_isa)[0]
    replaced, tied = replace_linear_layers(
        model, lambda weight, bias: make_weight_only_layer(mode, weight, bias, WEIGHT_ONLY_COMPUTE_DTYPE, int8_kernel),
        make_head=lambda weight, bias: make_weight_only_layer(HEAD_MODE[mode], weight, bias,
                                                              WEIGHT_ONLY_COMPUTE_DTYPE, int8_kernel))
    delta = sum(m.weight_bytes for m in model.modules() if isinstance(m, _WeightOnlyLinear)) - before
    logger.debug("%s: quantized %d linear layers%s, the LM head in %s (%+.0f MiB against the model's float "
                 "linear layers); int8 kernel: %s", mode,
                 replaced, " (and the tied LM head's copy)" if tied else "", HEAD_MODE[mode], delta / 2**20,
                 int8_kernel)
    return delta
