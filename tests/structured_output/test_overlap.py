"""The grammar bitmask fill overlapped with the forward (vLLM V1's ``sample_tokens`` split,
``LLMEngine._submit_step``): the same tokens and logprobs as the old order (fill, then the whole
step) on a tiny random Llama for both backends, in one process (forks, seeds, logprobs, a beam
search beside them, the exact greedy head's masked rows, n-gram drafts beside constrained rows)
and at tensor_parallel_size=2 / pipeline_parallel_size=2 through the multiprocess executor; the fill really runs while the forward
runs (events, not timing); an abort mid-run and a failing fill leave the engine serving, its
blocks free and no step kept on the worker."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from tests.structured_output.backends import BACKENDS

SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "json_schemas.json").read_text())
SCHEMA = SCHEMAS[19]
pytestmark = pytest.mark.timeout(900)


def _engine(folder: str, backend: str, overlap: bool, **kwargs) -> LLMEngine:
    kwargs.setdefault("kv_cache_memory_bytes", 16 << 20)
    args = EngineArgs(model=folder, dtype="float32", max_model_len=256, seed=0, block_size=4, max_num_seqs=16,
                      structured_outputs_backend=backend,
                      structured_outputs_config={"overlap_bitmask_fill": overlap}, **kwargs)
    return LLMEngine(args)


def _json(seed=None, temperature=1.0, max_tokens=40, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)


# Constrained rows (seeded random, greedy, a fork pair, logprobs) beside unconstrained ones.
REQUESTS = [
    ("a person: ", _json(seed=1)),
    ("name it: ", _json(temperature=0.0)),
    ("two of them: ", _json(seed=5, n=2, logprobs=2)),
    ("free text ", SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True)),
    ("plain greedy ", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=1)),
]


def _run(engine: LLMEngine, requests=REQUESTS, abort_after: dict[str, int] | None = None,
         beam: bool = False) -> dict:
    """Add ``requests`` as r0, r1, ... (and, with ``beam``, a beam search "beam" beside them); step
    until done (aborting ``abort_after``'s request once it has that many tokens). Returns request
    id -> [(token ids, logprobs as dicts)] per sample."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    if beam:
        engine.add_beam_search_request("beam", "beams ", BeamSearchParams(beam_width=2, max_tokens=12))
    # Grammars compile on a thread pool: wait for them, so the steps (and so each row's batch) do
    # not depend on how fast that went on a loaded machine, in either order.
    for request in list(engine.scheduler.requests.values()):
        if getattr(request, "structured_output_request", None) is not None:
            request.structured_output_request.wait()
    out, aborted = {}, set()
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for ro in engine.step():
            if ro.finished:
                out[ro.request_id] = [(list(o.token_ids), None if o.logprobs is None else
                                       [{t: lp.logprob for t, lp in d.items()} for d in o.logprobs])
                                      for o in ro.outputs]
        for rid, n in (abort_after or {}).items():
            request = engine.scheduler.requests.get(rid)
            if rid not in aborted and request is not None and request.num_output_tokens >= n:
                engine.abort_request(rid)
                aborted.add(rid)
    assert not engine.has_unfinished_requests()
    return out


def _assert_clean(engine: LLMEngine) -> None:
    """Every block back in the pool; the in-process worker holds no request and no kept step."""
    kv = engine.kv_cache_manager
    engine.step()   # the finished ids reach the worker
    assert kv.num_free_blocks == kv.num_blocks
    worker = engine.executor.local_worker
    if worker is not None:
        assert worker.model_runner.requests.requests == {}
        assert worker.model_runner._pending_sampling is None


def _count_split_steps(engine: LLMEngine) -> list[int]:
    """Count the steps sent with ``grammar_bitmask_follows`` (a one-item list, updated in place)."""
    count = [0]
    executor = engine.executor
    original = executor.sample_tokens

    def counted(bitmask, non_block=False):
        count[0] += bitmask is not None
        return original(bitmask, non_block=non_block)
    executor.sample_tokens = counted
    return count


def _with_masked_greedy_head(engine: LLMEngine, folder: str) -> list[bool]:
    """Give the in-process worker an exact greedy head (int8 pass, which ``auto`` leaves off on a
    CPU without VNNI / native bf16) on the checkpoint's head weight, so greedy constrained rows
    take its masked path. Returns a list that gets, per head call, whether it was masked."""
    from safetensors.torch import load_file

    from pagedllm.sample.greedy_head import ExactGreedyHead

    weights = load_file(str(Path(folder) / "model.safetensors"))
    weight = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    runner = engine.executor.local_worker.model_runner
    runner.greedy_head = head = ExactGreedyHead(weight, "int8", 16, max_rows=16)
    argmax, masked_calls = head.argmax, []

    def counted(x, forbidden=None):
        masked_calls.append(forbidden is not None)
        return argmax(x, forbidden)
    head.argmax = counted
    return masked_calls


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlap_gives_the_old_order_tokens(make_tiny_checkpoint, backend):
    folder = make_tiny_checkpoint("llama")
    old = _engine(folder, backend, overlap=False)
    want = _run(old, beam=True)
    old.shutdown()
    new = _engine(folder, backend, overlap=True)
    split = _count_split_steps(new)
    got = _run(new, beam=True)
    assert split[0] > 10
    assert got == want and len(got["beam"]) == 2
    assert got["r0"][0][0] != want["r3"][0][0]   # (the runs hold real, distinct tokens)
    _assert_clean(new)
    new.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlap_with_the_exact_greedy_head_and_ngram_drafts(make_tiny_checkpoint, backend):
    """Greedy constrained rows through the exact greedy head's masked argmax (decided once the
    bitmask arrives), and n-gram drafts verified beside constrained rows: as the old order."""
    folder = make_tiny_checkpoint("llama")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    requests = REQUESTS + [("a b c a b c a b c a b", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)),
                           ("x y x y x y x y", SamplingParams(temperature=1.0, seed=9, max_tokens=30, ignore_eos=True))]
    results = []
    for overlap in (False, True):
        engine = _engine(folder, backend, overlap=overlap, speculative_config=spec)
        masked_calls = _with_masked_greedy_head(engine, folder)
        results.append(_run(engine, requests))
        assert sum(masked_calls) > 5 and not all(masked_calls)
        assert engine.spec_decoder.stats.num_draft_tokens > 0
        _assert_clean(engine)
        engine.shutdown()
    assert results[1] == results[0]


