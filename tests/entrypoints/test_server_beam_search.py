"""vLLM's ``use_beam_search`` through the server, in-process (httpx ASGI transport, the official
openai client) on a tiny random Llama: ``/v1/completions`` and ``/v1/chat/completions`` with
``n`` = beam width return the same sequences, best first, as the offline ``LLM.beam_search``,
with usage; a beam search shares steps with other requests; bad input is a 400 naming the field;
a client that disconnects mid-search frees every block."""

from __future__ import annotations

import asyncio

import openai
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.entrypoints.chat_utils import load_chat_template
from pagedllm.entrypoints.openai.api_server import build_state
from asgi_utils import run_with_clients

ENGINE = dict(dtype="float32", max_model_len=128, block_size=4, kv_cache_memory_bytes=4 << 20, seed=0,
              max_num_seqs=8)
PROMPT = "The quick brown fox"
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def path(make_tiny_checkpoint):
    return make_tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def state(path):
    st = build_state(EngineArgs(model=path, **ENGINE), ["tiny"], chat_template=load_chat_template("gemma"),
                     log_requests=False, log_stats_interval_s=None)
    yield st
    st.engine.shutdown()


@pytest.fixture(scope="module")
def offline(path):
    return LLM(path, **ENGINE)


run = run_with_clients


def generated_texts(offline, out, num_prompt: int) -> list[str]:
    """The generated part of each offline beam as text (``BeamSearchSequence.text`` is vLLM's
    prompt + generated; the server's choices carry only what was generated, as vLLM's server)."""
    return [offline.get_tokenizer().decode(s.tokens[num_prompt:]) for s in out.sequences]


def assert_pool_empty(state) -> None:
    engine = state.engine.engine
    kv = engine.kv_cache_manager
    kv.check_integrity(engine.scheduler.requests)
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("width, max_tokens, extra", [
    (2, 6, {"ignore_eos": True}), (4, 5, {"ignore_eos": True, "length_penalty": 0.5}), (3, 12, {}),
])
def test_completions_equal_offline_beam_search(state, offline, width, max_tokens, extra):
    (want,) = offline.beam_search(PROMPT, BeamSearchParams(width, max_tokens, ignore_eos=bool(extra.get("ignore_eos")),
                                                           length_penalty=extra.get("length_penalty", 1.0)))
    response = run(state, lambda client, http: client.completions.create(
        model="tiny", prompt=PROMPT, n=width, max_tokens=max_tokens,
        extra_body={"use_beam_search": True, **extra}))
    num_prompt = len(offline.get_tokenizer().encode(PROMPT))
    assert [c.index for c in response.choices] == list(range(width))
    assert [c.text for c in response.choices] == generated_texts(offline, want, num_prompt)
    assert [s.text for s in want.sequences] == [offline.get_tokenizer().decode(s.tokens, skip_special_tokens=False)
                                                for s in want.sequences]
    assert [c.finish_reason for c in response.choices] == [s.finish_reason for s in want.sequences]
    assert response.usage.prompt_tokens == num_prompt
    assert response.usage.completion_tokens == sum(len(s.tokens) - num_prompt for s in want.sequences)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert_pool_empty(state)


def test_completions_two_prompts_and_echo(state, offline):
    prompts = [PROMPT, "Numbers 0123"]
    want = offline.beam_search(prompts, BeamSearchParams(2, 4, ignore_eos=True))
    response = run(state, lambda client, http: client.completions.create(
        model="tiny", prompt=prompts, n=2, max_tokens=4, echo=True,
        extra_body={"use_beam_search": True, "ignore_eos": True}))
    tok = offline.get_tokenizer()
    assert [c.text for c in response.choices] == [p + text for p, out in zip(prompts, want)
                                                  for text in generated_texts(offline, out, len(tok.encode(p)))]
    assert response.usage.completion_tokens == 2 * 2 * 4


def test_chat_equals_offline_beam_search(state, offline):
    messages = [{"role": "user", "content": "Say something."}]

    async def calls(client, http):
        tokens = (await http.post("/tokenize", json={"messages": messages})).json()["tokens"]
        chat = await client.chat.completions.create(model="tiny", messages=messages, n=3, max_tokens=6,
                                                    extra_body={"use_beam_search": True, "ignore_eos": True})
        return tokens, chat

    tokens, chat = run(state, calls)
    (want,) = offline.beam_search({"prompt_token_ids": tokens}, BeamSearchParams(3, 6, ignore_eos=True))
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert [c.message.content for c in chat.choices] == generated_texts(offline, want, len(tokens))
    assert chat.usage.prompt_tokens == len(tokens) and chat.usage.completion_tokens == 3 * 6
    assert_pool_empty(state)


