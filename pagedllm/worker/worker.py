"""The worker: picks the device, loads the weights, sizes and allocates the paged KV cache."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from pagedllm.attention.backends import prepare_backend
from pagedllm.config import DEFAULT_GPU_MEMORY_UTILIZATION, CacheConfig, ModelConfig, SchedulerConfig
from pagedllm.layers.linear import pack_linear_layers
from pagedllm.layers.quantization import quantize_linear_layers
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.registry import get_model_class
from pagedllm.worker.memory import (KVCacheShape, default_cpu_kv_cache_bytes, kv_bytes_from_utilization,
                                    num_blocks_for_budget)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def resolve_device(device: str | None) -> torch.device:
    """``None`` -> cuda if available, else cpu.

    Raises:
        ValueError: if cuda is asked for and not available.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, hf_config: dict, device: torch.device) -> torch.dtype:
    """"auto" -> float32 on the CPU (exact parity with transformers), the checkpoint's
    ``torch_dtype`` / ``dtype`` (float32 -> bfloat16 not applied) on CUDA."""
    if dtype != "auto":
        if device.type == "cpu" and _DTYPES[dtype] in (torch.bfloat16, torch.float16) \
                and torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2"):
            logger.warning("%s on a CPU without AVX-512 (capability %s): its matmuls run several times "
                           "slower than float32 here (docs/performance.md); --dtype float32 is faster",
                           dtype, torch.backends.cpu.get_cpu_capability())
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "bfloat16"
    return _DTYPES.get(str(name).replace("torch.", ""), torch.bfloat16)


def build_model(hf_config: dict, weights, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Instantiate the registered architecture without random init (meta device), then load weights.

    Args:
        hf_config: config.json dict.
        weights: iterable of (HF name, tensor).
    Raises:
        ValueError: unsupported architecture, or checkpoint/model name or shape mismatch.
    """
    model_cls = get_model_class(hf_config)
    with torch.device("meta"):
        model = model_cls(hf_config)
    model = model.to_empty(device=device).to(dtype)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_buffers()
    model.load_weights(weights)
    return model.eval()


class Worker:
    """Owns the model and the KV cache tensors on one device.

    Args:
        model_config, cache_config, scheduler_config: see ``pagedllm.config``.
        hf_config: the checkpoint's config.json.
        weights: iterable of (name, tensor) for ``build_model``.
    Attributes:
        kv_caches: per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim].
        num_blocks: blocks in the pool.
    Raises:
        ValueError: if the KV budget cannot hold one request of ``max_model_len`` tokens.
    """

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, hf_config: dict, weights) -> None:
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, hf_config, self.device)
        t0 = time.perf_counter()
        self.model = build_model(hf_config, weights, self.dtype, self.device)
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if model_config.quantization == "int8":  # int8 linear layers and LM head (layers/quantization.py)
            weight_bytes += quantize_linear_layers(self.model)
        else:  # CPU float32: linear layers move into oneDNN's packed layout (layers/linear.py).
            weight_bytes += pack_linear_layers(self.model, self.dtype, self.device, scheduler_config.max_num_seqs)
        self.weights_load_s = time.perf_counter() - t0
        logger.info("Model weights: %.1f MiB in %s on %s, loaded in %.2f s",
                    weight_bytes / 2**20, str(self.dtype).replace("torch.", ""), self.device, self.weights_load_s)
        prepare_backend("auto", self.device, self.dtype)  # compiles the CPU kernel on a first start
        self.kv_shape = KVCacheShape(
            num_layers=self.model.num_layers, num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim, block_size=cache_config.block_size,
            dtype_bytes=torch.tensor([], dtype=self.dtype).element_size())
        self.num_blocks = self._determine_num_blocks(cache_config, scheduler_config, weight_bytes)
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        max_len = scheduler_config.max_model_len
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB, %d B/token); maximum concurrency for "
            "%d-token requests: %.2fx", self.num_blocks, cache_config.block_size,
            self.num_blocks * self.kv_shape.bytes_per_block / 2**20, self.kv_shape.bytes_per_token,
            max_len, self.num_blocks * cache_config.block_size / max_len)

    def _determine_num_blocks(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                              weight_bytes: int) -> int:
        if cache_config.num_gpu_blocks_override is not None:
            num = cache_config.num_gpu_blocks_override
            return num_blocks_for_budget(num * self.kv_shape.bytes_per_block, self.kv_shape,
                                         scheduler_config.max_model_len)
        if cache_config.kv_cache_memory_bytes is not None:
            budget = cache_config.kv_cache_memory_bytes
        elif self.device.type == "cpu":
            if cache_config.gpu_memory_utilization != DEFAULT_GPU_MEMORY_UTILIZATION:  # the user set it
                logger.info("gpu_memory_utilization=%s does not apply on the CPU; the KV budget comes from "
                            "kv_cache_memory_bytes or PAGEDLLM_CPU_KVCACHE_SPACE",
                            cache_config.gpu_memory_utilization)
            budget = default_cpu_kv_cache_bytes()
        else:
            budget = kv_bytes_from_utilization(
                torch.cuda.get_device_properties(self.device).total_memory,
                cache_config.gpu_memory_utilization, self._profile_peak_bytes(scheduler_config))
        return num_blocks_for_budget(budget, self.kv_shape, scheduler_config.max_model_len)

    def _profile_peak_bytes(self, scheduler_config: SchedulerConfig) -> int:
        """Peak accelerator bytes of a forward over ``max_num_batched_tokens`` tokens with a
        one-block dummy cache (weights + activations)."""
        from pagedllm.attention.ops import build_attention_metadata
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(scheduler_config.max_num_batched_tokens, scheduler_config.max_model_len)
        bs = self.kv_shape.block_size
        num_blocks = -(-n // bs)
        caches = self._allocate_kv_caches(num_blocks)
        md = build_attention_metadata([n], [0], [list(range(num_blocks))], bs, self.device)
        with torch.inference_mode():
            hidden = self.model(torch.zeros(n, dtype=torch.long, device=self.device),
                                torch.arange(n, device=self.device), caches, md)
            self.model.compute_logits(hidden[-scheduler_config.max_num_seqs:])
        del caches, hidden
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        s = self.kv_shape
        shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
        # Uninitialised on purpose (pages are touched on first write): attention only reads slots
        # written through the slot mapping, and masks (and zeroes) the rest of a gathered block.
        return [(torch.empty(shape, dtype=self.dtype, device=self.device),
                 torch.empty(shape, dtype=self.dtype, device=self.device)) for _ in range(s.num_layers)]
