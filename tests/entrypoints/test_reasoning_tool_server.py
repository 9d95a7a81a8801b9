"""``--tool-call-parser`` llama3_json / xlam and ``--reasoning-parser`` through the server,
in-process, with the real ``openai`` client on a tiny random Llama. A random model writes no
call or ``<think>`` block by chance, so each reply's form is forced with a regex
(``structured_outputs`` beside ``tool_choice: "auto"``); what is tested is the parsers, the
response and the stream."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.chat_utils import load_chat_template
from pagedllm.entrypoints.openai.api_server import build_state
from asgi_utils import run_with_clients

pytestmark = pytest.mark.timeout(600)
MESSAGES = [{"role": "user", "content": "Weather in a city, and the time?"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}

THINK = r"<think>[a-z]{2,8}( [a-z]{2,8}){0,3}\.</think>"
_WEATHER_ARGS = r'\{"city": "[A-Z][a-z]{1,8}", "unit": "(C|F)"\}'
_TIME_ARGS = r'\{"tz": "[A-Z]{3}"\}'
LLAMA3_REPLY = (r'(<\|python_tag\|>)?\{"name": "get_weather", "parameters": ' + _WEATHER_ARGS +
                r'\}; \{"name": "get_time", "arguments": ' + _TIME_ARGS + r'\}')
_XLAM_ARRAY = (r'\[\{"name": "get_weather", "arguments": ' + _WEATHER_ARGS + r'\}, \{"name": "get_time", '
               r'"arguments": ' + _TIME_ARGS + r'\}\]')
XLAM_REPLY = r"(I will check\.\n```json\n" + _XLAM_ARRAY + r"\n```|" + _XLAM_ARRAY + ")"
PLAIN = r"[a-z]{2,8}( [a-z]{2,8}){1,4}\."


@pytest.fixture(scope="module", params=[("llama3_json", None), ("xlam", None), ("llama3_json", "deepseek_r1"),
                                        ("xlam", "qwen3")], ids=lambda p: "-".join(filter(None, p)))
def server(request, long_checkpoint):
    tool_parser, reasoning_parser = request.param
    args = EngineArgs(model=long_checkpoint, dtype="float32", max_model_len=4096, block_size=4,
                      kv_cache_memory_bytes=64 << 20, seed=0)
    st = build_state(args, ["tiny"], chat_template=load_chat_template("gemma-tools"), log_requests=False,
                     log_stats_interval_s=None, enable_auto_tool_choice=True, tool_call_parser=tool_parser,
                     reasoning_parser=reasoning_parser)
    yield tool_parser, reasoning_parser, st
    st.engine.shutdown()


def _joined(chunks, index: int):
    """(reasoning, reasoning_content, content, tool calls, finish reasons) of one streamed choice."""
    mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]

    def join(key: str) -> str | None:
        return "".join(getattr(c.delta, key, None) or "" for c in mine) or None

    calls = [tc for c in mine for tc in (c.delta.tool_calls or [])]
    return join("reasoning"), join("reasoning_content"), join("content"), calls, \
        [c.finish_reason for c in mine if c.finish_reason]


def test_calls_parsed_streamed_and_whole(server):
    tool_parser, reasoning_parser, state = server
    regex = (THINK if reasoning_parser else "") + (LLAMA3_REPLY if tool_parser == "llama3_json" else XLAM_REPLY)
    kwargs = dict(model="tiny", messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], temperature=1.0, max_tokens=300,
                  seed=21, n=2, extra_body={"structured_outputs": {"regex": regex}})

    async def fn(client, http):
        whole = await client.chat.completions.create(**kwargs)
        chunks = [c async for c in await client.chat.completions.create(stream=True, tool_choice="auto", **kwargs)]
        return whole, chunks
    whole, chunks = run_with_clients(state, fn)
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls"
        schemas = [WEATHER_TOOL["function"]["parameters"], {**TIME_TOOL["function"]["parameters"], "required": ["tz"]}]
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "get_time"]
        for call, schema in zip(choice.message.tool_calls, schemas):
            jsonschema.validate(json.loads(call.function.arguments), schema)
        assert len({c.id for c in choice.message.tool_calls}) == 2
        assert all(c.id.startswith("chatcmpl-tool-") for c in choice.message.tool_calls)
        assert choice.message.content in ((None, "I will check.") if tool_parser == "xlam" else (None,))
        reasoning = getattr(choice.message, "reasoning", None)
        if reasoning_parser:
            assert re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){0,3}\.", reasoning)
            assert choice.message.reasoning_content == reasoning
        else:
            assert reasoning is None and "reasoning" not in choice.message.model_dump(exclude_none=True)
        # Same seed, same text: the stream carries the same reasoning, content and calls.
        s_reasoning, s_reasoning_content, s_content, calls, reasons = _joined(chunks, choice.index)
        assert s_reasoning == s_reasoning_content == reasoning
        assert s_content == choice.message.content and reasons == ["tool_calls"]
        assert [tc.index for tc in calls] == [0, 1]
        assert [(tc.function.name, tc.function.arguments) for tc in calls] == \
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_plain_reply_is_content_with_its_reasoning(server):
    tool_parser, reasoning_parser, state = server
    regex = (THINK if reasoning_parser else "") + PLAIN
    kwargs = dict(model="tiny", messages=MESSAGES, tools=[WEATHER_TOOL], temperature=1.0, max_tokens=80, seed=3,
                  extra_body={"structured_outputs": {"regex": regex}})

    async def fn(client, http):
        whole = await client.chat.completions.create(**kwargs)
        chunks = [c async for c in await client.chat.completions.create(stream=True, **kwargs)]
        # Without tools the reasoning parser still splits the reply.
        no_tools = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, temperature=1.0, max_tokens=80, seed=4,
            extra_body={"structured_outputs": {"regex": regex}})
        raw = await http.post("/v1/chat/completions", json={**{k: v for k, v in kwargs.items() if k != "extra_body"},
                                                            **kwargs["extra_body"]})
        return whole, chunks, no_tools, raw.json()
    whole, chunks, no_tools, raw = run_with_clients(state, fn)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert re.fullmatch(PLAIN, choice.message.content)
    reasoning = getattr(choice.message, "reasoning", None)
    assert (reasoning is not None) == bool(reasoning_parser)
    assert _joined(chunks, 0) == (reasoning, reasoning, choice.message.content, [], ["stop"])
    # The reasoning chunks come before the content chunks.
    kinds = [("r" if getattr(c.choices[0].delta, "reasoning", None) else "c") for c in chunks
             if c.choices and (c.choices[0].delta.content or getattr(c.choices[0].delta, "reasoning", None))]
    assert kinds == sorted(kinds, reverse=True)
    assert re.fullmatch(PLAIN, no_tools.choices[0].message.content)
    assert (getattr(no_tools.choices[0].message, "reasoning", None) is not None) == bool(reasoning_parser)
    message = raw["choices"][0]["message"]
    assert "reasoning" in message and ("reasoning_content" in message) == bool(reasoning_parser), message
    assert (message["reasoning"] is not None) == bool(reasoning_parser)   # null without a parser, as vLLM


@pytest.mark.parametrize("server", [("xlam", "qwen3")], indirect=True, ids=["xlam-qwen3"])
def test_qwen3_enable_thinking_false_leaves_the_reply_content(server):
    tool_parser, reasoning_parser, state = server
    assert reasoning_parser == "qwen3"

    async def fn(client, http):
        return await client.chat.completions.create(
            model="tiny", messages=MESSAGES, temperature=1.0, max_tokens=80, seed=5,
            extra_body={"structured_outputs": {"regex": THINK + PLAIN},
                        "chat_template_kwargs": {"enable_thinking": False}})
    message = run_with_clients(state, fn).choices[0].message
    assert re.fullmatch(THINK + PLAIN, message.content) and getattr(message, "reasoning", None) is None
