"""Opt-in int8 linear layers on the CPU (``quantization="int8"``): W8A8 with dynamic activations.

Weights are quantized once after loading, symmetrically per output channel:
``scale[o] = max_i |W[o, i]| / 63``, ``Wq[o, i] = round(W[o, i] / scale[o])`` (int8 storage,
7-bit range: ``WEIGHT_QMAX``; the per-channel scheme of Jacob et al. 2018, "Quantization and
Training of Neural Networks for Efficient Integer-Arithmetic-Only Inference", with zero point 0).
At run time each token's activation row is divided by its own max |x| (per-token dynamic
activation scaling, as in vLLM's dynamic W8A8 and LLM.int8(), Dettmers et al. 2022); two constant
columns (+1, -1, against zero weights) pin the input's range to exactly [-1, 1]; fbgemm quantizes
the input to uint8 with the scale and zero point of that range
(``torch.ops.quantized.linear_dynamic``), multiplies in integers with 32-bit accumulation and
returns float32; the row's scale is undone and the bias added. So a request's result does not
depend on what else is in the batch.

What it costs: results are no longer those of the float32 model. ``pagedllm bench accuracy`` measures the cost against float32 (README, Benchmarks).
What it gives on this project's CPU: ``pagedllm bench kernels`` and docs/performance.md.

fbgemm ships in torch's x86 builds; torch marks its quantized-tensor API as deprecated (in favour
of torchao), so ``int8_linear_available`` probes it once and the engine refuses ``int8`` where it
does not run.
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import KernelLinear, replace_linear_layers, replaceable_weight_bytes

logger = logging.getLogger(__name__)

# Weights use 7 of int8's bits (|q| <= 63) so that activations can use all 8 (uint8 0..255):
# AVX2's vpmaddubsw adds two uint8 x int8 products into a saturating int16, and
# 255 * 63 * 2 = 32130 < 2**15, where 255 * 127 * 2 would overflow. 7-bit weights with 8-bit
# activations cost less perplexity than 8-bit weights with 7-bit activations (docs/performance.md).
WEIGHT_QMAX = 63


@functools.lru_cache(maxsize=None)
def int8_linear_available() -> bool:
    """Whether fbgemm's dynamic int8 linear runs here (probed with a 2x4x3 call checked against
    ``F.linear`` within the int8 error)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        w = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
        x = torch.arange(8, dtype=torch.float32).reshape(2, 4) / 5
        y = Int8DynamicLinear(w, None)(x)
        return bool(torch.allclose(y, F.linear(x, w), rtol=0.05, atol=0.05))
    except (RuntimeError, AttributeError) as exc:  # no kernel for this CPU, or an old torch
        logger.info("fbgemm int8 linear unavailable: %s", exc)
        return False


def quantize_weight_per_channel(weight: torch.Tensor, qmax: int = WEIGHT_QMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization of a [out, in] float weight:
    ``scale[o] = max_i |W[o, i]| / qmax``, ``wq = round(W / scale)`` in [-qmax, qmax].

    Returns:
        (wq [out, in] int8, scale [out] float32) with ``W ~= wq * scale[:, None]``; a row of zeros
        gets scale 1.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / float(qmax)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    wq = torch.round(w / scale[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return wq, scale


class Int8DynamicLinear(KernelLinear):
    """``y = x @ W^T + b`` with ``W`` int8 per output channel and ``x`` scaled per token, then
    quantized to uint8 per call (fbgemm).

    Args:
        weight: [out_features, in_features] float (quantized here; the float copy is not kept).
        bias: [out_features] or None (kept in float32).
        reduce_range: quantize activations to 7 bits instead of 8 (fbgemm's guard against int16
            saturation, needed only with ``weight_qmax`` above 63).
        weight_qmax: largest |int8| weight value (``WEIGHT_QMAX``).
    Shapes:
        x: [..., in_features] float32 -> [..., out_features] float32.
    Raises:
        RuntimeError: from torch if fbgemm is missing (check ``int8_linear_available`` first).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, reduce_range: bool = False,
                 weight_qmax: int = WEIGHT_QMAX) -> None:
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.reduce_range = reduce_range
        wq, scale = quantize_weight_per_channel(weight, weight_qmax)
        torch.backends.quantized.engine = "fbgemm"  # torch's process-wide quantized engine
        with warnings.catch_warnings():  # torch's notice that quantized tensors are deprecated
            warnings.simplefilter("ignore")
            wq_pinned = torch.cat([wq, torch.zeros(self.out_features, 2, dtype=torch.int8)], dim=1)  # [out, in + 2]
            qweight = torch._make_per_channel_quantized_tensor(
                wq_pinned, scale.double(), torch.zeros(self.out_features, dtype=torch.long), 0)
            self.packed_params = torch.ops.quantized.linear_prepack(qweight, None)
        self.range_pins = torch.tensor([[1.0, -1.0]])   # the two extra input columns (forward)
        # The bias is added after the per-token rescaling, so it stays out of the packed kernel.
        self.bias = None if bias is None else bias.detach().float().clone()
        self.weight_bytes = wq_pinned.numel() + 4 * scale.numel() + (0 if bias is None else 4 * bias.numel())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()
        # Per-token scaling: row r is divided by its own max |x| (so it lies in [-1, 1]) and its
        # output multiplied back ((x / r) W^T r = x W^T). Two extra input columns hold +1 and -1
        # against zero weight columns: they add nothing to y, but they make fbgemm's per-call
        # [min, max] exactly [-1, 1] for every batch, so a row's quantization, and with it a
        # request's result, does not depend on the other rows of the batch.
        row_max = x2.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30)                # [M, 1]
        xn = torch.cat([x2 / row_max, self.range_pins.expand(x2.shape[0], 2)], dim=1)  # [M, in + 2]
        y = torch.ops.quantized.linear_dynamic(xn, self.packed_params, self.reduce_range).mul_(row_max)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_linear_layers(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by an ``Int8DynamicLinear`` and, for a model with a
    tied LM head, set ``model.packed_lm_head`` to an int8 copy of the embedding matrix (read by
    ``layers.linear.lm_head_logits``; the float embedding stays for the token lookup).

    Returns:
        Weight bytes held after quantization by the replaced layers and the int8 head, minus the
        bytes freed (negative when memory was saved).
    Raises:
        ValueError: if the model is not on the CPU in float32, or fbgemm's int8 linear does not run here.
    """
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        raise ValueError(f"quantization='int8' needs a float32 model on the CPU, got {param.dtype} on {param.device}")
    if not int8_linear_available():
        raise ValueError("quantization='int8' needs torch's fbgemm engine (x86 CPU builds); it is unavailable here")
    before = replaceable_weight_bytes(model)
    replaced, tied = replace_linear_layers(model, Int8DynamicLinear)
    delta = sum(m.weight_bytes for m in model.modules() if isinstance(m, Int8DynamicLinear)) - before
    logger.debug("int8: quantized %d linear layers%s (%+.0f MiB)", replaced,
                 " and the tied LM head" if tied else "", delta / 2**20)
    return delta
