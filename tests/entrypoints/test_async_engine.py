"""AsyncLLM on a tiny random checkpoint: streams, continuous batching across callers, aborts that free
blocks, a failing step that fails only its requests, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagedllm import SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import AsyncLLM, EngineDeadError, EngineStepError
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.sampling_params import RequestOutputKind

PROMPTS = ["The quick brown fox", "A paged KV cache", "Continuous batching admits", "Numbers 0123",
           "Über café naïve", "你好，世界！ 😀", "blocks of a fixed", "new requests at every"]


def _engine_args(path: str) -> EngineArgs:
    return EngineArgs(model=path, dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20, seed=0,
                      block_size=4)


@pytest.fixture(scope="module")
def tiny_dir(make_tiny_checkpoint):
    return make_tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def expected(tiny_dir):
    """Greedy outputs of LLMEngine run synchronously, each prompt alone."""
    from pagedllm import LLM
    llm = LLM(tiny_dir, **{k: v for k, v in vars(_engine_args(tiny_dir)).items() if k != "model"})
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in PROMPTS]


class _MaxRunning:
    def __init__(self):
        self.max_running = 0

    def record(self, scheduler_stats, iteration_stats):
        self.max_running = max(self.max_running, scheduler_stats.num_running)


@pytest.fixture
def async_llm(tiny_dir):
    llm = AsyncLLM(LLMEngine(_engine_args(tiny_dir)), stat_loggers=[_MaxRunning()], log_stats_interval_s=None)
    yield llm
    llm.shutdown()


def _greedy(max_tokens=12, kind=RequestOutputKind.DELTA, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind, **kw)


async def _collect(llm: AsyncLLM, prompt, params, request_id=None):
    text, token_ids, last = "", [], None
    async for out in llm.generate(prompt, params, request_id):
        text += out.outputs[0].text
        token_ids += out.outputs[0].token_ids
        last = out
    return text, token_ids, last


async def _wait_idle(llm: AsyncLLM, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    kv = llm.engine.kv_cache_manager
    while llm.engine.has_unfinished_requests() or kv.num_free_blocks != kv.num_blocks:
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: {llm.engine.get_num_unfinished_requests()} requests, "
                                 f"{kv.num_free_blocks}/{kv.num_blocks} blocks free")
        await asyncio.sleep(0.02)


def test_stream_deltas_equal_sync_generate(async_llm, expected):
    async def main():
        return await _collect(async_llm, PROMPTS[0], _greedy())
    text, token_ids, last = asyncio.run(main())
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert token_ids == expected[0].token_ids
    assert text == expected[0].text


def test_concurrent_callers_share_the_batch(async_llm, expected):
    async def main():
        return await asyncio.gather(*[_collect(async_llm, p, _greedy()) for p in PROMPTS])
    results = asyncio.run(main())
    assert [r[1] for r in results] == [e.token_ids for e in expected]
    assert [r[0] for r in results] == [e.text for e in expected]
    assert async_llm.engine.stat_loggers[0].max_running > 1  # they really ran together


def test_late_request_joins_running_batch(async_llm, expected):
    """A request added while another decodes joins its batch. No timing: the first request's logits
    hook holds the engine thread at its second token until the second request is queued."""
    decoding, queued = threading.Event(), threading.Event()

    def hold_at_second_token(output_ids, logits):
        if len(output_ids) == 1 and not decoding.is_set():
            decoding.set()
            queued.wait(60)
        return logits

    async def main():
        first = asyncio.ensure_future(_collect(async_llm, PROMPTS[1], _greedy(
            max_tokens=40, logits_processors=[hold_at_second_token])))
        assert await asyncio.to_thread(decoding.wait, 60)
        second_task = asyncio.ensure_future(_collect(async_llm, PROMPTS[2], _greedy()))
        await asyncio.sleep(0)  # the task runs to its first await: the request is queued (add_request)
        queued.set()
        second = await second_task
        # The second's 12 tokens took 12 steps, each also a step of the first, which had 38 left.
        assert not first.done()
        return second, await first
    second, first = asyncio.run(main())
    assert second[1] == expected[2].token_ids
    assert first[1][:12] == expected[1].token_ids
    assert async_llm.engine.stat_loggers[0].max_running == 2


def test_deltas_never_split_multibyte_characters(async_llm):
    """The tiny byte-level BPE spells most non-ASCII characters with several tokens: streamed deltas
    must hold a character back until it is complete, so their concatenation equals the final text."""
    prompt = "Über café naïve — 你好，世界！ 😀 🚀"

    async def main():
        results = []
        for seed in range(4):
            sampled = dict(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True)
            deltas = [out.outputs[0].text async for out in async_llm.generate(
                prompt, SamplingParams(**sampled, output_kind=RequestOutputKind.DELTA))]
            final = [out async for out in async_llm.generate(
                prompt, SamplingParams(**sampled, output_kind=RequestOutputKind.FINAL_ONLY))][-1]
            results.append((deltas, final.outputs[0].text))
        return results
    results = asyncio.run(main())
    for deltas, final in results:
        assert "".join(deltas) == final
    assert any(ord(ch) > 127 and ch != "\ufffd" for _, final in results for ch in final)


def test_validation_errors_raise_synchronously(async_llm):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            async_llm.add_request("r-empty", "", _greedy())
        with pytest.raises(ValueError, match=r"must be in \[0, "):
            async_llm.add_request("r-oov", [1, 2, 10**6], _greedy())
        with pytest.raises(ValueError, match="longer than max_model_len"):
            async_llm.add_request("r-long", list(range(3, 300)), _greedy())
        stream = async_llm.add_request("dup", PROMPTS[0], _greedy(max_tokens=50))
        with pytest.raises(ValueError, match="already running"):
            async_llm.add_request("dup", PROMPTS[0], _greedy())
        stream.abort()
        await _wait_idle(async_llm)
    asyncio.run(main())


def test_abort_frees_blocks_at_once(async_llm):
    async def main():
        kv = async_llm.engine.kv_cache_manager
        seen = 0
        async for out in async_llm.generate(PROMPTS[3], _greedy(max_tokens=200), "to-abort"):
            seen += 1
            if seen == 3:
                assert kv.num_free_blocks < kv.num_blocks
                break  # leaving the loop aborts the request
        await _wait_idle(async_llm, timeout=5.0)
        # The engine keeps serving.
        text, token_ids, _ = await _collect(async_llm, PROMPTS[0], _greedy(max_tokens=3))
        assert len(token_ids) == 3
    asyncio.run(main())


def test_cancelled_task_aborts(async_llm):
    async def main():
        first = asyncio.Event()

        async def consume():   # cancelled right after its first output: mid-generation on any machine
            async for _ in async_llm.generate(PROMPTS[4], _greedy(max_tokens=200)):
                first.set()
                await asyncio.sleep(0)

        task = asyncio.ensure_future(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_idle(async_llm, timeout=5.0)
    asyncio.run(main())


def test_dropped_stream_aborts(async_llm):
    import gc

    async def main():
        stream = async_llm.add_request("dropped", PROMPTS[5], _greedy(max_tokens=200))
        await stream.__anext__()
        del stream  # never read to the end, never aborted explicitly
        gc.collect()
        await _wait_idle(async_llm, timeout=5.0)
    asyncio.run(main())


def test_step_exception_fails_its_requests_and_loop_continues(async_llm, expected, monkeypatch):
    runner = async_llm.engine.executor.driver_worker.model_runner
    real = runner.execute_model
    calls = {"n": 0, "failed": False}

    # The failure is injected into the second step that holds all three requests: under load the loop
    # may step the first request alone before the others are added, and a failed step fails only the
    # requests it holds (a request admitted after it would rightly finish).
    def flaky(sched_out):
        if not calls["failed"] and len(sched_out.num_scheduled_tokens) == 3:
            calls["n"] += 1
            if calls["n"] == 2:
                calls["failed"] = True
                raise RuntimeError("injected failure")
        return real(sched_out)

    monkeypatch.setattr(runner, "execute_model", flaky)

    async def main():
        results = await asyncio.gather(*[_collect(async_llm, p, _greedy(max_tokens=20)) for p in PROMPTS[:3]],
                                       return_exceptions=True)
        assert all(isinstance(r, EngineStepError) for r in results), results
        assert "injected failure" in str(results[0])
        assert calls["failed"]
        await _wait_idle(async_llm, timeout=5.0)
        return await _collect(async_llm, PROMPTS[0], _greedy())
    text, token_ids, _ = asyncio.run(main())
    assert token_ids == expected[0].token_ids


def test_metrics_see_tokens_latencies_and_aborts(tiny_dir):
    from prometheus_client import generate_latest

    engine = LLMEngine(_engine_args(tiny_dir))
    prom = PrometheusStatLogger("tiny", engine.max_model_len, engine.scheduler_config.max_num_batched_tokens,
                                initial=engine.scheduler.make_stats())
    llm = AsyncLLM(engine, stat_loggers=[prom], log_stats_interval_s=None)

    def value(name, **labels):
        v = prom.registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})
        return 0.0 if v is None else v

    async def main():
        await _collect(llm, PROMPTS[0], _greedy(max_tokens=5))
        await _collect(llm, PROMPTS[1], _greedy(max_tokens=5, kind=RequestOutputKind.FINAL_ONLY))
        async for _ in llm.generate(PROMPTS[2], _greedy(max_tokens=100)):
            break
        await _wait_idle(llm)
    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    assert value("pagedllm:num_total_blocks") == engine.kv_cache_manager.num_blocks
    assert value("pagedllm:num_free_blocks") == engine.kv_cache_manager.num_blocks
    assert value("pagedllm:kv_cache_usage_perc") == 0.0
    assert value("pagedllm:request_success_total", finished_reason="length") == 2
    assert value("pagedllm:request_success_total", finished_reason="abort") == 1
    n_prompt = sum(len(engine.tokenizer.encode(p)) for p in PROMPTS[:3])
    assert value("pagedllm:prompt_tokens_total") == n_prompt
    assert value("pagedllm:generation_tokens_total") >= 11
    assert value("pagedllm:time_to_first_token_seconds_count") == 3
    assert value("pagedllm:inter_token_latency_seconds_count") >= 8  # 4 + 4 + at least 0
    assert value("pagedllm:e2e_request_latency_seconds_count") == 3
    assert value("pagedllm:iteration_tokens_total_count") >= 5
    assert b"pagedllm:num_requests_running" in generate_latest(prom.registry)


def test_shutdown_fails_running_requests(tiny_dir):
    llm = AsyncLLM(LLMEngine(_engine_args(tiny_dir)), log_stats_interval_s=None)

    async def main():
        stream = llm.add_request("long", PROMPTS[0], _greedy(max_tokens=240))
        first = await stream.__anext__()
        assert not first.finished
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            llm.add_request("after", PROMPTS[0], _greedy())
    asyncio.run(main())
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.kv_cache_manager.num_blocks
