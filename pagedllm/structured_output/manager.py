"""``StructuredOutputManager``: compiles grammars off the engine loop and builds each step's bitmask.

Lives in the engine (vLLM V1's design): the matchers advance in ``Scheduler.update_from_output``
with the sampled tokens, and each step the engine asks for the bitmask of the constrained
requests that sample while the step's forward runs (``LLMEngine._submit_step``); it travels as
plain numpy in ``Executor.sample_tokens``'s message (or, with ``overlap_bitmask_fill`` off, in
the ``SchedulerOutput``) to where the logits are sampled. A multi-process executor ships the same
message to its workers; no worker holds grammar state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Mapping

import numpy as np

from pagedllm.config import StructuredOutputsConfig
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import get_backend_class, resolve_backend_name
from pagedllm.structured_output.grammar import config_key
from pagedllm.structured_output.request import StructuredOutputRequest

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    """The grammar compiler, its LRU cache and the step's token bitmask.

    The backend (``config.backend``: llguidance or xgrammar, ``backend.py``) and its view of the
    vocabulary (every token's bytes; 262,144 tokens for the default model) are built once, in the
    compile pool, on the first constrained request. Each distinct grammar (``grammar_key``) compiles once; its future sits in
    an LRU of ``config.max_grammar_cache`` entries, so concurrent requests with the same schema
    wait on one compile.

    Args:
        config: the structured-output settings.
        tokenizer: the engine's ``Tokenizer`` (its ``get_hf_tokenizer()`` feeds the backend).
        vocab_size: the logits width (tokens; may exceed the tokenizer's vocabulary).
        max_num_seqs: rows of the preallocated bitmask (the most requests in one step).
    Attributes:
        backend_name: the backend that runs ("guidance" or "xgrammar"; "auto" resolved).
        compile_times_s: seconds each grammar compile took, in completion order.
    Raises:
        ValueError: naming ``structured_outputs_backend`` when its package is not installed
            (at engine start, not at the first constrained request).
    """

    def __init__(self, config: StructuredOutputsConfig, tokenizer, vocab_size: int, max_num_seqs: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.backend_name = resolve_backend_name(config.backend)
        self._backend_class = get_backend_class(self.backend_name)
        self._pool = ThreadPoolExecutor(max_workers=config.compile_threads, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._backend: Future | None = None
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._bitmask: np.ndarray | None = None  # [max_num_seqs, ceil(vocab/32)] int32, made on first use
        self.compile_times_s: list[float] = []

    # -- compiling ----------------------------------------------------------------------------

    def _build_backend(self):
        return self._backend_class(self.tokenizer, self.vocab_size)

    def _compile(self, key: tuple[str, str]):
        backend = self._backend.result()
        t0 = time.perf_counter()
        compiled = backend.compile(key)
        elapsed = time.perf_counter() - t0
        with self._lock:
            self.compile_times_s.append(elapsed)
        logger.debug("compiled a %s grammar in %.3f s", key[0], elapsed)
        return compiled

    def compiled_grammar(self, params: StructuredOutputsParams) -> Future:
        """The future of ``params``'s compiled grammar: from the cache, or a new compile job.

        Raises:
            ValueError: for a schema that is not JSON (the input processor checks it earlier).
        """
        key = config_key(params, self.config)
        with self._lock:
            if self._backend is None:
                self._backend = self._pool.submit(self._build_backend)
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            while len(self._cache) > self.config.max_grammar_cache:
                self._cache.popitem(last=False)
            return future

    def make_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """A new handle (own matcher) over the shared compiled grammar of ``params``."""
        compiled = self.compiled_grammar(params)   # (starts the backend's build on first use)
        return StructuredOutputRequest(compiled, self._backend)

    @property
    def num_cached_grammars(self) -> int:
        """Entries in the compile cache (compiled or compiling)."""
        return len(self._cache)

    # -- the step's bitmask -------------------------------------------------------------------

    def grammar_bitmask(self, requests: Mapping[str, object], rows: Mapping[str, int]) -> np.ndarray | None:
        """The allowed next tokens of each constrained request that samples this step.

        Args:
            requests: request id -> ``core.Request`` (the scheduler's, holding the handles).
            rows: ``SchedulerOutput.structured_output_request_ids`` (request id -> row).
        Returns:
            [len(rows), ceil(vocab_size / 32)] int32 (a copy: it may cross a process boundary),
            or None when ``rows`` is empty.
        Raises:
            RuntimeError: if more rows than ``max_num_seqs`` are asked for.
        """
        if not rows:
            return None
        if len(rows) > self.max_num_seqs:
            raise RuntimeError(f"{len(rows)} constrained rows in one step, more than max_num_seqs={self.max_num_seqs}")
        if self._bitmask is None:
            self._bitmask = np.full((self.max_num_seqs, (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        # Row by row in this thread: xgrammar's ``BatchGrammarMatcher`` (a C++ thread pool) was
        # tried and made the next forward ~4x slower on 2 cores, its threads contending with
        # torch's OpenMP threads (docs/benchmarks.md).
        for req_id, row in rows.items():
            requests[req_id].structured_output_request.fill_bitmask(self._bitmask, row)
        return self._bitmask[:len(rows)].copy()

    def shutdown(self) -> None:
        """Stop the compile threads (running compiles finish; queued ones are cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