@pytest.mark.parametrize("backend,layout", [("guidance", "tp"), pytest.param("xgrammar", "tp", marks=BACKENDS[1].marks),
                                            ("guidance", "pp")])
def test_overlap_across_processes(make_tiny_checkpoint, backend, layout):
    """tensor_parallel_size=2 or pipeline_parallel_size=2 (multiprocess executor; with pipeline
    stages two batches in flight, ``_step_with_batch_queue``): the bitmask goes to the ranks in a
    second message; the tokens equal the old order's at the same layout (one process differs
    from two ranks in rounding)."""
    folder = make_tiny_checkpoint("llama")
    kwargs = dict(cpu_threads_per_rank=1, **{"tensor_parallel_size" if layout == "tp" else "pipeline_parallel_size": 2})
    old = _engine(folder, backend, overlap=False, **kwargs)
    want = _run(old)
    old.shutdown()
    new = _engine(folder, backend, overlap=True, **kwargs)
    split = _count_split_steps(new)
    got = _run(new)
    assert split[0] > 10
    assert got == want
    if layout == "pp":
        assert new.executor.max_num_batches_in_flight == 2
    _assert_clean(new)
    new.shutdown()


def test_a_rank_dying_in_a_split_step_is_reported(make_tiny_checkpoint):
    """A worker process killed while a constrained step is in flight: the step raises naming the
    rank, and the executor refuses later calls (fail-stop, as for a plain step)."""
    engine = _engine(make_tiny_checkpoint("llama"), "guidance", overlap=True, tensor_parallel_size=2,
                     cpu_threads_per_rank=1)
    try:
        engine.add_request("c", "json: ", _json(seed=2, max_tokens=30))
        while not engine.scheduler.running:
            engine.step()   # (the grammar compiles)
        engine.step()
        engine.executor.processes[1].kill()
        with pytest.raises(RuntimeError, match="worker rank 1 .*(died|cannot be reached)"):
            for _ in range(5):
                engine.step()
        with pytest.raises(RuntimeError, match="stopped after a failure"):
            engine.check_health()
    finally:
        engine.shutdown()


