"""GGUF files: read the header, dequantize tensors to float32 under Hugging Face names, and convert
a file into an HF-style model folder (``config.json``, ``model.safetensors``, tokenizer files).

Format (GGUF v2/v3, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), all little-endian::

    magic "GGUF" | u32 version | u64 tensor_count | u64 metadata_kv_count
    metadata: (string key, u32 value_type, value) * metadata_kv_count
    tensor infos: (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset) * tensor_count
    padding to ``general.alignment`` (default 32) | tensor data (offsets relative to here)

``ne[0]`` is the fastest-moving dimension, so a GGUF shape ``[in, out]`` is the torch shape
``[out, in]``. Quantized types pack ``ne[0]`` into blocks of ``block_size`` values stored in
``type_size`` bytes (``gguf.GGML_QUANT_SIZES``); ``gguf.quants.dequantize`` turns them back into
float32; the types read are :data:`SUPPORTED_GGUF_TYPES`. We parse the header ourselves:
``gguf.GGUFReader`` builds a numpy view per array element and needs ~40 s for the 262k-token
Gemma 3 vocabulary, this reader ~0.5 s.

How llama.cpp's ``convert_hf_to_gguf.py`` changed the weights, undone here as transformers'
``modeling_gguf_pytorch_utils.py`` does (so the result equals
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`` bit for bit in float32):

* Gemma 2/3: every RMSNorm weight was stored as ``w + 1`` (Gemma's norm computes ``x * (1 + w)``,
  llama.cpp's ``x * w``); we subtract 1 in float32.
* Llama: the rows of ``attn_q`` / ``attn_k`` were permuted per head from HF's rotate-half RoPE
  layout to llama.cpp's interleaved one; we apply the inverse permutation (q with
  ``num_attention_heads``, k with ``num_key_value_heads``).

transformers is imported only by :func:`convert_gguf_to_hf_folder` to build the tokenizer once;
reading and dequantizing weights uses ``gguf`` + numpy + torch only. ``gguf`` (~0.1 s to import)
is imported by the functions that read tensors, so a warm start (a cached conversion, which
imports this module for its constants) never loads it.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedllm.loaders.safetensors import (
    SAFETENSORS_SINGLE_NAME,
    TensorSpec,
    write_safetensors_streaming,
)

if TYPE_CHECKING:   # torch loads with the first tensor: reading a header needs none
    import torch

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32  # bytes; llama.cpp's default when general.alignment is absent

# Bump when the conversion output changes, so cached folders from older code are rebuilt.
# 2: the GGUF's tokenizer.chat_template is written as chat_template.jinja.
# 3: tokenizer.json's BPE merges written as "a b" strings (``compact_bpe_merges``).
GGUF_CONVERTER_VERSION = 3

# ggml tensor types this loader reads (``gguf.GGMLQuantizationType`` names), each dequantized by
# ``gguf.quants.dequantize`` and checked bit for bit in tests/loaders/test_gguf_quant_types.py.
# Any other type (IQ2_XXS, TQ1_0, MXFP4, integer types, ...) is a ValueError naming the tensor.
SUPPORTED_GGUF_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS",
)
# Values dequantized per gguf-py call (64 MiB of float32). gguf-py keeps every 16-row group's
# result until it concatenates them (twice the output, plus the groups' temporaries); chunks keep
# that to 2 x 64 MiB for the 262144 x 640 (671 MB float32) embedding of Gemma 3.
_DEQUANT_CHUNK_VALUES = 1 << 24

# Metadata scalar value types (gguf.GGUFValueType) -> struct format. 8 = string, 9 = array.
_SCALAR_FORMAT = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}
_SCALAR_NUMPY = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
    7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}
_VALUE_STRING, _VALUE_ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in a GGUF file.

    Attributes:
        name: GGUF tensor name, e.g. ``blk.0.attn_q.weight``.
        shape: torch order (GGUF's ``ne`` reversed), e.g. ``(1024, 640)`` for a [out, in] weight.
        ggml_type: ``gguf.GGMLQuantizationType`` value (0 F32, 1 F16, 8 Q8_0, 12 Q4_K, 30 BF16...).
        offset: absolute byte offset of the data in the file.
        nbytes: bytes the data occupies.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's metadata and tensor table (no tensor data).

    Attributes:
        path: the file.
        version: GGUF version (2 or 3).
        metadata: key -> value. Scalars are Python ints/floats/bools, strings are ``str``, numeric
            arrays are 1-D numpy arrays, string arrays are lists of ``str``.
        tensors: the tensor table in file order.
        data_start: absolute byte offset of the tensor data section.
    """

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    data_start: int

    @property
    def architecture(self) -> str:
        """``general.architecture``, e.g. ``"gemma3"``, ``"llama"``, ``"qwen2"``."""
        return str(self.metadata["general.architecture"])

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    def arch_value(self, key: str, default: Any = None) -> Any:
        """``metadata[f"{architecture}.{key}"]``, or ``default`` when absent."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        """Like :meth:`arch_value`, but a missing key is an error.

        Raises:
            ValueError: naming the missing key and the file.
        """
        full = f"{self.architecture}.{key}"
        if full not in self.metadata:
            raise ValueError(f"GGUF file {self.path!r} lacks metadata key {full!r}")
        return self.metadata[full]


def _read_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    pos += 8
    return buf[pos:pos + length].decode("utf-8", errors="replace"), pos + length


def _read_value(buf: mmap.mmap, pos: int, value_type: int) -> tuple[Any, int]:
    """One metadata value starting at ``pos``; returns (value, offset just past it)."""
    if value_type in _SCALAR_FORMAT:
        fmt = _SCALAR_FORMAT[value_type]
        (value,) = struct.unpack_from(fmt, buf, pos)
        return value, pos + struct.calcsize(fmt)
    if value_type == _VALUE_STRING:
        return _read_string(buf, pos)
    if value_type == _VALUE_ARRAY:
        element_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if element_type in _SCALAR_NUMPY:
            dtype = np.dtype(_SCALAR_NUMPY[element_type])
            values = np.frombuffer(buf, dtype=dtype, count=count, offset=pos).copy()
            return values, pos + count * dtype.itemsize
        items = []
        for _ in range(count):  # strings (the vocabulary, merges) or nested arrays
            item, pos = _read_value(buf, pos, element_type)
            items.append(item)
        return items, pos
    raise ValueError(f"unknown GGUF metadata value type {value_type} at byte {pos}")


def read_gguf_header(path: str) -> GGUFHeader:
    """Parse a GGUF file's header, metadata and tensor table without touching tensor data.

    Args:
        path: a ``.gguf`` file.
    Returns:
        The :class:`GGUFHeader`.
    Raises:
        ValueError: if the file is not GGUF, has an unsupported version, or is truncated.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{path!r} is not a GGUF file (magic {buf[:4]!r}, expected b'GGUF')")
        try:
            version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
            if version not in (2, 3):
                raise ValueError(f"{path!r} is GGUF version {version}; only versions 2 and 3 are supported")
            pos = 24
            metadata: dict[str, Any] = {}
            for _ in range(kv_count):
                key, pos = _read_string(buf, pos)
                (value_type,) = struct.unpack_from("<I", buf, pos)
                metadata[key], pos = _read_value(buf, pos + 4, value_type)
            raw_infos = []
            for _ in range(tensor_count):
                name, pos = _read_string(buf, pos)
                (n_dims,) = struct.unpack_from("<I", buf, pos)
                dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
                ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
                pos += 4 + 8 * n_dims + 12
                raw_infos.append((name, tuple(reversed(dims)), ggml_type, offset))
        except struct.error as e:
            raise ValueError(f"GGUF file {path!r} is truncated or corrupt: {e}") from e
        file_size = len(buf)
    if "general.architecture" not in metadata:
        raise ValueError(f"GGUF file {path!r} has no general.architecture metadata")
    alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors = []
    for name, shape, ggml_type, offset in raw_infos:
        nbytes = _tensor_nbytes(name, shape, ggml_type)
        start = data_start + offset
        if start + nbytes > file_size:
            raise ValueError(
                f"GGUF tensor {name!r} spans bytes [{start}, {start + nbytes}) past the end of "
                f"{path!r} ({file_size} bytes)")
        tensors.append(GGUFTensorInfo(name, shape, ggml_type, start, nbytes))
    return GGUFHeader(path, version, metadata, tuple(tensors), data_start)


