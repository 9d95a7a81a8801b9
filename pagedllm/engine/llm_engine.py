"""The synchronous engine: add_request / step / abort over the scheduler and an executor."""

from __future__ import annotations

import itertools
from collections import deque
from concurrent.futures import ThreadPoolExecutor
import logging
import time

from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_spec import kv_cache_groups_for
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.distributed.kv_events import EventPublisherFactory, KVEventBatch
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.beam_search import BeamSearchManager, BeamSearchParams
from pagedllm.engine.core_proc import PAUSE_MODES
from pagedllm.engine.input_processor import InputProcessor, ProcessedInput, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.executor import Executor
from pagedllm.loaders import load_config, resolve_model
from pagedllm.loaders.sharded_state import check_sharded_state, render_pattern
from pagedllm.loaders.tensorizer import check_tensorizer_files
from pagedllm.loaders.tensorizer_config import TensorizerConfig
from pagedllm.metrics.stats import IterationStats, StatLogger
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.controller import SpecDecodeController, make_proposer
from pagedllm.structured_output.backend import get_backend_class
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# [structured output] how long an empty step sleeps while only compiling grammars are waiting (s).
_GRAMMAR_WAIT_S = 0.002


class LLMEngine:
    """One scheduler, one KV cache manager, one executor; ``step()`` runs one iteration of
    continuous batching (Orca, Yu et al. 2022; vLLM, Kwon et al. 2023).

    The engine never touches a worker: each step it hands the executor one ``SchedulerOutput``
    (plain data) and gets a ``ModelRunnerOutput`` back.

    Args:
        args: engine arguments.
        executor_class: the executor to use; None picks one from the parallel config
            (``Executor.get_class``).
        data_parallel_rank: which replica this engine is (``engine/core_proc.py`` passes its
            index): offsets the KV-cache event endpoints and tags their batches.
    Raises:
        ValueError: bad arguments, unsupported model, or a KV budget too small for max_model_len.
        zmq.ZMQError: if a KV-cache event endpoint cannot be bound (e.g. its port is taken).
    """

    def __init__(self, args: EngineArgs, executor_class: type[Executor] | None = None,
                 data_parallel_rank: int = 0) -> None:
        t0 = time.perf_counter()
        self.args = args
        # Bad structured-output settings, or a backend whose package is missing, fail before any
        # weight loads (ValueError naming structured_outputs_backend / _config).
        self.structured_outputs_config = args.create_structured_outputs_config()
        get_backend_class(self.structured_outputs_config.backend)
        self.speculative_config = args.create_speculative_config()
        self.lora_config = args.create_lora_config()   # [LoRA] None without enable_lora
        files = resolve_model(args.model)
        self.model_files = files
        self.vllm_config = args.create_engine_config(hf_config=load_config(files.folder), model_folder=files.folder)
        model_cfg, cache_cfg, sched_cfg = (self.vllm_config.model_config, self.vllm_config.cache_config,
                                           self.vllm_config.scheduler_config)
        parallel_cfg, kernel_cfg = self.vllm_config.parallel_config, self.vllm_config.kernel_config
        if parallel_cfg.data_parallel_size != 1 and not parallel_cfg.uses_external_launcher:
            raise ValueError(f"data_parallel_size={parallel_cfg.data_parallel_size}: one LLMEngine is one replica; "
                             "LLM(...) and pagedllm serve start the replicas (engine/dp_client.py); with "
                             "external_launcher each torchrun rank's engine is its own replica's")
        if model_cfg.load_format == "sharded_state":   # another layout or a missing file: fail before any worker
            check_sharded_state(files.folder, parallel_cfg.tensor_parallel_size, parallel_cfg.pipeline_parallel_size)
        if model_cfg.load_format == "tensorizer":   # a rank's file missing: fail before any worker
            check_tensorizer_files(TensorizerConfig(**model_cfg.model_loader_extra_config),
                                   parallel_cfg.tensor_parallel_size)
        self.model_config, self.cache_config, self.scheduler_config = model_cfg, cache_cfg, sched_cfg
        self.parallel_config, self.kernel_config = parallel_cfg, kernel_cfg
        executor_class = executor_class or Executor.get_class(parallel_cfg)
        # The tokenizer (a 33 MB tokenizer.json for Gemma) loads in a thread while the weights load:
        # in parallel with worker processes; with the in-process worker hardly at all, since the
        # tokenizers loader holds the GIL throughout (docs/performance.md, start-up).
        spec = self.speculative_config
        draft_cfg = None
        if spec is not None and spec.uses_draft_model:
            # [draft models] the draft's config, and a draft model's tokenizer checked against the
            # target's, before any weight loads (ValueError naming speculative_config).
            from pagedllm.spec_decode.draft_model import check_draft_tokenizer, draft_model_config

            draft_cfg = draft_model_config(spec, model_cfg)
        with ThreadPoolExecutor(max_workers=1) as pool:
            tokenizer_future = pool.submit(Tokenizer.from_pretrained, args.tokenizer or files.folder)
            if draft_cfg is not None and spec.method == "draft_model":
                check_draft_tokenizer(tokenizer_future.result(), draft_cfg.model_folder, spec.model)
            self.executor = executor_class(model_cfg, cache_cfg, sched_cfg, parallel_cfg, kernel_cfg)
            self.executor.initialize()
            if draft_cfg is not None:
                self.executor.collective_rpc("load_draft_model", (draft_cfg, spec.method == "self_int8"))
            if self.lora_config is not None:   # [LoRA] the target layers get their adapter slots
                self.executor.collective_rpc("init_lora", (self.lora_config,))
            if self.vllm_config.watermark_config is not None:   # [watermarking] every rank samples alike
                self.executor.collective_rpc("init_watermarking", (self.vllm_config.watermark_config,))
            self.tokenizer = tokenizer_future.result()
        self.num_blocks = self.executor.determine_num_blocks()
        self.num_cpu_blocks = self.executor.determine_num_cpu_blocks()
        self.executor.initialize_cache(self.num_blocks, self.num_cpu_blocks)
        # Class-based logits processors: built where the sampling happens (the driver worker).
        self.logits_processor_classes = args.create_logits_processor_classes()
        if self.logits_processor_classes:
            self.executor.collective_rpc("init_batch_logits_processors", (self.logits_processor_classes,))
        self.vocab_size = model_cfg.vocab_size
        # Hybrid KV cache: sliding-window layers get their own tables (the workers chose the same).
        self.kv_cache_groups = kv_cache_groups_for(model_cfg, cache_cfg,
                                                   uses_draft_model=spec is not None and spec.uses_draft_model)
        if self.kv_cache_groups.fallback_reason:
            logger.info("Hybrid KV cache manager off (one block table for all layers): %s",
                        self.kv_cache_groups.fallback_reason)
        kv_events = self.vllm_config.kv_events_config
        self.kv_events_enabled = kv_events is not None and kv_events.enable_kv_cache_events
        if self.kv_events_enabled and not cache_cfg.enable_prefix_caching:
            logger.warning("kv_events_config: KV-cache events come from the prefix cache, which is off "
                           "(enable_prefix_caching): no events will be published")
        manager_kw = dict(enable_caching=cache_cfg.enable_prefix_caching, num_cpu_blocks=self.num_cpu_blocks,
                          enable_kv_cache_events=self.kv_events_enabled)
        if self.kv_cache_groups.is_hybrid:
            self.kv_cache_manager = HybridKVCacheManager(cache_cfg.block_size, self.num_blocks, self.kv_cache_groups,
                                                         **manager_kw)
        else:
            self.kv_cache_manager = KVCacheManager(cache_cfg.block_size, self.num_blocks, **manager_kw)
        self.spec_decoder = None if self.speculative_config is None else SpecDecodeController(
            self.speculative_config, make_proposer(self.speculative_config))
        self.scheduler = Scheduler(sched_cfg, self.kv_cache_manager,
                                   max_concurrent_batches=self.executor.max_concurrent_batches,
                                   spec_decoder=self.spec_decoder,
                                   max_loras=0 if self.lora_config is None else self.lora_config.max_loras)
        # [LoRA] adapters checked so far: lora_int_id -> its LoRARequest (one name and path per id).
        self._lora_requests: dict = {}
        self.profiler_config = args.create_profiler_config()
        self.structured_output_manager = StructuredOutputManager(
            self.structured_outputs_config, self.tokenizer, self.vocab_size, sched_cfg.max_num_seqs)
        self.input_processor = InputProcessor(self.tokenizer, sched_cfg.max_model_len, self.vocab_size,
                                              args.max_logprobs, self.structured_outputs_config,
                                              self.logits_processor_classes, args.enable_trace_replay,
                                              args.enable_prompt_embeds, model_cfg.hidden_size,
                                              watermark_config=self.vllm_config.watermark_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.beam_search = BeamSearchManager(self.scheduler, self.tokenizer)
        self.stat_loggers: list[StatLogger] = []
        # None: generating; "new": new requests refused (pause abort / wait); "all": also frozen (keep).
        self.pause_state: str | None = None
        self._ids = itertools.count()
        # Samples whose logits processors go to the in-process worker on their first step.
        self._pending_processors: set[str] = set()
        # Pipeline parallelism: batches submitted and not processed yet, oldest first
        # ((future, SchedulerOutput) pairs); up to batch_queue_size of them.
        self.batch_queue_size = self.executor.max_concurrent_batches
        self._batch_queue: deque = deque()
        try:   # last: a taken port fails the start without leaving a publisher behind
            self.kv_event_publisher = EventPublisherFactory.create(kv_events, data_parallel_rank)
        except Exception:
            self.shutdown()
            raise
        self.load_time_s = time.perf_counter() - t0
        resolved = self.executor.model_dtype   # "auto" resolved (None: the workers log it)
        dtype_note = model_cfg.dtype if resolved is None or model_cfg.dtype != "auto" else \
            f"auto ({str(resolved).replace('torch.', '')})"
        logger.info("Engine ready in %.2f s: model=%s dtype=%s quantization=%s device=%s executor=%s "
                    "batch_queue_size=%d max_model_len=%d block_size=%d num_blocks=%d max_num_seqs=%d max_num_batched_tokens=%d prefix_caching=%s speculative=%s",
                    self.load_time_s, files.source, dtype_note, model_cfg.quantization,
                    model_cfg.device or "auto", executor_class.__name__, self.batch_queue_size, sched_cfg.max_model_len,
                    cache_cfg.block_size, self.num_blocks, sched_cfg.max_num_seqs, sched_cfg.max_num_batched_tokens,
                    cache_cfg.enable_prefix_caching,
                    None if self.speculative_config is None else
                    f"{self.speculative_config.method}(k={self.speculative_config.num_speculative_tokens})")

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    @property
    def model_executor(self) -> Executor:
        """vLLM's name for ``executor`` (its torchrun example reaches the model through it)."""
        return self.executor

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    def check_lora_request(self, lora_request) -> None:
        """Check an adapter before its requests queue: LoRA enabled, ``adapter_config.json``
        supported and within ``max_lora_rank``, one name and path per ``lora_int_id``.

        Raises:
            ValueError: naming the field.
        """
        from pagedllm.lora.adapter import read_peft_config
        from pagedllm.lora.request import LoRARequest

        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.lora_config is None:
            raise ValueError("lora_request needs an engine started with enable_lora=True")
        known = self._lora_requests.get(lora_request.lora_int_id)
        if known == lora_request:
            return
        if known is not None:
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} is already adapter {known.lora_name!r} "
                             f"({known.lora_path}); remove_lora it first")
        read_peft_config(lora_request.lora_path, self.lora_config.max_lora_rank)
        self._lora_requests[lora_request.lora_int_id] = lora_request

    def add_lora(self, lora_request) -> bool:
        """Load an adapter on every worker now (vLLM's ``add_lora``), rather than on its first
        request; False if it was loaded already.

        Raises:
            ValueError: as ``check_lora_request``, or weights that do not fit the model.
        """
        self.check_lora_request(lora_request)
        return all(self.executor.collective_rpc("add_lora", (lora_request,)))

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (vLLM's ``remove_lora``): out of the workers' slots and host caches;
        requests still running with it load it again. False if it was not known."""
        known = self._lora_requests.pop(lora_id, None) is not None
        return any(self.executor.collective_rpc("remove_lora", (lora_id,))) or known

    def list_loras(self) -> set[int]:
        """The adapters this engine knows (``lora_int_id``)."""
        return set(self._lora_requests)

    def add_request(self, request_id: str | None, prompt: PromptType | ProcessedInput,
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    lora_request=None) -> str:
        """Queue a request (n > 1 / best_of become that many samples).

        ``prompt`` is either a raw prompt, validated and tokenized here with ``params``, or a
        ``ProcessedInput`` from ``input_processor.process`` (then ``params`` must be None: the
        processed request carries its own), passed on unchanged.

        Sample ``i`` gets engine id ``f"{i}_{request_id}"`` and, if ``params.seed`` is set, seed
        ``params.seed + i``. Sample 0 computes the prompt once; the others fork its KV blocks
        (copy-on-write) and draw their first token from the same logits row. ``lora_request``:
        the adapter every sample runs with (``check_lora_request``), or None.

        Returns:
            The request id.
        Raises:
            ValueError: invalid prompt or params (nothing is queued), a duplicate request id, both a
                ``ProcessedInput`` and ``params``, or logits processors with an executor whose
                workers run in other processes.
        """
        if isinstance(prompt, ProcessedInput):
            if params is not None:
                raise ValueError("params must be None when the prompt is a ProcessedInput (it carries its params)")
            processed = prompt
            lora_request = lora_request or processed.lora_request
        else:
            processed = self.input_processor.process(prompt, params)
        if lora_request is not None:
            self.check_lora_request(lora_request)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if self.output_processor.has_request(request_id) or self.beam_search.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already running")
        base = processed.params
        if base.logits_processors and not self.executor.uses_in_process_worker:
            raise ValueError(
                f"logits_processors are Python callables and cannot be sent to worker processes; the "
                f"{type(self.executor).__name__} runs its workers out of process")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        num_samples = base.best_of or base.n
        sample_params = []
        for i in range(num_samples):
            sp = base.clone()
            # One sample each. A best_of > n sample keeps best_of: it will be ranked by cumulative
            # logprob, so it needs its sampled logprobs (SamplingParams.needs_sampled_logprobs).
            sp.n = 1
            sp.best_of = base.best_of if (base.best_of or base.n) > base.n else None
            if base.seed is not None:
                sp.seed = base.seed + i
            sample_params.append(sp)
        sample_ids = [request_id] if num_samples == 1 else [f"{i}_{request_id}" for i in range(num_samples)]
        self.output_processor.add_request(request_id, sample_ids, processed.prompt, processed.prompt_token_ids,
                                          base, sample_params, arrival_time, processed.detokenizer_prompt_ids)
        requests = []
        for sid, sp in zip(sample_ids, sample_params):
            if sp.logits_processors:
                self._pending_processors.add(sid)
            # [structured output] each sample gets its own matcher over the shared compiled grammar.
            grammar = (self.structured_output_manager.make_request(sp.structured_outputs)
                       if sp.structured_outputs is not None else None)
            if grammar is not None and self.parallel_config.uses_external_launcher:
                grammar.wait()   # every torchrun rank admits it at the same step (vLLM: no async compile)
            requests.append(Request(sid, processed.prompt_token_ids, sp, processed.max_tokens,
                                    arrival_time=arrival_time, structured_output_request=grammar,
                                    lora_request=lora_request, prompt_embeds=processed.prompt_embeds))
        # Sample 0 computes the prompt; the others fork its blocks when it is done (Scheduler.add_request).
        try:
            self.scheduler.add_request(requests[0], forks=requests[1:])
        except ValueError:
            self.output_processor.abort_requests([request_id])
            self._pending_processors.difference_update(sample_ids)
            raise
        return request_id

    def add_beam_search_request(self, request_id: str | None, prompt: PromptType | ProcessedInput,
                                params: BeamSearchParams, arrival_time: float | None = None) -> str:
        """Queue a beam search (``engine/beam_search.py``); its one ``RequestOutput`` comes out of
        ``step()`` when it finishes, with the best ``beam_width`` sequences as ``outputs`` (best
        first) and vLLM's ``BeamSearchSequence``s in ``beam_sequences``.

        Raises:
            ValueError: invalid prompt or params, a duplicate id, ``beam_width`` above ``max_num_seqs``,
                or a LoRA adapter.
        """
        processed = prompt if isinstance(prompt, ProcessedInput) else self.input_processor.process(prompt, params)
        if processed.lora_request is not None:
            raise ValueError("lora_request: beam search does not run with LoRA adapters")
        self.beam_search.check_request(len(processed.prompt_token_ids), params, processed.prompt_embeds)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if self.output_processor.has_request(request_id) or self.beam_search.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already running")
        self.beam_search.add_request(request_id, processed.prompt, processed.prompt_token_ids, params,
                                     time.monotonic() if arrival_time is None else arrival_time)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests (by the caller's id): their blocks are freed at once.

        Returns:
            Final outputs (finish_reason "abort") for the requests that were still known.
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        stats = IterationStats() if self.stat_loggers else None
        beam_outputs = [o for o in (self.beam_search.abort(i, stats) for i in ids) if o is not None]
        sample_ids = [sid for rid in ids for sid in self.output_processor.sample_ids(rid)]
        self._pending_processors.difference_update(sample_ids)
        self.scheduler.finish_requests(sample_ids, RequestStatus.FINISHED_ABORTED)
        outputs = self.output_processor.abort_requests(ids, stats)
        if stats is not None and (sample_ids or beam_outputs):
            self._record_stats(stats)
        return outputs + beam_outputs

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``).

        Args:
            reset_running_requests: preempt the running requests first (they recompute their KV
                when scheduled next; their outputs are unchanged), so the reset succeeds.
        Returns:
            True when cleared; False (nothing changed) while requests hold blocks.
        Raises:
            RuntimeError: with ``reset_running_requests``, when batches in flight still hold blocks.
        """
        cleared = self.scheduler.reset_prefix_cache(reset_running_requests)
        self._publish_kv_events()   # AllBlocksCleared now, not at the next step
        return cleared

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """``Worker.<method>(*args, **kwargs)`` on every rank, the results in rank order (vLLM's
        ``collective_rpc``, by method name; e.g. ``"update_config"``, ``"reload_weights"``). After
        ``reload_weights`` the prefix cache is reset: its blocks hold the old weights' KV.

        Raises:
            ValueError: ``method`` not a string, or a ``timeout`` (not supported).
        """
        if not isinstance(method, str):
            raise ValueError(f"method must be a Worker method's name, got {method!r}")
        if timeout is not None:
            raise ValueError("timeout is not supported by collective_rpc")
        results = self.executor.collective_rpc(method, tuple(args), kwargs)
        if method == "reload_weights":
            self.reset_prefix_cache()
        return results

    @property
    def engine_core(self) -> "LLMEngine":
        """vLLM's ``LLMEngine.engine_core``, the client of its engine core: here the engine is its
        own core, in this process, so its utility calls (``save_sharded_state``,
        ``collective_rpc``, ``reset_prefix_cache``, ...) are this object's methods."""
        return self

    def save_sharded_state(self, path: str, pattern: str | None = None, max_size: int | None = None) -> None:
        """Every rank writes its own weights into the folder ``path`` as safetensors files (vLLM's
        ``save_sharded_state``; ``Worker.save_sharded_state``, ``loaders/sharded_state.py``):
        the model as loaded, before the kernel plan packs it, so the files load on any machine
        with ``load_format="sharded_state"`` and the same ``tensor_parallel_size`` /
        ``pipeline_parallel_size``. Copy config.json and the tokenizer files next to them
        (vLLM's ``save_sharded_state_offline.py`` does).

        Args:
            pattern: file names with ``{rank}`` / ``{tp_rank}``, ``{pp_rank}``, ``{part}``
                (None: ``ShardedStateLoader.TP_ONLY_PATTERN``, or ``PP_AND_TP_PATTERN`` with
                pipeline stages).
            max_size: bytes per file at most (None: one file per rank).
        Raises:
            ValueError: a bad ``pattern`` or ``max_size`` (checked here); the workers' weights are
                ``load_format="dummy"`` ones (from the in-process worker; worker processes stop on
                it, a ``RuntimeError``, as on any failed ``collective_rpc``).
        """
        if max_size is not None and max_size < 1:
            raise ValueError(f"max_size must be >= 1 byte, got {max_size}")
        p = self.parallel_config   # a bad pattern fails here, not in every worker
        render_pattern(pattern, 0, p.tensor_parallel_size, 0, p.pipeline_parallel_size, part=0)
        self.executor.collective_rpc("save_sharded_state", (str(path), pattern, max_size))

    def start_profile(self) -> None:
        """Start the torch profiler on every worker (vLLM's ``start_profile``); the steps until
        ``stop_profile`` are recorded (``profiler.py``).

        Raises:
            RuntimeError: if no profiler is configured (``profiler_config``).
        """
        if not self.profiler_config.enabled:
            raise RuntimeError("the profiler is not configured: pass profiler_config={'profiler': 'torch', "
                               "'torch_profiler_dir': './traces'} (or set $PAGEDLLM_TORCH_PROFILER_DIR / "
                               "$VLLM_TORCH_PROFILER_DIR) when creating the engine")
        self.executor.collective_rpc("start_profile", (self.profiler_config,))

    def stop_profile(self) -> None:
        """Stop the profiler on every worker; each writes its trace to ``torch_profiler_dir``.

        Raises:
            RuntimeError: if no profiler is configured (``profiler_config``).
        """
        if not self.profiler_config.enabled:
            raise RuntimeError("the profiler is not configured (profiler_config); nothing to stop")
        self.executor.collective_rpc("stop_profile")

    def pause_generation(self, mode: str = "abort") -> list[RequestOutput]:
        """Pause generation (vLLM's ``pause_generation`` modes, e.g. for a weight update).

        Args:
            mode: ``"abort"``: abort every unfinished request now; ``"wait"``: let them finish
                (``step`` goes on until ``has_unfinished_requests()`` is False); ``"keep"``:
                freeze them where they are (``step`` schedules nothing until
                ``resume_generation``). The front end refuses new requests in ``abort`` / ``wait``
                mode (``pause_state`` ``"new"``) and queues them in ``keep`` mode (``"all"``).
        Returns:
            The aborted requests' final outputs (finish_reason "abort"; ``abort`` mode only).
        Raises:
            ValueError: an unknown ``mode``.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        self.pause_state = "all" if mode == "keep" else "new"
        if mode != "abort":
            return []
        return self.abort_request(list(self.output_processor.parents) + list(self.beam_search.instances))

    def resume_generation(self) -> None:
        """End a pause: frozen requests are scheduled again at the next ``step``."""
        self.pause_state = None

    def is_paused(self) -> bool:
        return self.pause_state is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Whether ``step`` would do anything: unfinished requests, not frozen by a ``keep`` pause."""
        return self.pause_state != "all" and self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, update, detokenize. [structured output] A step
        with constrained rows fills its grammar bitmask while the model's forward runs
        (``_submit_step``).

        With ``executor.max_concurrent_batches > 1`` (pipeline parallelism) a step may instead
        only submit a batch and return ``[]`` (see ``_step_with_batch_queue``).

        Returns:
            RequestOutputs of the requests that made progress (or finished) this step.
        """
        if self.pause_state == "all":
            return []   # frozen by pause_generation(mode="keep")
        if self.batch_queue_size > 1:
            return self._step_with_batch_queue()
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule()
        if self._pending_processors:
            self._hand_over_logits_processors(sched_out)
        runner_out = self._submit_step(sched_out)
        if self.spec_decoder is not None and sched_out.num_scheduled_tokens \
                and self.scheduler.last_step_stats.num_prefill_tokens == 0:
            # [speculative decoding] the step-time model behind the drafts' sizing.
            self.spec_decoder.observe_step(sched_out.total_num_scheduled_tokens, time.perf_counter() - t0)
        return self._process_runner_output(sched_out, runner_out, t0)

    def _submit_step(self, sched_out, non_block: bool = False):
        """Run the step on the executor with its grammar bitmask; its ``ModelRunnerOutput`` (a
        future of it with ``non_block``).

        [structured output] A step with constrained rows (unless
        ``structured_outputs_config.overlap_bitmask_fill`` is off) takes vLLM V1's split: the
        step is sent with ``grammar_bitmask_follows``, the bitmask is filled while the workers
        run the forward, and ``sample_tokens`` sends it and returns the sampled output. Every
        other step is one ``execute_model`` call, as before.

        Raises:
            what the executor or the fill raised (a failed fill drops the kept step first).
        """
        if not (sched_out.structured_output_request_ids and self.structured_outputs_config.overlap_bitmask_fill):
            self._fill_grammar_bitmask(sched_out)
            if non_block:
                return self.executor.execute_model(sched_out, non_block=True)
            return self.executor.execute_model(sched_out)
        sched_out.grammar_bitmask_follows = True
        self.executor.execute_model(sched_out, non_block=True)
        try:
            bitmask = self.structured_output_manager.grammar_bitmask(
                self.scheduler.requests, sched_out.structured_output_request_ids)
        except BaseException:
            self._drop_kept_step()
            raise
        return self.executor.sample_tokens(bitmask, non_block=non_block)

    def _drop_kept_step(self) -> None:
        """[structured output] After a failed bitmask fill: let the workers finish the step's
        forward and drop it unsampled, so the next step starts clean (the step's own error is
        what the caller sees; one from here is only logged)."""
        try:
            self.executor.sample_tokens(None)
        except Exception:
            logger.exception("dropping the step after its grammar bitmask fill failed raised too")

    def _fill_grammar_bitmask(self, sched_out) -> None:
        """[structured output] Attach the step's grammar bitmask (rows of the constrained requests
        that sample); with only grammars compiling and nothing to run, sleep a moment so the
        compile threads get the CPU."""
        if sched_out.structured_output_request_ids:
            sched_out.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
                self.scheduler.requests, sched_out.structured_output_request_ids)
        elif sched_out.is_empty and any(r.status == RequestStatus.WAITING_FOR_FSM for r in self.scheduler.waiting):
            time.sleep(_GRAMMAR_WAIT_S)

    def _step_with_batch_queue(self) -> list[RequestOutput]:
        """A step with up to ``batch_queue_size`` batches in flight (vLLM V1's
        ``step_with_batch_queue``): while the queue has room, schedule the requests no batch in
        flight holds and submit them without waiting; only when the queue is full, or nothing new
        could be scheduled, wait for the OLDEST batch and process its output. Each stage thus
        works on another batch instead of waiting for the whole pipeline.

        A request is in at most one batch at a time (the scheduler skips those in flight), and
        outputs are processed in submission order, so tokens are those of one batch at a time.

        Returns:
            The oldest batch's RequestOutputs, or ``[]`` when a batch was submitted and the
            oldest one is not done yet.
        """
        t0 = time.perf_counter()
        queue = self._batch_queue
        if len(queue) < self.batch_queue_size:
            sched_out = self.scheduler.schedule()
            # An empty schedule is still sent when nothing is in flight (as a plain step), or
            # when it tells the workers something (finished ids, block moves).
            if not queue or not sched_out.is_empty or sched_out.finished_req_ids or sched_out.preempted_req_ids \
                    or sched_out.blocks_to_swap_out:
                if self._pending_processors:
                    self._hand_over_logits_processors(sched_out)
                # A request is in one batch at a time, so its matcher has every earlier token.
                queue.append((self._submit_step(sched_out, non_block=True), sched_out))
                if not sched_out.is_empty and len(queue) < self.batch_queue_size and not queue[0][0].done():
                    return []   # room for another batch: schedule it before waiting
        if not queue:
            return []
        future, sched_out = queue.popleft()
        outputs = self._process_runner_output(sched_out, future.result(), t0)
        # Nothing left to run: what is still queued only tells the workers about finished
        # requests; read it now so an idle engine has no step in flight.
        while queue and not self.scheduler.has_unfinished_requests():
            future, sched_out = queue.popleft()
            outputs += self._process_runner_output(sched_out, future.result(), t0)
        return outputs

    def _process_runner_output(self, sched_out, runner_out, t0: float) -> list[RequestOutput]:
        """Update the scheduler from a batch's output, run beam search, detokenize, record stats."""
        stats = IterationStats() if self.stat_loggers else None
        core_outputs = self.scheduler.update_from_output(sched_out, runner_out)
        beam_finished: list[RequestOutput] = []
        if self.beam_search.instances:
            core_outputs, beam_finished = self.beam_search.process_outputs(core_outputs, stats)
        processed = self.output_processor.process_outputs(core_outputs, stats)
        if processed.reqs_to_abort:
            self.scheduler.finish_requests(processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        if stats is not None:
            stats.observe_step(sched_out, time.perf_counter() - t0)
            self._record_stats(stats)
        self._publish_kv_events()
        return processed.request_outputs + beam_finished

    def _publish_kv_events(self) -> None:
        """[KV-cache events] Publish what the block pool recorded since the last call as one
        ``KVEventBatch`` (none when nothing was recorded; a no-op with events off)."""
        if self.kv_events_enabled:
            events = self.kv_cache_manager.take_events()
            if events:
                self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def _hand_over_logits_processors(self, sched_out) -> None:
        """Callables stay in this process: hand the logits processors of this step's new requests
        to the in-process worker, which applies them where it samples (never in the message)."""
        for new in sched_out.scheduled_new_reqs:
            if new.req_id in self._pending_processors:
                self._pending_processors.discard(new.req_id)
                request = self.scheduler.requests[new.req_id]
                self.executor.add_logits_processors(new.req_id, request.sampling_params.logits_processors)

    def _record_stats(self, stats: IterationStats) -> None:
        sched_stats = self.scheduler.make_stats()
        for stat_logger in self.stat_loggers:
            stat_logger.record(sched_stats, stats)

    def check_health(self) -> None:
        """Raises:
            RuntimeError: if the executor cannot run another step (a worker died or failed: the
                multiprocess and Ray executors stop every rank then, so the engine is done)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the executor's workers, the grammar compile threads and the KV-cache event
        publisher (after it sends what is queued) (idempotent)."""
        publisher = getattr(self, "kv_event_publisher", None)
        if publisher is not None:
            publisher.shutdown()
        self.structured_output_manager.shutdown()
        self.executor.shutdown()
