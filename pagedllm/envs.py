"""The environment variables pagedllm reads, declared once (vLLM keeps its own in ``vllm/envs.py``).

The constants below hold each variable's *name*. vLLM's ``vllm.envs`` attributes hold *values*, read
when accessed; the ones vLLM's example scripts use are here too, as module attributes of the same
name (``envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE``: seconds, default 5, vLLM's).

Each is read at the edge only: ``EngineArgs`` field defaults (``engine/arg_utils.py``), the
server's ``--api-key`` default and the GGUF download folder; deeper code gets the values through
its config. An error about a value names the variable that can feed it (README, "Environment
variables").
"""

from __future__ import annotations

import os

PAGEDLLM_ATTENTION_BACKEND = "PAGEDLLM_ATTENTION_BACKEND"      # -> EngineArgs.attention_backend
PAGEDLLM_CPU_GEMM = "PAGEDLLM_CPU_GEMM"                        # -> EngineArgs.cpu_gemm
PAGEDLLM_CPU_ISA = "PAGEDLLM_CPU_ISA"                          # -> EngineArgs.cpu_isa
PAGEDLLM_CPU_BF16_GEMM = "PAGEDLLM_CPU_BF16_GEMM"              # -> EngineArgs.cpu_bf16_gemm
PAGEDLLM_CPU_F32_GEMM = "PAGEDLLM_CPU_F32_GEMM"                # -> EngineArgs.cpu_f32_gemm
PAGEDLLM_CPU_KVCACHE_SPACE = "PAGEDLLM_CPU_KVCACHE_SPACE"      # -> EngineArgs.cpu_kvcache_space (GiB)
PAGEDLLM_PP_LAYER_PARTITION = "PAGEDLLM_PP_LAYER_PARTITION"    # -> EngineArgs.pp_layer_partition ("10,8")
PAGEDLLM_CPU_THREADS_PER_RANK = "PAGEDLLM_CPU_THREADS_PER_RANK"  # -> EngineArgs.cpu_threads_per_rank
# -> EngineArgs.profiler_config {"profiler": "torch", "torch_profiler_dir": ...}; vLLM's older name read too.
TORCH_PROFILER_DIR = ("PAGEDLLM_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR")
# torchrun's, read only with distributed_executor_backend="external_launcher" -> ParallelConfig.launcher.
TORCHRUN_ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
PAGEDLLM_API_KEY = "PAGEDLLM_API_KEY"                          # -> the server's --api-key
PAGEDLLM_CACHE_DIR = "PAGEDLLM_CACHE_DIR"                      # -> loaders.model_files.default_cache_root
# -> EngineArgs.otlp_traces_protocol ("grpc" | "http/protobuf"; the OpenTelemetry SDK's variable, as vLLM reads it)
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


def read(name: str) -> str | None:
    """The variable's value stripped of spaces, or None when unset or blank."""
    value = os.environ.get(name, "").strip()
    return value or None


def _int(name: str, default: int) -> int:
    value = read(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {value!r}") from None


# vLLM's value attributes (name -> reader), for ``envs.<NAME>``.
_VLLM_VALUES = {
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": lambda: _int("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", 5),   # s, uvicorn's keep-alive
}


def __getattr__(name: str):
    """``envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (vLLM's): the variable's value now.

    Raises:
        ValueError: a value that is not an integer (naming the variable).
    """
    if name in _VLLM_VALUES:
        return _VLLM_VALUES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
