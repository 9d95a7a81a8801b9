"""The synchronous engine: add_request / step / abort over the scheduler and the worker."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
import logging
import time

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.loaders import iterate_weights, load_config, resolve_model
from pagedllm.metrics.stats import IterationStats, StatLogger
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import Tokenizer
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)


def _text_config(hf_config: dict) -> dict:
    return hf_config.get("text_config", hf_config) if "text_config" in hf_config else hf_config


class LLMEngine:
    """One scheduler, one KV cache manager, one worker; ``step()`` runs one iteration of
    continuous batching (Orca, Yu et al. 2022; vLLM, Kwon et al. 2023).

    Args:
        args: engine arguments.
    Raises:
        ValueError: bad arguments, unsupported model, or a KV budget too small for max_model_len.
    """

    def __init__(self, args: EngineArgs) -> None:
        t0 = time.perf_counter()
        self.args = args
        files = resolve_model(args.model)
        self.model_files = files
        hf_config = load_config(files.folder)
        text_cfg = _text_config(hf_config)
        model_max_len = int(text_cfg.get("max_position_embeddings") or 2048)
        model_cfg, cache_cfg, sched_cfg, _parallel = args.create_engine_config(model_max_len)
        self.model_config, self.cache_config, self.scheduler_config = model_cfg, cache_cfg, sched_cfg
        # The tokenizer (a 33 MB tokenizer.json for Gemma) loads in a thread while the weights load.
        with ThreadPoolExecutor(max_workers=1) as pool:
            tokenizer_future = pool.submit(Tokenizer.from_pretrained, args.tokenizer or files.folder)
            self.worker = Worker(model_cfg, cache_cfg, sched_cfg, hf_config, iterate_weights(files.folder))
            self.tokenizer = tokenizer_future.result()
        self.vocab_size = int(text_cfg["vocab_size"])
        self.model_runner = ModelRunner(self.worker.model, self.worker.kv_caches, cache_cfg.block_size,
                                        self.worker.device, self.vocab_size, seed=model_cfg.seed)
        self.kv_cache_manager = KVCacheManager(cache_cfg.block_size, self.worker.num_blocks,
                                               enable_caching=cache_cfg.enable_prefix_caching)
        self.scheduler = Scheduler(sched_cfg, self.kv_cache_manager)
        self.input_processor = InputProcessor(self.tokenizer, sched_cfg.max_model_len, self.vocab_size,
                                              args.max_logprobs)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers: list[StatLogger] = []
        self._ids = itertools.count()
        self.load_time_s = time.perf_counter() - t0
        logger.info("Engine ready in %.2f s: model=%s dtype=%s quantization=%s device=%s max_model_len=%d "
                    "block_size=%d max_num_seqs=%d max_num_batched_tokens=%d prefix_caching=%s", self.load_time_s,
                    files.source,
                    str(self.worker.dtype).replace("torch.", ""), model_cfg.quantization, self.worker.device,
                    sched_cfg.max_model_len,
                    cache_cfg.block_size, sched_cfg.max_num_seqs, sched_cfg.max_num_batched_tokens,
                    cache_cfg.enable_prefix_caching)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None) -> str:
        """Validate, tokenize and queue a request (n > 1 / best_of become that many samples).

        Sample ``i`` gets engine id ``f"{i}_{request_id}"`` and, if ``params.seed`` is set, seed
        ``params.seed + i``.

        Returns:
            The request id.
        Raises:
            ValueError: invalid prompt or params (nothing is queued), or a duplicate request id.
        """
        request_id = str(next(self._ids)) if request_id is None else request_id
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already running")
        processed = self.input_processor.process(prompt, params)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        base = processed.params
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
                                          base, sample_params, arrival_time)
        for sid, sp in zip(sample_ids, sample_params):
            self.scheduler.add_request(Request(sid, processed.prompt_token_ids, sp, processed.max_tokens,
                                               arrival_time=arrival_time))
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests (by the caller's id): their blocks are freed at once.

        Returns:
            Final outputs (finish_reason "abort") for the requests that were still known.
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        sample_ids = [sid for rid in ids for sid in self.output_processor.sample_ids(rid)]
        self.scheduler.finish_requests(sample_ids, RequestStatus.FINISHED_ABORTED)
        stats = IterationStats() if self.stat_loggers and sample_ids else None
        outputs = self.output_processor.abort_requests(ids, stats)
        if stats is not None:
            self._record_stats(stats)
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``).

        Returns:
            True when cleared; False (nothing changed) while requests hold blocks.
        """
        return self.kv_cache_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, update, detokenize.

        Returns:
            RequestOutputs of the requests that made progress (or finished) this step.
        """
        t0 = time.perf_counter()
        stats = IterationStats() if self.stat_loggers else None
        sched_out = self.scheduler.schedule()
        runner_out = self.model_runner.execute_model(sched_out)
        core_outputs = self.scheduler.update_from_output(sched_out, runner_out)
        processed = self.output_processor.process_outputs(core_outputs, stats)
        if processed.reqs_to_abort:
            self.scheduler.finish_requests(processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        if stats is not None:
            stats.observe_step(sched_out, time.perf_counter() - t0)
            self._record_stats(stats)
        return processed.request_outputs

    def _record_stats(self, stats: IterationStats) -> None:
        sched_stats = self.scheduler.make_stats()
        for stat_logger in self.stat_loggers:
            stat_logger.record(sched_stats, stats)