def test_fill_runs_while_the_forward_runs(make_tiny_checkpoint):
    """An instrumented step: the model's forward, once started, waits until the bitmask fill has
    begun, and the fill waits until the forward has started. Both see each other only if they
    run at the same time (in the old order the fill would wait for a forward not started yet)."""
    engine = _engine(make_tiny_checkpoint("llama"), "guidance", overlap=True)
    runner = engine.executor.local_worker.model_runner
    manager = engine.structured_output_manager
    forward_started, fill_started = threading.Event(), threading.Event()
    seen = {"fill saw the forward": [], "forward saw the fill": [], "forward thread": []}
    forward, fill = runner.model.forward, manager.grammar_bitmask

    def instrumented_forward(*args, **kwargs):
        forward_started.set()
        seen["forward thread"].append(threading.current_thread().name)
        seen["forward saw the fill"].append(fill_started.wait(timeout=30))
        return forward(*args, **kwargs)

    def instrumented_fill(*args, **kwargs):
        fill_started.set()
        seen["fill saw the forward"].append(forward_started.wait(timeout=30))
        try:
            return fill(*args, **kwargs)
        finally:
            forward_started.clear()
            fill_started.clear()

    runner.model.forward = instrumented_forward
    manager.grammar_bitmask = instrumented_fill
    engine.add_request("c", "json: ", _json(seed=2, max_tokens=8))
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert len(seen["fill saw the forward"]) >= 8 and all(seen["fill saw the forward"])
    assert all(seen["forward saw the fill"])
    assert all(name.startswith("pagedllm-forward") for name in seen["forward thread"])
    engine.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_mid_run_as_the_old_order(make_tiny_checkpoint, backend):
    """A constrained request and a fork pair aborted after a few tokens: the others finish with
    the old order's tokens; every block is free afterwards."""
    folder = make_tiny_checkpoint("llama")
    abort = {"r0": 3, "r2": 5}
    results = []
    for overlap in (False, True):
        engine = _engine(folder, backend, overlap=overlap)
        results.append(_run(engine, abort_after=abort))
        _assert_clean(engine)
        engine.shutdown()
    assert results[1] == results[0]
    assert {"r1", "r3", "r4"} <= set(results[1]) and "r0" not in results[1]


class _FailingFill:
    """Wraps a request's grammar handle: its ``fill_bitmask`` raises on the ``fail_at``-th call."""

    def __init__(self, handle, fail_at: int) -> None:
        self._handle, self._fail_at, self.calls = handle, fail_at, 0

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def fill_bitmask(self, bitmask, row):
        self.calls += 1
        if self.calls == self._fail_at:
            raise RuntimeError("the grammar backend failed")
        return self._handle.fill_bitmask(bitmask, row)


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_failing_fill_drops_the_step_and_the_engine_serves_on(make_tiny_checkpoint, executor):
    """The fill raises while the forward runs: the step raises the fill's error (as before the
    overlap); the caller aborts the step's requests (as the async engine does), every block goes
    back, and new requests get the tokens a fresh engine gives them."""
    folder = make_tiny_checkpoint("llama")
    kwargs = dict(tensor_parallel_size=2, cpu_threads_per_rank=1) if executor == "mp" else {}
    fresh = _engine(folder, "guidance", overlap=True, **kwargs)
    want = _run(fresh)
    fresh.shutdown()
    engine = _engine(folder, "guidance", overlap=True, **kwargs)
    engine.add_request("bad", "json: ", _json(seed=4))
    engine.add_request("good", "json: ", _json(seed=6))
    engine.step()   # compiles, admits
    for _ in range(50):
        request = engine.scheduler.requests.get("bad")
        if request.structured_output_request.is_ready() and request.num_output_tokens > 0:
            break
        engine.step()
    request.structured_output_request = _FailingFill(request.structured_output_request, fail_at=2)
    with pytest.raises(RuntimeError, match="the grammar backend failed"):
        for _ in range(10):
            engine.step()
    engine.abort_request(["bad", "good"])
    assert not engine.has_unfinished_requests()
    _assert_clean(engine)
    engine.check_health()
    got = _run(engine)
    assert got == want
    _assert_clean(engine)
    engine.shutdown()
