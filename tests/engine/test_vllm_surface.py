"""vLLM's example scripts run unchanged (issue 28): the names they reach for beyond ``LLM`` —
``current_platform``, ``get_open_port``, the chat-template fallback of a model without one,
``AsyncLLM.pause_generation`` / ``resume_generation``. Tiny random checkpoints; values asserted."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pagedllm import LLM, SamplingParams

ENGINE_KW = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20, seed=0)


def test_current_platform_and_get_open_port():
    import torch

    from pagedllm.platforms import Platform, current_platform
    from pagedllm.utils.network_utils import get_open_port

    assert current_platform.device_type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert current_platform.is_cpu() is (not torch.cuda.is_available())
    assert current_platform.is_cuda() is torch.cuda.is_available()
    assert not current_platform.is_rocm() and not current_platform.is_tpu() and not current_platform.is_xpu()
    with pytest.raises(ValueError, match="device_type"):
        Platform("rocm")
    port = get_open_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", port))      # it was free


def test_chat_falls_back_to_the_bundled_template_for_gemma3_only(make_tiny_checkpoint, caplog):
    from pagedllm.entrypoints.chat_utils import NoChatTemplateError, load_chat_template

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    gemma = LLM(make_tiny_checkpoint("gemma3"), **ENGINE_KW)
    try:
        assert gemma.llm_engine.tokenizer.chat_template is None
        assert gemma.llm_engine.tokenizer.model_type == "gemma3_text"
        fallback = gemma.chat(messages, params, use_tqdm=False)[0]
        explicit = gemma.chat(messages, params, use_tqdm=False, chat_template=load_chat_template("gemma"))[0]
        assert fallback.prompt == explicit.prompt
        assert fallback.prompt.endswith("<start_of_turn>user\nBe brief.\n\nHello there<end_of_turn>\n"
                                        "<start_of_turn>model\n")
        assert fallback.prompt_token_ids == explicit.prompt_token_ids
        assert fallback.outputs[0].token_ids == explicit.outputs[0].token_ids
    finally:
        gemma.llm_engine.shutdown()
    llama = LLM(make_tiny_checkpoint("llama"), **ENGINE_KW)
    try:
        with pytest.raises(NoChatTemplateError, match="no chat template"):
            llama.chat(messages, params, use_tqdm=False)
    finally:
        llama.llm_engine.shutdown()


# -- pause / resume ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def async_llm(make_tiny_checkpoint):
    from pagedllm import AsyncEngineArgs
    from pagedllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=make_tiny_checkpoint("llama"), **ENGINE_KW,
                                                       disable_log_stats=True))
    yield engine
    engine.shutdown()


PROMPT = "The quick brown fox"
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def test_pause_keep_freezes_then_resume_finishes_with_the_same_tokens(async_llm):
    async def run(pause: bool):
        arrivals: list[int] = []
        frozen: list[int] = []

        async def generator():
            last = None
            async for out in async_llm.generate(PROMPT, LONG, request_id=f"keep-{pause}"):
                arrivals.append(len(out.outputs[0].token_ids))
                last = out
            return last

        async def controller():
            while len(arrivals) < 3:
                await asyncio.sleep(0.001)
            await async_llm.pause_generation(mode="keep")
            assert await async_llm.is_paused()
            at_pause = len(arrivals)
            await asyncio.sleep(0.5)
            frozen.append(len(arrivals) - at_pause)
            # Keep mode queues new requests: this one starts after the resume.
            queued = asyncio.ensure_future(_collect(async_llm, "queued"))
            await asyncio.sleep(0.2)
            frozen.append(queued.done())
            await async_llm.resume_generation()
            assert not await async_llm.is_paused()
            return await queued

        if not pause:
            return await generator(), None, None
        final, queued = await asyncio.gather(generator(), controller())
        return final, queued, frozen

    reference, _, _ = asyncio.run(run(False))
    final, queued, frozen = asyncio.run(run(True))
    assert frozen[0] <= 1        # at most the step already under way when the pause came
    assert frozen[1] is False    # the queued request did not run while paused
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert final.outputs[0].token_ids == reference.outputs[0].token_ids and len(final.outputs[0].token_ids) == 40
    assert queued.finished and len(queued.outputs[0].token_ids) == 40


async def _collect(engine, request_id):
    last = None
    async for out in engine.generate(PROMPT, LONG, request_id=request_id):
        last = out
    return last


def test_pause_abort_ends_requests_and_refuses_new_ones_until_resume(async_llm):
    from pagedllm.engine.async_engine import EnginePausedError

    async def main():
        task = asyncio.ensure_future(_collect(async_llm, "to-abort"))
        while async_llm.engine.get_num_unfinished_requests() == 0 and not task.done():
            await asyncio.sleep(0.001)
        await async_llm.pause_generation()          # vLLM's default mode: abort
        aborted = await asyncio.wait_for(task, 10)
        with pytest.raises(EnginePausedError, match="paused"):
            await _collect(async_llm, "refused")
        await async_llm.resume_generation()
        after = await _collect(async_llm, "after")
        return aborted, after

    aborted, after = asyncio.run(main())
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert len(aborted.outputs[0].token_ids) < 40
    assert after.finished and len(after.outputs[0].token_ids) == 40
    kv = async_llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_pause_wait_returns_once_running_requests_finished(async_llm):
    async def main():
        task = asyncio.ensure_future(_collect(async_llm, "to-wait"))
        while async_llm.engine.get_num_unfinished_requests() == 0 and not task.done():
            await asyncio.sleep(0.001)
        await async_llm.pause_generation(mode="wait", clear_cache=True)
        done_at_return = task.done()
        await async_llm.resume_generation()
        return done_at_return, await task

    done_at_return, final = asyncio.run(main())
    assert done_at_return
    assert final.outputs[0].finish_reason == "length" and len(final.outputs[0].token_ids) == 40


def test_pause_rejects_an_unknown_mode(async_llm, make_tiny_checkpoint):
    from pagedllm.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="mode"):
        asyncio.run(async_llm.pause_generation(mode="freeze"))
    assert not asyncio.run(async_llm.is_paused())
    with pytest.raises(ValueError, match="mode"):
        LLMEngine.pause_generation(async_llm.engine, mode="stop")


# -- LLM.get_metrics -------------------------------------------------------------------------

def test_get_metrics_counts_what_generate_did(make_tiny_checkpoint):
    from pagedllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector

    llm = LLM(make_tiny_checkpoint("llama"), **ENGINE_KW, disable_log_stats=False)
    try:
        outs = llm.generate(["The quick brown fox", "Hello"], SamplingParams(temperature=0.0, max_tokens=5,
                                                                              ignore_eos=True), use_tqdm=False)
        metrics = llm.get_metrics()
    finally:
        llm.llm_engine.shutdown()
    by_name = {}
    for m in metrics:
        assert m.name.startswith("pagedllm:") and not isinstance(m, Vector)
        by_name.setdefault(m.name, []).append(m)
    (gen,) = by_name["pagedllm:generation_tokens"]
    assert isinstance(gen, Counter) and gen.value == 10 and gen.labels["engine"] == "0"
    (prompt,) = by_name["pagedllm:prompt_tokens"]
    assert prompt.value == sum(len(o.prompt_token_ids) for o in outs)
    success = {m.labels["finished_reason"]: m.value for m in by_name["pagedllm:request_success"]}
    assert success == {"stop": 0, "length": 2, "abort": 0}
    (running,) = by_name["pagedllm:num_requests_running"]
    assert isinstance(running, Gauge) and running.value == 0.0
    (e2e,) = by_name["pagedllm:e2e_request_latency_seconds"]
    assert isinstance(e2e, Histogram) and e2e.count == 2 == e2e.buckets["+Inf"] and e2e.sum > 0
    (lengths,) = by_name["pagedllm:request_generation_tokens"]
    assert lengths.buckets["5.0"] == 2 and lengths.buckets["2.0"] == 0 and lengths.sum == 10


def test_get_metrics_without_stats_raises(make_tiny_checkpoint):
    llm = LLM(make_tiny_checkpoint("llama"), **ENGINE_KW)
    try:
        with pytest.raises(RuntimeError, match="disable_log_stats=False"):
            llm.get_metrics()
    finally:
        llm.llm_engine.shutdown()


# -- trace replay ----------------------------------------------------------------------------

def test_trace_replay_emits_the_trace_with_the_models_logprobs(make_tiny_checkpoint):
    llm = LLM(make_tiny_checkpoint("llama"), **ENGINE_KW, enable_trace_replay=True)
    try:
        prompt = "The quick brown fox"
        greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3),
                              use_tqdm=False)[0].outputs[0]
        # Replaying greedy's own tokens: the same tokens and the same logprobs, at any temperature.
        replay = llm.generate(prompt, SamplingParams(trace_decode_token_ids=list(greedy.token_ids), logprobs=3,
                                                     temperature=1.0, seed=7), use_tqdm=False)[0].outputs[0]
        assert replay.token_ids == greedy.token_ids and replay.text == greedy.text
        for got, want, tok in zip(replay.logprobs, greedy.logprobs, greedy.token_ids):
            assert got[tok].logprob == pytest.approx(want[tok].logprob, abs=1e-5) and got[tok].rank == 1
        # An arbitrary trace, EOS (id 1) inside it included: emitted as given, ranks from the model.
        eos = llm.llm_engine.tokenizer.eos_token_ids[0]
        trace = [5, eos, 17, 5]
        forced = llm.generate(prompt, SamplingParams(trace_decode_token_ids=trace, logprobs=1, max_tokens=50),
                              use_tqdm=False)[0].outputs[0]
        assert list(forced.token_ids) == trace and forced.finish_reason == "length"
        assert all(step[tok].rank >= 1 and step[tok].logprob <= 0 for step, tok in zip(forced.logprobs, trace))
        vocab = llm.llm_engine.vocab_size
        with pytest.raises(ValueError, match="trace_decode_token_ids"):
            llm.generate(prompt, SamplingParams(trace_decode_token_ids=[vocab + 3]), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    off = LLM(make_tiny_checkpoint("llama"), **ENGINE_KW)
    try:
        with pytest.raises(ValueError, match="enable_trace_replay"):
            off.generate("hi", SamplingParams(trace_decode_token_ids=[5]), use_tqdm=False)
    finally:
        off.llm_engine.shutdown()


@pytest.mark.parametrize("kwargs, field", [({}, "non-empty"), ({"n": 2}, "n"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
                                           ({"bad_words_token_ids": [3]}, "bad_words_token_ids")])
def test_trace_replay_params_are_checked(kwargs, field):
    trace = [] if field == "non-empty" else [4, 5]
    with pytest.raises(ValueError, match=field):
        SamplingParams(trace_decode_token_ids=trace, **kwargs)
    with pytest.raises(ValueError, match="non-negative"):
        SamplingParams(trace_decode_token_ids=[3, -1])
    params = SamplingParams(trace_decode_token_ids=(4, 5, 6), max_tokens=99)
    assert params.max_tokens == 3 and params.ignore_eos and params.trace_decode_token_ids == [4, 5, 6]


def test_enable_expert_parallel_flag_changes_nothing_for_a_dense_model(make_tiny_checkpoint):
    from pagedllm import EngineArgs
    from pagedllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    assert parser.parse_args(["-ep"]).enable_expert_parallel is True
    assert parser.parse_args(["--enable_expert_parallel"]).enable_expert_parallel is True
    assert parser.parse_args([]).enable_expert_parallel is False
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = []
    for ep in (False, True):
        llm = LLM(make_tiny_checkpoint("llama"), **ENGINE_KW, enable_expert_parallel=ep)
        try:
            outs.append(llm.generate("The quick brown fox", greedy, use_tqdm=False)[0].outputs[0].token_ids)
        finally:
            llm.llm_engine.shutdown()
    assert outs[0] == outs[1]   # a dense model has no experts to place (MoE: tests/models/test_moe.py)


# -- load_format, collective_rpc -------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.multiprocess)])
def test_dummy_weights_then_reload_weights_gives_the_real_model(make_tiny_checkpoint, tp):
    ckpt = make_tiny_checkpoint("llama")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = "The quick brown fox"
    real = LLM(ckpt, **ENGINE_KW)
    try:
        want = real.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        real.llm_engine.shutdown()
    llm = LLM(ckpt, **ENGINE_KW, load_format="dummy", tensor_parallel_size=tp)
    try:
        dummy = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
        if tp == 1:
            weights = [p for p in llm.llm_engine.executor.driver_worker.model.parameters() if p.is_floating_point()]
            assert all(float(p.detach().abs().max()) <= 1e-3 for p in weights)
        assert dummy != want
        assert llm.collective_rpc("update_config", args=({"load_config": {"load_format": "auto"}},)) == [None] * tp
        llm.collective_rpc("reload_weights")
        assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == want
        if tp == 1:   # (in worker processes a failing call stops the workers: RuntimeError)
            with pytest.raises(ValueError, match="load_config.load_format"):
                llm.collective_rpc("update_config", args=({"model_config": {"dtype": "float16"}},))
    finally:
        llm.llm_engine.shutdown()


def test_load_format_is_checked(make_tiny_checkpoint):
    with pytest.raises(ValueError, match="load_format"):
        LLM(make_tiny_checkpoint("llama"), **ENGINE_KW, load_format="mistral")


# -- the demo server's helpers (applications/api_server/server.py) -----------------------------

def test_demo_server_helpers(monkeypatch):
    import argparse
    import resource

    from pagedllm import envs
    from pagedllm.usage.usage_lib import UsageContext
    from pagedllm.utils import FlexibleArgumentParser, random_uuid
    from pagedllm.utils.system_utils import set_ulimit

    monkeypatch.delenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", raising=False)
    assert envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE == 5
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "12")
    assert envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE == 12
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "soon")
    with pytest.raises(ValueError, match="VLLM_HTTP_TIMEOUT_KEEP_ALIVE"):
        envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    parser = FlexibleArgumentParser()
    assert parser.check_port("8000") == 8000
    for bad in ("80", "70000", "http"):
        with pytest.raises(argparse.ArgumentTypeError, match="port"):
            parser.check_port(bad)
    ids = {random_uuid() for _ in range(100)}
    assert len(ids) == 100 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert UsageContext.API_SERVER == "API_SERVER" and UsageContext("LLM_CLASS") is UsageContext.LLM_CLASS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    set_ulimit(min(soft, 1024))   # never lowers
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == soft
    assert SamplingParams(max_tokens=3, skip_clone=True).skip_clone


def test_serve_http_refuses_ssl_refresh():
    from fastapi import FastAPI

    from pagedllm.entrypoints.launchers.launcher import serve_http

    with pytest.raises(ValueError, match="enable_ssl_refresh"):
        asyncio.run(serve_http(FastAPI(), enable_ssl_refresh=True, port=0))
