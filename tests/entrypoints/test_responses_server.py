"""``/v1/responses`` through the server, in-process (httpx ASGI transport), with the real ``openai``
client on a tiny random Llama: greedy replies equal the chat route's for the same conversation
(the Responses API runs on the chat path), the event stream is what the SDK accumulates,
``previous_response_id`` continues a stored conversation, forced tools and ``text.format`` give
calls and JSON the grammar guarantees, and bad input is a 400 naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.chat_utils import load_chat_template
from pagedllm.entrypoints.openai.api_server import build_state
from pagedllm.entrypoints.openai.protocol_responses import ResponsesResponse
from pagedllm.entrypoints.openai.serving_responses import ResponseStore, StoredResponse
from asgi_utils import run_with_clients
from error_utils import assert_error

pytestmark = pytest.mark.timeout(600)
run = run_with_clients

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                                "unit": {"enum": ["C", "F"]}},
                               "required": ["city", "unit"], "additionalProperties": False}}
TIME_TOOL = {"type": "function", "name": "get_time",
             "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}},
                            "required": ["tz"], "additionalProperties": False}}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def state(long_checkpoint):
    args = EngineArgs(model=long_checkpoint, dtype="float32", max_model_len=4096, block_size=4,
                      kv_cache_memory_bytes=64 << 20, seed=0)
    st = build_state(args, ["tiny"], chat_template=load_chat_template("gemma-tools"), log_requests=False,
                     log_stats_interval_s=None, max_stored_responses=3)
    yield st
    st.engine.shutdown()


async def chat_text(client, messages, max_tokens=8, **kwargs) -> str:
    out = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,
                                               temperature=0.0, **kwargs)
    return out.choices[0].message.content


def test_create_matches_the_chat_route(state):
    async def fn(client, http):
        plain = await client.responses.create(model="tiny", input="Hello there", max_output_tokens=8, temperature=0)
        told = await client.responses.create(model="tiny", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Hello there"}]}], instructions="Be brief.", max_output_tokens=8,
            temperature=0)
        return (plain, told, await chat_text(client, [{"role": "user", "content": "Hello there"}]),
                await chat_text(client, [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hello there"}]))
    plain, told, chat_plain, chat_told = run(state, fn)
    for response, expected in ((plain, chat_plain), (told, chat_told)):
        assert response.id.startswith("resp_") and response.object == "response"
        assert [item.type for item in response.output] == ["message"]
        message = response.output[0]
        assert message.role == "assistant" and message.id.startswith("msg_")
        assert [part.type for part in message.content] == ["output_text"]
        assert response.output_text == expected and expected
        assert response.usage.output_tokens <= 8 and response.usage.input_tokens > 0
        assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
        if response.usage.output_tokens == 8:   # cut by max_output_tokens
            assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        else:
            assert response.status == "completed"
    assert told.instructions == "Be brief." and told.usage.input_tokens > plain.usage.input_tokens


def test_stream_event_sequence(state):
    async def fn(client, http):
        events = [e async for e in await client.responses.create(model="tiny", input="Tell me", max_output_tokens=10,
                                                                 temperature=0, stream=True)]
        async with client.responses.stream(model="tiny", input="Tell me", max_output_tokens=10,
                                           temperature=0) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        whole = await client.responses.create(model="tiny", input="Tell me", max_output_tokens=10, temperature=0)
        return events, deltas, final, whole
    events, deltas, final, whole = run(state, fn)
    types = [e.type for e in events]
    n = types.count("response.output_text.delta")
    assert n >= 1
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * n + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-4].text == text and events[-2].item.content[0].text == text
    assert "".join(deltas) == text == final.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_previous_response_id_round_trip(state, ):
    async def fn(client, http):
        first = await client.responses.create(model="tiny", input="Hi", instructions="Old rules.",
                                              max_output_tokens=6, temperature=0)
        second = await client.responses.create(model="tiny", input="More", previous_response_id=first.id,
                                               max_output_tokens=6, temperature=0)
        expected = await chat_text(client, [{"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": first.output_text},
                                            {"role": "user", "content": "More"}], max_tokens=6)
        got = await client.responses.retrieve(first.id)
        unstored = await client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
        missing = await http.get(f"/v1/responses/{unstored.id}")
        unknown = await http.post("/v1/responses", json={"model": "tiny", "input": "x",
                                                         "previous_response_id": "resp_nope"})
        cancel = await http.post(f"/v1/responses/{first.id}/cancel")
        cancel_unknown = await http.post("/v1/responses/resp_nope/cancel")
        return first, second, expected, got, missing, unknown, cancel, cancel_unknown
    first, second, expected, got, missing, unknown, cancel, cancel_unknown = run(state, fn)
    # The instructions of the earlier turn are not carried over (OpenAI's rule).
    assert second.output_text == expected and second.previous_response_id == first.id
    assert got.id == first.id and got.output_text == first.output_text
    assert_error(missing, 404, "not found")
    assert_error(unknown, 404, "resp_nope", param="previous_response_id")
    assert_error(cancel, 400, "Cannot cancel")
    assert_error(cancel_unknown, 404, "resp_nope")


def test_forced_function_tools_and_tool_round_trip(state):
    async def fn(client, http):
        required = await client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER_TOOL, TIME_TOOL],
                                                 tool_choice="required", parallel_tool_calls=False,
                                                 max_output_tokens=100, temperature=1.0, extra_body={"seed": 3})
        named = await client.responses.create(model="tiny", input="What time is it?", tools=[WEATHER_TOOL, TIME_TOOL],
                                              tool_choice={"type": "function", "name": "get_time"},
                                              max_output_tokens=100, temperature=1.0, extra_body={"seed": 4}, stream=True)
        named_events = [e async for e in named]
        call = required.output[0]
        reply = await client.responses.create(model="tiny", tools=[WEATHER_TOOL], tool_choice="none",
                                              max_output_tokens=5, temperature=0, input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}])
        chained = await client.responses.create(model="tiny", previous_response_id=required.id, tool_choice="none",
                                                tools=[WEATHER_TOOL], max_output_tokens=5, temperature=0, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}])
        return required, named_events, reply, chained
    required, named_events, reply, chained = run(state, fn)
    schemas = {"get_weather": WEATHER_TOOL["parameters"], "get_time": TIME_TOOL["parameters"]}
    assert [item.type for item in required.output] == ["function_call"]
    call = required.output[0]
    assert call.name in schemas and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    types = [e.type for e in named_events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert "response.function_call_arguments.done" in types
    done = named_events[-1].response.output
    assert [(item.type, item.name) for item in done] == [("function_call", "get_time")]
    jsonschema.validate(json.loads(done[0].arguments), schemas["get_time"])
    assert [e.sequence_number for e in named_events] == list(range(len(named_events)))
    # Continuing with the call's output, given in full or through previous_response_id: the same prompt.
    assert reply.output[0].type == "message" and reply.status in ("completed", "incomplete")
    assert chained.output_text == reply.output_text and chained.usage.input_tokens == reply.usage.input_tokens


def test_text_format_json_schema(state):
    schema = Person.model_json_schema()

    async def fn(client, http):
        out = await client.responses.create(model="tiny", input="Describe a person.", max_output_tokens=200,
                                            temperature=1.0, extra_body={"seed": 2}, text={"format": {
                                                "type": "json_schema", "name": "person", "schema": schema,
                                                "strict": True}})
        parsed = await client.responses.parse(model="tiny", input="Describe a person.", max_output_tokens=200,
                                              temperature=1.0, extra_body={"seed": 5}, text_format=Person)
        return out, parsed
    out, parsed = run(state, fn)
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), schema)
    assert isinstance(parsed.output_parsed, Person)


@pytest.mark.parametrize("body, param, fragment", [
    ({"input": [{"type": "image", "url": "x"}]}, "input", "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input", "role"),
    ({"input": []}, "input", "at least one"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "function tool"),
    ({"input": "x", "tools": [WEATHER_TOOL]}, "tools", "enable-auto-tool-choice"),
    ({"input": "x", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "nope"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p"}}}, "text", "text.format"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text", "text.format"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens", "maximum context length"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "not supported"),
    ({"input": "x", "temperature": -1}, "temperature", "temperature"),
])
def test_bad_input_is_a_400_naming_the_field(state, body, param, fragment):
    async def fn(client, http):
        return await http.post("/v1/responses", json={"model": "tiny", **body})
    error = assert_error(run(state, fn), 400, fragment)
    if param is not None:
        assert error["param"] == param, error


def test_unknown_model_is_a_404(state):
    async def fn(client, http):
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="nope", input="x")
    run(state, fn)


def test_response_store_is_a_bounded_lru():
    store = ResponseStore(2)

    def item(i):
        return StoredResponse(ResponsesResponse(id=f"resp_{i}", model="m"), [])
    for i in range(2):
        store.put(item(i))
    assert store.get("resp_0") is not None   # now the most recently used
    store.put(item(2))
    assert len(store) == 2 and store.get("resp_1") is None and store.get("resp_0") is not None
    empty = ResponseStore(0)
    empty.put(item(0))
    assert empty.get("resp_0") is None
    with pytest.raises(ValueError, match="max-stored-responses"):
        ResponseStore(-1)


def test_auto_tool_choice_output_items_from_the_parser(state):
    from pagedllm.entrypoints.openai.tool_calls import ToolPlan
    from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser

    plan = ToolPlan("auto", parser=get_tool_parser("hermes"))
    text = 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    message, call = state.responses._output_items(plan, text)
    assert message.type == "message" and message.content[0].text.strip() == "Let me look."
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_time", {"tz": "UTC"})
    only_text = state.responses._output_items(plan, "no call here")
    assert [(i.type, i.content[0].text) for i in only_text] == [("message", "no call here")]


def test_sdk_stream_helper_accumulates_function_calls(state):
    async def fn(client, http):
        async with client.responses.stream(model="tiny", input="Time?", tools=[TIME_TOOL], tool_choice="required",
                                           max_output_tokens=100, temperature=1.0, extra_body={"seed": 6}) as stream:
            arg_deltas = [e async for e in stream if e.type == "response.function_call_arguments.delta"]
            final = await stream.get_final_response()
        return arg_deltas, final
    arg_deltas, final = run(state, fn)
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_time"
    assert arg_deltas[-1].snapshot == call.arguments
    jsonschema.validate(json.loads(call.arguments), TIME_TOOL["parameters"])


def test_max_stored_responses_flag():
    import argparse

    from pagedllm.entrypoints.openai.api_server import make_arg_parser
    from pagedllm.entrypoints.openai.serving_responses import DEFAULT_MAX_STORED_RESPONSES

    parser = make_arg_parser(argparse.ArgumentParser())
    assert parser.parse_args([]).max_stored_responses == DEFAULT_MAX_STORED_RESPONSES
    assert parser.parse_args(["--max-stored-responses", "0"]).max_stored_responses == 0


def test_store_drops_the_least_recently_used_response(state):
    """The fixture's server keeps 3 responses: the oldest of 4 new ones is gone."""
    async def fn(client, http):
        ids = [(await client.responses.create(model="tiny", input=f"n{i}", max_output_tokens=1)).id for i in range(4)]
        return [(await http.get(f"/v1/responses/{i}")).status_code for i in ids]
    assert run(state, fn) == [404, 200, 200, 200]


