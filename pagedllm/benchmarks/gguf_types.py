"""GGUF tensors in any supported ggml type, for the quant-type tests and benchmark.

gguf-py quantizes F32/F16/BF16 and the legacy block types (Q4_0 ... Q8_0) in numpy, but not the
K-quants or IQ4_XS (``gguf.quants.quantize`` raises ``NotImplementedError``). For those
:func:`random_blocks` builds valid blocks: random bytes (every bit pattern of the packed quants,
scales and grid indices is a legal block) with the f16 scale fields (``d``, ``dmin``, ``m``; byte
offsets from ggml's ``block_*`` structs in ``ggml-common.h``) set to finite values chosen so each
block's values average ~0 and stay within ``max_abs``. Dequantization work does not depend on the values, so
such tensors time the loader as real ones would.
"""

from __future__ import annotations

import numpy as np

# Byte offsets of the f16 scale fields in one block of each block type (ggml-common.h).
F16_SCALE_OFFSETS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,),        # d, qs[16]
    "Q4_1": (0, 2),      # d, m, qs[16]
    "Q5_0": (0,),        # d, qh[4], qs[16]
    "Q5_1": (0, 2),      # d, m, qh[4], qs[16]
    "Q8_0": (0,),        # d, qs[32]
    "Q2_K": (80, 82),    # scales[16], qs[64], d, dmin
    "Q3_K": (108,),      # hmask[32], qs[64], scales[12], d
    "Q4_K": (0, 2),      # d, dmin, scales[12], qs[128]
    "Q5_K": (0, 2),      # d, dmin, scales[12], qh[32], qs[128]
    "Q6_K": (208,),      # ql[128], qh[64], scales[16], d
    "IQ4_XS": (0,),      # d, scales_h, scales_l[4], qs[128]
}


def _set_scales(blocks: np.ndarray, offsets: tuple[int, ...], values: np.ndarray) -> None:
    """Write f16 ``values`` [n_blocks] into every scale field of ``blocks`` [n_blocks, type_size]."""
    as_bytes = values.astype(np.float16).view(np.uint8).reshape(-1, 2)
    for offset in offsets:
        blocks[:, offset:offset + 2] = as_bytes


def random_blocks(type_name: str, shape: tuple[int, ...], rng: np.random.Generator,
                  max_abs: float = 0.1) -> np.ndarray:
    """Valid random GGUF data of ``type_name`` for a tensor of torch ``shape``.

    Args:
        type_name: a key of :data:`F16_SCALE_OFFSETS` (``"Q4_K"``, ``"IQ4_XS"``, ...).
        shape: torch order; ``shape[-1]`` must be a multiple of the type's block size.
        rng: the random source (seeded by the caller).
        max_abs: bound of ``|value|`` after dequantization (before f16 rounding of the scales).
    Returns:
        uint8 array ``[*shape[:-1], shape[-1] // block_size * type_size]`` (the layout
        ``gguf.GGUFWriter.add_tensor(..., raw_dtype=type)`` takes).
    Raises:
        ValueError: for a type outside the table or a row length that is not a block multiple.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize, quant_shape_to_byte_shape

    if type_name not in F16_SCALE_OFFSETS:
        raise ValueError(f"type_name must be one of {sorted(F16_SCALE_OFFSETS)}, got {type_name!r}")
    qtype = GGMLQuantizationType[type_name]
    byte_shape = quant_shape_to_byte_shape(shape, qtype)  # raises ValueError on a bad row length
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=int(np.prod(byte_shape)), dtype=np.uint8).reshape(-1, type_size)
    offsets = F16_SCALE_OFFSETS[type_name]
    n_blocks = len(blocks)
    ones, zeros = np.ones(n_blocks, np.float32), np.zeros(n_blocks, np.float32)
    # Values are linear in the scales: value = d * A + f * B for the scale ``d`` and, in types
    # with a second field (``m`` / ``dmin``), its value ``f``. Pick ``f = -d * mean(A) / mean(B)``
    # so each block averages ~0 (unsigned quants would otherwise bias every weight one way).
    _set_scales(blocks, offsets[:1], ones)
    if len(offsets) > 1:
        _set_scales(blocks, offsets[1:], zeros)
        mean_a = dequantize(blocks, qtype).mean(axis=-1)
        _set_scales(blocks, offsets[:1], zeros)
        _set_scales(blocks, offsets[1:], ones)
        mean_b = dequantize(blocks, qtype).mean(axis=-1)
        offset = np.where(mean_b != 0, -mean_a / np.where(mean_b != 0, mean_b, 1), 0).astype(np.float32)
        _set_scales(blocks, offsets[:1], ones)
        _set_scales(blocks, offsets[1:], offset)
    else:
        offset = zeros
    # With d = 1 a block's peak |value| is ``peak``; scale each block to u * max_abs / peak
    # (u uniform in [0.5, 1]).
    peak = np.abs(dequantize(blocks, qtype)).max(axis=-1)
    scale = rng.uniform(0.5, 1.0, n_blocks) * max_abs / np.maximum(peak, 1e-6)
    _set_scales(blocks, offsets[:1], scale)
    if len(offsets) > 1:
        _set_scales(blocks, offsets[1:], scale * offset)
    return blocks.reshape(byte_shape)


def encode(type_name: str, data: np.ndarray, rng: np.random.Generator,
           max_abs: float = 0.1) -> tuple[np.ndarray, int | None]:
    """``data`` (float32) stored as ``type_name``: quantized by gguf-py where it can, else random
    valid blocks of the same shape (:func:`random_blocks`).

    Returns:
        (array, raw ggml type or None) as ``gguf.GGUFWriter.add_tensor(name, array,
        raw_dtype=...)`` takes them (None: F32/F16 arrays whose dtype says the type).
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[type_name]
    if type_name == "F32":
        return data.astype(np.float32), None
    if type_name == "F16":
        return data.astype(np.float16), None
    try:
        return quantize(data, qtype), qtype
    except NotImplementedError:
        return random_blocks(type_name, data.shape, rng, max_abs), qtype