def test_beam_search_runs_beside_other_requests(state, offline):
    """A long greedy request and a beam search share engine steps; both give their offline results."""
    engine = state.engine.engine
    sched = engine.scheduler
    real, steps = sched.schedule, []

    def schedule():
        out = real()
        steps.append(set(out.num_scheduled_tokens))
        return out

    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    (want_greedy,) = offline.generate("Numbers 0123", greedy, use_tqdm=False)
    (want_beams,) = offline.beam_search(PROMPT, BeamSearchParams(4, 8, ignore_eos=True))

    async def calls(client, http):
        plain = asyncio.ensure_future(client.completions.create(model="tiny", prompt="Numbers 0123", max_tokens=60,
                                                                temperature=0, extra_body={"ignore_eos": True}))
        await asyncio.sleep(0.01)
        beams = await client.completions.create(model="tiny", prompt=PROMPT, n=4, max_tokens=8,
                                                extra_body={"use_beam_search": True, "ignore_eos": True})
        return await plain, beams

    sched.schedule = schedule
    try:
        plain, beams = run(state, calls)
    finally:
        sched.schedule = real
    assert plain.choices[0].text == want_greedy.outputs[0].text
    assert [c.text for c in beams.choices] == generated_texts(offline, want_beams,
                                                              len(offline.get_tokenizer().encode(PROMPT)))
    # Some step ran the plain request together with beams (ids "beam<k>_<request id>").
    assert any(any(r.startswith("beam") for r in ids) and any(not r.startswith("beam") for r in ids) for ids in steps)
    # Seats: the beams never pushed the batch past max_num_seqs.
    assert max(len(ids) for ids in steps) <= ENGINE["max_num_seqs"]
    assert_pool_empty(state)


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("fields, param", [
    ({"stream": True}, "stream"), ({"temperature": 0.7}, "temperature"), ({"n": 0}, "n"),
    ({"n": ENGINE["max_num_seqs"] + 1}, "n"), ({"top_p": 0.5}, "top_p"), ({"stop": ["x"]}, "stop"),
    ({"logprobs": 2}, "logprobs"),
])
def test_bad_beam_search_requests_are_400_naming_the_field(state, route, fields, param):
    if route == "chat" and "logprobs" in fields:
        fields = {"logprobs": True}
    body = {"model": "tiny", "max_tokens": 3, "n": 2, "use_beam_search": True, **fields}
    body.update({"prompt": PROMPT} if route == "completions" else {"messages": [{"role": "user", "content": "Hi"}]})

    async def call(client, http):
        create = client.completions.create if route == "completions" else client.chat.completions.create
        extra = {k: body.pop(k) for k in ("use_beam_search",)}
        with pytest.raises(openai.BadRequestError) as info:
            await create(**body, extra_body=extra)
        return info.value

    error = run(state, call)
    assert error.status_code == 400
    assert error.body["param"] == param and param in error.body["message"], error.body


def test_length_penalty_without_beam_search_is_400(state):
    body = {"model": "tiny", "max_tokens": 2, "prompt": PROMPT, "length_penalty": 0.5}
    response = run(state, lambda client, http: http.post("/v1/completions", json=body))
    assert response.status_code == 400 and response.json()["error"]["param"] == "length_penalty"


def metric(state, name: str, **labels: str) -> float:
    value = state.registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})
    return 0.0 if value is None else value


def test_finished_beam_search_counts_once_in_metrics(state, offline):
    """A beam search is one request in /metrics: one success with its best beam's finish reason,
    its prompt once, one TTFT and e2e latency, and usage.completion_tokens generated tokens."""
    names = [("pagedllm:request_success_total", {"finished_reason": "length"}),
             ("pagedllm:request_success_total", {"finished_reason": "stop"}),
             ("pagedllm:prompt_tokens_total", {}), ("pagedllm:time_to_first_token_seconds_count", {}),
             ("pagedllm:e2e_request_latency_seconds_count", {}),
             ("pagedllm:request_generation_tokens_count", {}), ("pagedllm:request_generation_tokens_sum", {})]
    before = [metric(state, name, **labels) for name, labels in names]
    response = run(state, lambda client, http: client.completions.create(
        model="tiny", prompt=PROMPT, n=3, max_tokens=5, extra_body={"use_beam_search": True, "ignore_eos": True}))
    after = [metric(state, name, **labels) for name, labels in names]
    num_prompt = len(offline.get_tokenizer().encode(PROMPT))
    assert response.usage.completion_tokens == 3 * 5
    assert [a - b for a, b in zip(after, before)] == [1, 0, num_prompt, 1, 1, 1, 3 * 5]


def test_disconnect_mid_beam_search_frees_every_block(state):
    """A client that leaves while the beams run: the search is aborted, its blocks freed, and the
    server keeps serving."""
    engine = state.engine.engine
    aborts = metric(state, "pagedllm:request_success_total", finished_reason="abort")

    async def calls(client, http):
        task = asyncio.ensure_future(client.completions.create(
            model="tiny", prompt=PROMPT, n=4, max_tokens=100, extra_body={"use_beam_search": True, "ignore_eos": True}))
        for _ in range(2000):
            await asyncio.sleep(0.005)
            if len(engine.scheduler.running) > 1:   # beams forked
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(400):
            await asyncio.sleep(0.01)
            if not engine.beam_search.instances and not engine.has_unfinished_requests():
                break
        return await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)

    after = run(state, calls)
    assert after.usage.completion_tokens == 3
    assert metric(state, "pagedllm:request_success_total", finished_reason="abort") == aborts + 1
    assert not engine.beam_search.instances and not engine.beam_search.beam_to_instance
    assert_pool_empty(state)