def test_negative_max_stored_responses_fails_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="--max-stored-responses"):
        build_state(EngineArgs(model=str(tmp_path / "no-such-model")), max_stored_responses=-1)


THINK_REPLY = r"<think>[a-z]{2,8}( [a-z]{2,8}){0,3}\.</think>[a-z]{2,8}( [a-z]{2,8}){1,4}\."


@pytest.fixture(scope="module")
def reasoning_state(long_checkpoint):
    args = EngineArgs(model=long_checkpoint, dtype="float32", max_model_len=4096, block_size=4,
                      kv_cache_memory_bytes=64 << 20, seed=0)
    st = build_state(args, ["tiny"], chat_template=load_chat_template("gemma"), log_requests=False,
                     log_stats_interval_s=None, reasoning_parser="deepseek_r1")
    yield st
    st.engine.shutdown()


def test_reasoning_parser_gives_a_reasoning_item(reasoning_state):
    """A random model writes no <think> block by chance: the reply's form is forced with vLLM's
    ``structured_outputs`` regex; what is tested is the split into items and events."""
    kwargs = dict(model="tiny", input="Think first.", max_output_tokens=200, temperature=1.0,
                  extra_body={"seed": 8, "structured_outputs": {"regex": THINK_REPLY}})

    async def fn(client, http):
        whole = await client.responses.create(**kwargs)
        events = [e async for e in await client.responses.create(stream=True, **kwargs)]
        async with client.responses.stream(**kwargs) as stream:
            final = await stream.get_final_response()
        follow = await client.responses.create(model="tiny", input="Next.", previous_response_id=whole.id,
                                               max_output_tokens=3, temperature=0)
        return whole, events, final, follow
    whole, events, final, follow = run(reasoning_state, fn)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    reasoning, answer = whole.output[0].content[0].text, whole.output_text
    assert whole.output[0].id.startswith("rs_") and whole.status == "completed"
    assert re.fullmatch(THINK_REPLY, f"<think>{reasoning}</think>{answer}")
    types = [e.type for e in events]
    first_text = types.index("response.output_text.delta")
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[first_text - 4:first_text] == ["response.reasoning_text.done", "response.output_item.done",
                                                "response.output_item.added", "response.content_part.added"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert [(i.type, i.id) for i in done.output] == [("reasoning", events[2].item.id), ("message", events[first_text].item_id)]
    assert final.output_text == answer and final.output[0].type == "reasoning"
    assert follow.status in ("completed", "incomplete")
