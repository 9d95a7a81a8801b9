"""Rotary position embedding (RoPE, Su et al. 2021), bit-exact with transformers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.config import SUPPORTED_ROPE_TYPES


def compute_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] float32 and the cos/sin scaling factor.

    Supports rope types "default", "linear", "dynamic" (within the original context, where it is
    plain RoPE), "longrope" (its short factors), "llama3" (Llama 3.1's frequency-dependent
    scaling, as in transformers' ``_compute_llama3_parameters``) and "yarn" (Peng et al. 2023, as
    ``_compute_yarn_parameters``: a ramp between interpolated and extrapolated frequencies, cos/sin
    times the attention factor).

    Raises:
        ValueError: for other rope types (``config.SUPPORTED_ROPE_TYPES``),
            naming the type, or a yarn dict without ``factor`` / ``original_max_position_embeddings``.
    """
    # On the CPU even inside a ``torch.device("meta")`` block (the model is built there): a meta
    # ``arange`` runs torch's Python reference and imports sympy on first use (~0.5 s of a start).
    positions = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
    inv_freq = 1.0 / (rope_theta ** (positions.to(torch.float) / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(rope_scaling["factor"])
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        old_context_len = float(rope_scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope_theta, rope_scaling)
    if rope_type == "dynamic":
        # Dynamic NTK (transformers' ``_compute_dynamic_ntk_parameters``) at sequence lengths up to
        # ``max_position_embeddings`` (filled in by loaders.hf_config.hf_architecture_fields): the base times
        # (factor * L / L - (factor - 1)) ** (D / (D - 2)), i.e. plain RoPE, in transformers' ops.
        factor, length = float(rope_scaling["factor"]), rope_scaling["max_position_embeddings"]
        base = rope_theta * ((factor * length / length) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base ** (positions.to(torch.float) / head_dim)), 1.0
    if rope_type in ("longrope", "su"):
        return _longrope_short_inv_freq(head_dim, rope_theta, rope_scaling)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")


def _longrope_short_inv_freq(dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """LongRoPE (Ding et al. 2024; Phi-3) within the original context: the short factors, as
    transformers' ``_compute_longrope_parameters`` below ``original_max_position_embeddings``.
    ``factor`` and ``original_max_position_embeddings`` are filled in by ``loaders.hf_config.hf_architecture_fields``."""
    factor = float(scaling["factor"])
    original_max = float(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    short = torch.tensor(scaling["short_factor"], dtype=torch.float32, device="cpu")
    if short.numel() != dim // 2:
        raise ValueError(f"longrope short_factor has {short.numel()} entries for rotary dim {dim} (needs {dim // 2})")
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (short * base ** shape), float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies [dim // 2] float32 and attention factor (transformers'
    ``_compute_yarn_parameters``, same float32 ops)."""
    try:
        factor = float(scaling["factor"])
        original_max = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise ValueError(f"rope_scaling type 'yarn' needs {e.args[0]!r}") from None
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(torch.float) / dim)
    extrapolation = 1 - ramp                               # 1: keep the original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """RoPE cos/sin for a batch of positions (neox / "rotate_half" layout).

    cos/sin rows are computed as transformers does (``position * inv_freq`` in float32, then
    cos/sin, times the scaling, cast to the model dtype), for positions 0..N-1 at once, and kept
    in a table that doubles when a larger position comes; a step gathers its positions' rows
    (one ``index_select`` each instead of ten elementwise ops over [T, head_dim] per RoPE kind
    and step). The same float32 products and the same vectorized cos/sin give the same values as
    computing them per step. The table is shared by every layer of that kind; at most
    2 x ``max position`` x ``head_dim`` values in the model dtype.

    Args:
        head_dim: rotary dimension (the whole head, or its first ``partial_rotary_factor`` part:
            ``apply_rotary`` rotates that many channels and passes the rest).
        rope_theta: base.
        rope_scaling: HF ``rope_scaling`` / ``rope_parameters`` dict or None.
    """

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim, self.rope_theta, self.rope_scaling = head_dim, rope_theta, rope_scaling
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute ``inv_freq`` in float32, e.g. after ``to_empty`` from the meta device."""
        inv_freq, self.attention_scaling = compute_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        self._table: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}   # dtype -> (cos, sin) [N, D]

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, head_dim] in ``dtype``, for int64 ``positions`` [T]."""
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]   # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                # [T, D]
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions``.

        Args:
            positions: [num_tokens] int64.
            dtype: the model dtype.
        Returns:
            (cos, sin), each [num_tokens, 1, head_dim] in ``dtype``.
        """
        if positions.numel() == 0:
            cos, sin = self._compute(positions, dtype)
            return cos.unsqueeze(1), sin.unsqueeze(1)
        table = self._table.get(dtype)
        needed = int(positions.max()) + 1
        if table is None or table[0].shape[0] < needed:
            size = max(256, 1 << (needed - 1).bit_length())   # the next power of two
            table = self._compute(torch.arange(size, device=positions.device), dtype)
            self._table[dtype] = table
        cos = table[0].index_select(0, positions).unsqueeze(1)                 # [T, 1, D]
        sin = table[1].index_select(0, positions).unsqueeze(1)
        return cos, sin


def apply_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [T, Hq, D] and key [T, Hkv, D] by cos/sin [T, 1, R]; same shapes and dtype.
    With R < D (partial rotary) the first R channels rotate and the rest pass (transformers' Phi-3)."""
    rot = cos.shape[-1]
    if rot == query.shape[-1]:
        return _apply(query, cos, sin), _apply(key, cos, sin)
    return tuple(torch.cat([_apply(x[..., :rot], cos, sin), x[..., rot:]], dim=-1) for x in (query, key))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos) + (_rotate_half(x) * sin)