def _tensor_nbytes(name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    """Bytes of a tensor of torch ``shape`` stored as ``ggml_type`` (blocks along the last dim)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise ValueError(f"GGUF tensor {name!r} has unknown ggml type {ggml_type}") from None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if shape and shape[-1] % block_size:
        raise ValueError(
            f"GGUF tensor {name!r} row length {shape[-1]} is not a multiple of the "
            f"{qtype.name} block size {block_size}")
    return numel // block_size * type_size


def check_tensor_type(info: GGUFTensorInfo) -> str:
    """The ggml type name of a tensor this loader reads (one of :data:`SUPPORTED_GGUF_TYPES`).

    Raises:
        ValueError: naming the tensor and its type when the type is not supported.
    """
    from gguf import GGMLQuantizationType

    name = GGMLQuantizationType(info.ggml_type).name
    if name not in SUPPORTED_GGUF_TYPES:
        raise ValueError(
            f"GGUF tensor {info.name!r} has type {name}, which pagedllm does not load; "
            f"supported types: {', '.join(SUPPORTED_GGUF_TYPES)}")
    return name


def _dequantize_iq4_xs(raw: np.ndarray) -> np.ndarray:
    """IQ4_XS rows to float32, bit for bit as gguf-py's ``IQ4_XS.dequantize_blocks`` (the same
    float32 products), faster: the 16-entry codebook is looked up by plain indexing instead
    of ``np.take_along_axis`` over a broadcast table.

    Block (136 bytes, 256 values): f16 ``d`` | u16 ``scales_h`` (2 high bits of 8 scales) |
    ``scales_l[4]`` (low nibbles) | ``qs[128]`` (per 32 values: 16 low nibbles, then 16 high).
    Value = ``d * (scale - 32) * IQ4_NL.kvalues[q]``.

    Args:
        raw: [rows, row_bytes] uint8, ``row_bytes`` a multiple of 136.
    Returns:
        [rows, row_bytes // 136 * 256] float32.
    """
    from gguf.quants import IQ4_NL

    blocks = raw.reshape(-1, 136)
    n = len(blocks)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    scales_h = blocks[:, 2:4].copy().view(np.uint16)  # [n, 1]
    scales_l = blocks[:, 4:8]
    low = np.stack([scales_l & 0x0F, scales_l >> 4], axis=-1).reshape(n, 8)
    high = ((scales_h >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)  # [n, 8]
    scales = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    qs = blocks[:, 8:].reshape(n, 8, 16)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    values = np.array(IQ4_NL.kvalues, dtype=np.int8).astype(np.float32)[codes]  # [n, 8, 32]
    return ((d * scales)[..., None] * values).reshape(raw.shape[0], -1)


# Our own decoders where gguf-py's numpy code is the slow outlier (same results, tested).
_FAST_DEQUANTIZE = {"IQ4_XS": _dequantize_iq4_xs}


def dequantize_tensor(blob: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """Decode one tensor to float32 (exactly as ``gguf.quants.dequantize``; IQ4_XS by
    :func:`_dequantize_iq4_xs`, equal bit for bit).

    Rows are decoded :data:`_DEQUANT_CHUNK_VALUES` values at a time into the output, so the peak
    extra memory is the float32 tensor plus one chunk's temporaries, never the whole file.

    Args:
        blob: the whole file as a uint8 array (``np.memmap(path, np.uint8, mode="r")``).
        info: the tensor's entry from :func:`read_gguf_header`.
    Returns:
        float32 array of shape ``info.shape``, writable, not sharing memory with ``blob``.
    Raises:
        ValueError: for a type outside :data:`SUPPORTED_GGUF_TYPES` (naming tensor and type).
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    fast = _FAST_DEQUANTIZE.get(check_tensor_type(info))
    qtype = GGMLQuantizationType(info.ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row_len = info.shape[-1] if info.shape else 1
    raw = blob[info.offset:info.offset + info.nbytes].reshape(-1, row_len // block_size * type_size)
    out = np.empty((raw.shape[0], row_len), dtype=np.float32)
    step = max(1, _DEQUANT_CHUNK_VALUES // row_len)  # rows per chunk
    for start in range(0, raw.shape[0], step):
        chunk = raw[start:start + step]
        if qtype == GGMLQuantizationType.F32:
            out[start:start + step] = chunk.view(np.float32)
        elif fast is not None:
            out[start:start + step] = fast(chunk)
        else:
            out[start:start + step] = dequantize(chunk, qtype)
    return out.reshape(info.shape)


# ---------------------------------------------------------------------------------------------
# Architectures: GGUF arch -> (HF class, model_type), tensor names, config.
# ---------------------------------------------------------------------------------------------

SUPPORTED_GGUF_ARCHITECTURES = ("gemma2", "gemma3", "granite", "llama", "olmo2", "phi3", "qwen2", "qwen3")

_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 2/3 have four norms per layer (sandwich norms around attention and the MLP).
_GEMMA_LAYER_TENSOR_NAMES = {
    **_LAYER_TENSOR_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# OLMo 2 normalises each sub-block's output (llama.cpp ``Olmo2Model``): no attn_norm / ffn_norm.
_OLMO2_LAYER_TENSOR_NAMES = {
    **{k: v for k, v in _LAYER_TENSOR_NAMES.items() if k not in ("attn_norm", "ffn_norm")},
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 keeps q/k/v and gate/up fused (llama.cpp ``Phi3MiniModel``); the model splits them on loading.
_PHI3_LAYER_TENSOR_NAMES = {**_LAYER_TENSOR_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_LAYER_TENSOR_NAMES_BY_ARCH = {"olmo2": _OLMO2_LAYER_TENSOR_NAMES, "phi3": _PHI3_LAYER_TENSOR_NAMES}
# Phi-3's LongRoPE factors, global tensors in the file and lists in HF's config (``_phi3_config``).
_PHI3_ROPE_FACTOR_TENSORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
# Architectures whose converter (llama.cpp ``LlamaModel`` and its subclasses) interleaves q/k rows.
_QK_PERMUTED_ARCHITECTURES = ("llama", "granite")
# Tensors llama.cpp writes that HF recomputes from the config (llama 3 RoPE frequency factors).
_SKIPPED_TENSORS = frozenset({"rope_freqs.weight"})
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([A-Za-z0-9_]+)\.(weight|bias)$")


def gguf_to_hf_name(gguf_name: str, architecture: str) -> str | None:
    """Hugging Face parameter name of a GGUF tensor.

    Args:
        gguf_name: e.g. ``blk.3.ffn_norm.weight``.
        architecture: ``general.architecture`` of the file.
    Returns:
        e.g. ``model.layers.3.pre_feedforward_layernorm.weight`` (gemma3) or
        ``model.layers.3.post_attention_layernorm.weight`` (llama); ``None`` for tensors HF does not
        store (``rope_freqs.weight``).
    Raises:
        ValueError: for a tensor name this converter does not know.
    """
    if gguf_name in _SKIPPED_TENSORS or (architecture == "phi3" and gguf_name in _PHI3_ROPE_FACTOR_TENSORS):
        return None
    layer_names = _LAYER_TENSOR_NAMES_BY_ARCH.get(architecture) or (
        _GEMMA_LAYER_TENSOR_NAMES if architecture.startswith("gemma") else _LAYER_TENSOR_NAMES)
    match = _LAYER_RE.match(gguf_name)
    if match:
        layer, part, suffix = match.groups()
        if part in layer_names:
            return f"model.layers.{layer}.{layer_names[part]}.{suffix}"
    else:
        base, _, suffix = gguf_name.rpartition(".")
        if base in _GLOBAL_TENSOR_NAMES and suffix in ("weight", "bias"):
            return f"{_GLOBAL_TENSOR_NAMES[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} of architecture {architecture!r} has no known HF name")


def _reverse_llama_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of q/k projections.

    llama.cpp (``LlamaModel.permute``) maps HF rows ``[n_head, 2, head_dim/2]`` to
    ``[n_head, head_dim/2, 2]``; we swap back, exactly as transformers'
    ``LlamaTensorProcessor._reverse_permute_weights``.

    Args:
        weights: [n_head * head_dim, in_features] (or a [n_head * head_dim] bias), float32.
        n_head: heads of this projection (query heads for q, KV heads for k).
    """
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _eos_token_ids(header: GGUFHeader, tokens: list[str] | None) -> list[int]:
    """EOS / end-of-turn ids the file declares, plus Gemma's ``<end_of_turn>`` (dedup, ordered)."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id"):
        value = header.metadata.get(key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    if tokens is not None and header.architecture.startswith("gemma"):
        # llama.cpp treats <end_of_turn> as end-of-generation for Gemma; HF's generation_config
        # lists it too (eos_token_id [1, 106]).
        try:
            end_of_turn = tokens.index("<end_of_turn>")
        except ValueError:
            end_of_turn = None
        if end_of_turn is not None and end_of_turn not in ids:
            ids.append(end_of_turn)
    return ids


def _vocab_size(header: GGUFHeader) -> int:
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    value = header.arch_value("vocab_size")
    if value is not None:
        return int(value)
    if tokens is not None:
        return len(tokens)
    for info in header.tensors:
        if info.name == "token_embd.weight":
            return info.shape[0]
    raise ValueError(f"cannot tell the vocabulary size of GGUF file {header.path!r}")


def _token_ids(header: GGUFHeader) -> dict[str, int | None]:
    def get(key: str) -> int | None:
        value = header.metadata.get(f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    return {
        "bos_token_id": get("bos_token_id"),
        "eos_token_id": get("eos_token_id"),
        "pad_token_id": get("padding_token_id"),
    }


def _rope_scaling(header: GGUFHeader) -> dict[str, Any] | None:
    """Linear RoPE scaling stated in the file (``{arch}.rope.scaling.type/factor``), if any."""
    scaling_type = header.arch_value("rope.scaling.type")
    factor = header.arch_value("rope.scaling.factor")
    if scaling_type in (None, "none") or factor in (None, 0.0, 1.0):
        return None
    if scaling_type != "linear":
        logger.warning("GGUF %s: rope.scaling.type=%r is not converted; using plain RoPE",
                       header.path, scaling_type)
        return None
    return {"rope_type": "linear", "factor": float(factor)}


def _common_config(header: GGUFHeader) -> dict[str, Any]:
    """Fields shared by every decoder-only architecture, named as transformers names them."""
    hidden = int(header.require("embedding_length"))
    heads = int(header.require("attention.head_count"))
    kv_heads = header.arch_value("attention.head_count_kv", heads)
    if isinstance(kv_heads, np.ndarray):  # per-layer list in some files; all equal here
        kv_heads = int(kv_heads.max())
    return {
        "hidden_size": hidden,
        "intermediate_size": int(header.require("feed_forward_length")),
        "num_hidden_layers": int(header.require("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "max_position_embeddings": int(header.require("context_length")),
        "rms_norm_eps": float(header.require("attention.layer_norm_rms_epsilon")),
        "vocab_size": _vocab_size(header),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in header.tensor_names,
        **_token_ids(header),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": "float32",
    }


def _gemma3_config(header: GGUFHeader) -> dict[str, Any]:
    """Gemma 3 text config in the form transformers 5 saves ``Gemma3TextConfig``.

    GGUF keys (llama.cpp ``Gemma3Model``): ``gemma3.{context_length, embedding_length,
    block_count, feed_forward_length, attention.head_count, attention.head_count_kv,
    attention.key_length, attention.layer_norm_rms_epsilon, rope.freq_base,
    attention.sliding_window}``. Not stored, fixed by llama.cpp for Gemma 3: sliding-window pattern
    6 (every 6th layer global), local RoPE base 10000, gelu-tanh MLP, query scale
    ``1/sqrt(head_dim)`` (``1/sqrt(hidden/heads)`` for the 62-layer 27B).
    """
    config = _common_config(header)
    head_dim = int(header.arch_value("attention.key_length",
                                     config["hidden_size"] // config["num_attention_heads"]))
    num_layers = config["num_hidden_layers"]
    sliding_window_pattern = 6
    layer_types = [
        "full_attention" if (i + 1) % sliding_window_pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]
    rope_theta = float(header.arch_value("rope.freq_base", 1_000_000.0))
    rope_local_base_freq = 10_000.0
    full_rope: dict[str, Any] = {"rope_theta": rope_theta, "rope_type": "default"}
    if (scaling := _rope_scaling(header)) is not None:
        full_rope.update(scaling)  # llama.cpp scales only the global layers' RoPE
    query_pre_attn_scalar = (
        config["hidden_size"] // config["num_attention_heads"] if num_layers == 62 else head_dim)
    config.update({
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "sliding_window": int(header.arch_value("attention.sliding_window", 4096)),
        "sliding_window_pattern": sliding_window_pattern,
        "_sliding_window_pattern": sliding_window_pattern,
        "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": full_rope,
            "sliding_attention": {"rope_theta": rope_local_base_freq, "rope_type": "default"},
        },
        # Legacy (transformers 4) names of the two RoPE bases.
        "rope_theta": rope_theta,
        "rope_local_base_freq": rope_local_base_freq,
        "final_logit_softcapping": header.arch_value("final_logit_softcapping"),
        "attn_logit_softcapping": header.arch_value("attn_logit_softcapping"),
        "attention_bias": False,
        "use_bidirectional_attention": False,
    })
    if (unk := header.metadata.get("tokenizer.ggml.unknown_token_id")) is not None:
        config["unk_token_id"] = int(unk)
    return config


def _gemma2_config(header: GGUFHeader) -> dict[str, Any]:
    """Gemma 2 config in the form transformers 5 saves ``Gemma2Config``.

    GGUF keys (llama.cpp ``Gemma2Model``): as Gemma 3's plus ``gemma2.attn_logit_softcapping`` and
    ``gemma2.final_logit_softcapping``. Fixed by llama.cpp for Gemma 2, not stored: every other
    layer sliding (even layers), gelu-tanh MLP, query scale ``1/sqrt(head_dim)``
    (``1/sqrt(hidden/heads)`` for the 46-layer 27B).
    """
    config = _common_config(header)
    head_dim = int(header.arch_value("attention.key_length",
                                     config["hidden_size"] // config["num_attention_heads"]))
    num_layers = config["num_hidden_layers"]
    rope = {"rope_theta": float(header.arch_value("rope.freq_base", 10_000.0)), "rope_type": "default"}
    rope.update(_rope_scaling(header) or {})
    config.update({
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if num_layers == 46
        else head_dim,
        "sliding_window": int(header.arch_value("attention.sliding_window", 4096)),
        "layer_types": ["full_attention" if i % 2 else "sliding_attention" for i in range(num_layers)],
        "rope_parameters": rope,
        "final_logit_softcapping": header.arch_value("final_logit_softcapping"),
        "attn_logit_softcapping": header.arch_value("attn_logit_softcapping"),
        "attention_bias": False,
    })
    return config


def _rope_config(header: GGUFHeader, default_theta: float) -> dict[str, Any]:
    theta = float(header.arch_value("rope.freq_base", default_theta))
    rope_parameters: dict[str, Any] = {"rope_theta": theta, "rope_type": "default"}
    scaling = _rope_scaling(header)
    if scaling is not None:
        rope_parameters.update(scaling)
    if "rope_freqs.weight" in header.tensor_names:
        logger.warning("GGUF %s has llama-3 RoPE frequency factors (rope_freqs.weight); they are "
                       "not converted and plain RoPE is used", header.path)
    return {"rope_theta": theta, "rope_parameters": rope_parameters}


def _has_tensor(header: GGUFHeader, suffix: str) -> bool:
    return any(name.endswith(suffix) for name in header.tensor_names)


def _llama_config(header: GGUFHeader) -> dict[str, Any]:
    """Llama config (``LlamaConfig``); ``head_dim`` from ``llama.rope.dimension_count``."""
    config = _common_config(header)
    head_dim = header.arch_value("rope.dimension_count")
    if head_dim is None:
        head_dim = header.arch_value("attention.key_length",
                                     config["hidden_size"] // config["num_attention_heads"])
    config.update({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "attention_bias": _has_tensor(header, "attn_q.bias"),
        "mlp_bias": _has_tensor(header, "ffn_up.bias"),
        "pretraining_tp": 1,
        **_rope_config(header, 10_000.0),
    })
    return config


def _granite_config(header: GGUFHeader) -> dict[str, Any]:
    """Granite 3 config (``GraniteConfig``): Llama's, plus the four scalars llama.cpp's
    ``GraniteModel`` renames and writes when set: ``granite.attention.scale`` ->
    ``attention_multiplier`` (absent: llama.cpp's ``1/sqrt(head_dim)``), ``granite.embedding_scale``,
    ``granite.residual_scale``, ``granite.logit_scale`` (absent: 1)."""
    config = _llama_config(header)
    config.update({
        "architectures": ["GraniteForCausalLM"],
        "model_type": "granite",
        "attention_multiplier": float(header.arch_value("attention.scale") or config["head_dim"] ** -0.5),
        "embedding_multiplier": float(header.arch_value("embedding_scale") or 1.0),
        "residual_multiplier": float(header.arch_value("residual_scale") or 1.0),
        "logits_scaling": float(header.arch_value("logit_scale") or 1.0),
    })
    return config


def _phi3_config(header: GGUFHeader) -> dict[str, Any]:
    """Phi-3 / Phi-4-mini config (``Phi3Config``; llama.cpp ``Phi3MiniModel``).

    ``phi3.rope.dimension_count`` is the rotary dim (-> ``partial_rotary_factor`` of
    ``hidden / heads``); ``phi3.attention.sliding_window`` 0 means none (Phi-4); with the tensors
    ``rope_factors_long`` / ``rope_factors_short`` the RoPE is LongRoPE with
    ``phi3.rope.scaling.original_context_length`` and ``phi3.rope.scaling.attn_factor``.
    """
    config = _common_config(header)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rope: dict[str, Any] = {"rope_theta": float(header.arch_value("rope.freq_base", 10_000.0)), "rope_type": "default",
                            "partial_rotary_factor": int(header.arch_value("rope.dimension_count", head_dim)) / head_dim}
    original = header.arch_value("rope.scaling.original_context_length")
    factors = {info.name: info for info in header.tensors if info.name in _PHI3_ROPE_FACTOR_TENSORS}
    if factors:
        blob = np.memmap(header.path, dtype=np.uint8, mode="r")
        rope.update({key: [float(x) for x in dequantize_tensor(blob, factors[name])]
                     for name, key in _PHI3_ROPE_FACTOR_TENSORS.items()})
        rope.update({"rope_type": "longrope", "original_max_position_embeddings": int(original),
                     "attention_factor": float(header.require("rope.scaling.attn_factor"))})
    window = int(header.arch_value("attention.sliding_window", 0))
    config.update({
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_act": "silu",
        "sliding_window": window or None,
        "original_max_position_embeddings": int(original or config["max_position_embeddings"]),
        "partial_rotary_factor": rope["partial_rotary_factor"],
        "rope_parameters": rope,
    })
    return config


def _olmo2_config(header: GGUFHeader) -> dict[str, Any]:
    """OLMo 2 config (``Olmo2Config``; llama.cpp ``Olmo2Model``: plain keys, q/k rows not permuted)."""
    config = _common_config(header)
    config.update({
        "architectures": ["Olmo2ForCausalLM"],
        "model_type": "olmo2",
        "hidden_act": "silu",
        "attention_bias": _has_tensor(header, "attn_q.bias"),
        **_rope_config(header, 10_000.0),
    })
    return config


def _qwen_config(header: GGUFHeader) -> dict[str, Any]:
    """Qwen2 / Qwen3 config; Qwen3 adds q/k norms and a ``head_dim`` of its own."""
    config = _common_config(header)
    arch = header.architecture
    num_layers = config["num_hidden_layers"]
    config.update({
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "Qwen3ForCausalLM"],
        "model_type": arch,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": num_layers,
        "layer_types": ["full_attention"] * num_layers,
        **_rope_config(header, 1_000_000.0),
    })
    if arch == "qwen3":
        config["head_dim"] = int(header.arch_value(
            "attention.key_length", config["hidden_size"] // config["num_attention_heads"]))
        config["attention_bias"] = _has_tensor(header, "attn_q.bias")
    return config


_CONFIG_BUILDERS = {
    "gemma2": _gemma2_config,
    "gemma3": _gemma3_config,
    "granite": _granite_config,
    "llama": _llama_config,
    "olmo2": _olmo2_config,
    "phi3": _phi3_config,
    "qwen2": _qwen_config,
    "qwen3": _qwen_config,
}


def gguf_to_hf_config(header: GGUFHeader) -> dict[str, Any]:
    """The ``config.json`` dict for a GGUF file (see the per-architecture builders).

    Raises:
        ValueError: for an architecture outside :data:`SUPPORTED_GGUF_ARCHITECTURES`, or missing
            required metadata.
    """
    builder = _CONFIG_BUILDERS.get(header.architecture)
    if builder is None:
        raise ValueError(
            f"GGUF architecture {header.architecture!r} of {header.path!r} is not supported; "
            f"supported: {list(SUPPORTED_GGUF_ARCHITECTURES)}")
    return dict(sorted(builder(header).items()))


def gguf_weight_specs(header: GGUFHeader) -> list[tuple[GGUFTensorInfo, TensorSpec]]:
    """(GGUF tensor, float32 HF tensor spec) for every tensor the HF model stores, in file order.

    Raises:
        ValueError: for unknown tensor names, unsupported tensor types (:func:`check_tensor_type`)
            or two tensors mapping to one HF name.
    """
    import torch

    pairs = []
    seen: set[str] = set()
    for info in header.tensors:
        hf_name = gguf_to_hf_name(info.name, header.architecture)
        if hf_name is None:
            continue
        check_tensor_type(info)  # fail before any tensor is dequantized
        if hf_name in seen:
            raise ValueError(f"two GGUF tensors map to HF tensor {hf_name!r} in {header.path!r}")
        seen.add(hf_name)
        pairs.append((info, TensorSpec(hf_name, torch.float32, info.shape)))
    return pairs


def iterate_gguf_weights(path_or_header: str | GGUFHeader) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) for every weight of a GGUF file, dequantized and un-done.

    Each tensor has the HF shape (e.g. ``model.layers.0.self_attn.q_proj.weight``
    [num_heads * head_dim, hidden_size]) and owns its memory. Gemma norms come back without
    llama.cpp's ``+1``; Llama q/k rows come back in HF order. A tied ``lm_head`` is not yielded.

    Raises:
        ValueError: for unsupported architectures, tensor types or names.
    """
    import torch

    header = path_or_header if isinstance(path_or_header, GGUFHeader) else read_gguf_header(path_or_header)
    config = gguf_to_hf_config(header)  # validates the architecture and head counts
    arch = header.architecture
    blob = np.memmap(header.path, dtype=np.uint8, mode="r")
    for info, spec in gguf_weight_specs(header):
        weights = dequantize_tensor(blob, info)
        if arch.startswith("gemma") and info.name.endswith("norm.weight"):
            weights = weights - 1  # float32, as transformers' Gemma2TensorProcessor
        elif arch in _QK_PERMUTED_ARCHITECTURES and (".attn_q." in info.name or ".attn_k." in info.name):
            is_query = ".attn_q." in info.name
            n_head = config["num_attention_heads" if is_query else "num_key_value_heads"]
            weights = _reverse_llama_permute(weights, n_head)
        yield spec.name, torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32))


def _generation_config(header: GGUFHeader, config: dict[str, Any]) -> dict[str, Any]:
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    eos_ids = _eos_token_ids(header, tokens if isinstance(tokens, list) else None)
    generation: dict[str, Any] = {}
    if config.get("bos_token_id") is not None:
        generation["bos_token_id"] = config["bos_token_id"]
    if eos_ids:
        generation["eos_token_id"] = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    if config.get("pad_token_id") is not None:
        generation["pad_token_id"] = config["pad_token_id"]
    return generation


def save_gguf_tokenizer(gguf_path: str, out_dir: str, model_type: str,
                        chat_template: str | None = None) -> None:
    """Build the tokenizer transformers builds for a GGUF file and save it (tokenizer.json, ...).

    Uses ``AutoTokenizer.from_pretrained(dir, gguf_file=name)`` semantics; when transformers maps
    ``model_type`` to a tokenizer class we pass it as ``tokenizer_type``, which picks the same class
    without transformers re-reading the whole file through ``gguf.GGUFReader`` (~30 s for Gemma 3).
    Imports transformers (conversion time only).

    Args:
        chat_template: the GGUF's ``tokenizer.chat_template`` metadata, or None. transformers
            (5.x) drops it when building a tokenizer from a GGUF; we save it as the tokenizer's
            template, so ``chat_template.jinja`` holds it (as llama.cpp's server uses it).
    """
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    folder, name = os.path.split(os.path.abspath(gguf_path))
    kwargs: dict[str, Any] = {"gguf_file": name}
    if TOKENIZER_MAPPING_NAMES.get(model_type):
        kwargs["tokenizer_type"] = model_type
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out_dir)
    path = os.path.join(out_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise RuntimeError(f"transformers saved no tokenizer.json for {gguf_path!r} into {out_dir!r}")
    compact_bpe_merges(path)


def compact_bpe_merges(path: str) -> bool:
    """Rewrite a BPE ``tokenizer.json``'s merges from pairs (``[["a", "b"], ...]``, what
    tokenizers >= 0.20 writes) to the ``"a b"`` strings tokenizers also reads, when no merged
    token holds a space (the string form splits at the space, so it would be ambiguous).

    The tokenizer is the same (tokenizers serializes both back to the same JSON;
    tests/loaders/test_gguf_tiny.py), but loads faster: Gemma 3's 514,906 merges
    parse in about 1 s less (docs/performance.md, "Session 15").

    Returns:
        True if the file was rewritten.
    """
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    model = spec.get("model") or {}
    merges = model.get("merges")
    if model.get("type") != "BPE" or not merges or not isinstance(merges[0], list):
        return False
    if any(" " in part for pair in merges for part in pair):
        return False
    model["merges"] = [f"{a} {b}" for a, b in merges]
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    os.replace(tmp, path)
    return True


def convert_gguf_to_hf_folder(gguf_path: str, out_dir: str, header: GGUFHeader | None = None) -> None:
    """Write an HF-style model folder for a GGUF file.

    Writes into ``out_dir`` (which must exist): ``config.json`` (:func:`gguf_to_hf_config`),
    ``generation_config.json`` (BOS/EOS/PAD ids), ``model.safetensors`` (float32, HF names,
    :func:`iterate_gguf_weights`; 1.07 GB for Gemma 3 270M, dominated by the 262144 x 640
    embedding) and the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, and
    ``chat_template.jinja`` when the file has a template).

    Raises:
        ValueError: for unsupported architectures or tensor types (naming tensor and type).
    """
    t0 = time.perf_counter()
    header = header or read_gguf_header(gguf_path)
    config = gguf_to_hf_config(header)
    t_header = time.perf_counter()
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    generation = _generation_config(header, config)
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(generation, f, indent=2)
        f.write("\n")

    specs = [spec for _, spec in gguf_weight_specs(header)]
    nbytes = write_safetensors_streaming(
        os.path.join(out_dir, SAFETENSORS_SINGLE_NAME), specs,
        (tensor for _, tensor in iterate_gguf_weights(header)),
        metadata={"format": "pt", "source": "gguf", "gguf_file": os.path.basename(gguf_path)})
    t_weights = time.perf_counter()
    template = header.metadata.get("tokenizer.chat_template")
    save_gguf_tokenizer(gguf_path, out_dir, config["model_type"],
                        template if isinstance(template, str) else None)
    t_tokenizer = time.perf_counter()
    logger.info(
        "converted GGUF %s (%s, %d tensors) -> %s: header %.2f s, weights %.2f s (%.2f GB float32), "
        "tokenizer %.2f s", gguf_path, header.architecture, len(specs), out_dir,
        t_header - t0, t_weights - t_header, nbytes / 1e9, t_tokenizer - t_weights)
