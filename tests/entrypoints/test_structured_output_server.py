"""Structured output and tools through the server, in-process (httpx ASGI transport), with the
real ``openai`` client and ``instructor`` on a tiny random Llama: every reply's shape comes from
the grammar (a random model never writes valid JSON by chance)."""

from __future__ import annotations

import json
import re

import jsonschema
import pydantic
import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.chat_utils import load_chat_template
from pagedllm.entrypoints.openai.api_server import build_state
from asgi_utils import run_with_clients
from tests.structured_output.backends import BACKENDS

pytestmark = pytest.mark.timeout(600)
MESSAGES = [{"role": "user", "content": "Describe a person."}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)
    likes_cats: bool


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}},
                                       "required": ["tz"], "additionalProperties": False}}}


@pytest.fixture(scope="module", params=BACKENDS)
def state(request, long_checkpoint):
    args = EngineArgs(model=long_checkpoint, dtype="float32", max_model_len=4096, block_size=4,
                      kv_cache_memory_bytes=64 << 20, seed=0, structured_outputs_backend=request.param)
    st = build_state(args, ["tiny"], chat_template=load_chat_template("gemma"), log_requests=False,
                     log_stats_interval_s=None)
    yield st
    st.engine.shutdown()


run = run_with_clients


def test_chat_completions_parse_returns_a_validated_pydantic_object(state):
    async def fn(client, http):
        return await client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Person,
                                                   temperature=1.0, seed=3, max_tokens=200, n=3)
    completion = run(state, fn)
    assert len(completion.choices) == 3
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_response_format_and_vllm_extras(state, stream):
    schema = Person.model_json_schema()
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}},
              lambda t: jsonschema.validate(json.loads(t), schema) is None),
             ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}},
              lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
             ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
             ({"guided_regex": r"(ab)+c"}, lambda t: re.fullmatch(r"(ab)+c", t)),
             ({"guided_json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
              lambda t: isinstance(json.loads(t), list)),
             ({"guided_grammar": 'root ::= "x" [0-9] [0-9]'}, lambda t: re.fullmatch(r"x[0-9][0-9]", t))]

    async def fn(client, http):
        results = []
        for extra, check in cases:
            if stream:
                text, finish = "", None
                async for chunk in await client.completions.create(
                        model="tiny", prompt="Go:", max_tokens=200, temperature=1.0, seed=5, stream=True,
                        extra_body=extra):
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
            else:
                out = await client.completions.create(model="tiny", prompt="Go:", max_tokens=200, temperature=1.0,
                                                      seed=5, extra_body=extra)
                text, finish = out.choices[0].text, out.choices[0].finish_reason
            results.append((extra, check, text, finish))
        return results
    for extra, check, text, finish in run(state, fn):
        assert finish == "stop", (extra, text)
        assert check(text), (extra, text)


def test_json_object(state):
    """Any JSON object: its strings are unbounded, so a random model may run to max_tokens; the
    replies that stop parse as objects, the cut ones are a prefix of one."""
    async def fn(client, http):
        return await client.completions.create(model="tiny", prompt="Go:", max_tokens=300, temperature=1.0, seed=1,
                                               n=4, extra_body={"response_format": {"type": "json_object"}})
    choices = run(state, fn).choices
    assert any(c.finish_reason == "stop" for c in choices)
    for c in choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.finish_reason == "length" and c.text.startswith("{")


def test_tool_choice_required_round_trip(state):
    async def fn(client, http):
        plain = await client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL],
                                                     tool_choice="required", temperature=1.0, seed=11, max_tokens=2000)
        chunks = [c async for c in await client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
            temperature=1.0, seed=11, max_tokens=2000, stream=True)]
        single = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
            parallel_tool_calls=False, temperature=1.0, seed=11, max_tokens=2000)
        return plain, chunks, single
    plain, chunks, single = run(state, fn)
    assert len(single.choices[0].message.tool_calls) == 1 and single.choices[0].finish_reason == "tool_calls"
    choice = plain.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.id.startswith("chatcmpl-tool-") for c in calls)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    # Streaming: delta.tool_calls with an index each, then finish_reason "tool_calls"; same seed, same calls.
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.index for tc in streamed] == list(range(len(calls)))
    assert [(tc.function.name, tc.function.arguments) for tc in streamed] == \
        [(c.function.name, c.function.arguments) for c in calls]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_choice_required_cut_by_max_tokens_is_text_without_tool_calls(state):
    """A reply cut by max_tokens is no call: finish_reason "length", content = the partial JSON,
    and no ``tool_calls`` key (the openai client reads None), as for any reply without calls."""
    body = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER_TOOL], "tool_choice": "required",
            "temperature": 1.0, "seed": 11, "max_tokens": 4}

    async def fn(client, http):
        raw = await http.post("/v1/chat/completions", json=body)
        parsed = await client.chat.completions.create(**body)
        plain = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
        return raw, parsed, plain
    raw, parsed, plain = run(state, fn)
    (message,) = [c["message"] for c in raw.json()["choices"]]
    assert raw.json()["choices"][0]["finish_reason"] == "length"
    assert "tool_calls" not in message and message["content"].startswith("[")
    assert parsed.choices[0].message.tool_calls is None and parsed.choices[0].finish_reason == "length"
    assert parsed.choices[0].message.content == message["content"]
    assert plain.choices[0].message.tool_calls is None


def test_named_tool_choice(state):
    async def fn(client, http):
        return await client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], temperature=1.0, seed=2, max_tokens=200,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = run(state, fn).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


@pytest.mark.parametrize("mode", ["JSON", "TOOLS"])
def test_instructor_returns_a_validated_object(state, mode):
    import instructor

    async def fn(client, http):
        patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
        return await patched.chat.completions.create(model="tiny", messages=MESSAGES, response_model=Person,
                                                     max_retries=0, temperature=1.0, seed=4, max_tokens=200,
                                                     **({"extra_body": {"response_format": {
                                                         "type": "json_schema", "json_schema": {
                                                             "name": "Person", "schema": Person.model_json_schema()}}}}
                                                        if mode == "JSON" else {}))
    person = run(state, fn)
    assert isinstance(person, Person)


@pytest.mark.parametrize("route, body, param, fragment", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "frobnicate"}}}}}}, "response_format", "cannot compile"),
    ("completions", {"guided_regex": "(unclosed"}, "guided_regex", "regular expression"),
    ("completions", {"guided_json": {"type": "string"}, "guided_regex": "a"}, "guided_regex", "only one"),
    ("completions", {"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}},
     "structured_outputs", "only one"),
    ("completions", {"structured_outputs": {"json": {"type": "string"}, "regex": "a"}}, "structured_outputs",
     "only one kind"),
    ("completions", {"response_format": {"type": "xml"}}, "response_format", "xml"),
    ("chat", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ("chat", {"tools": [WEATHER_TOOL], "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ("chat", {"tools": [WEATHER_TOOL]}, "tools", "--enable-auto-tool-choice"),   # omitted: "auto", as vLLM
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "frobnicate"}}}}}], "tool_choice": "required"},
     "tools", "cannot compile"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "frobnicate"}}}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools", "'f'"),
    ("chat", {"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "18 C",
                                                               "tool_call_id": "call_1"}]},
     "messages", "chat template rejected"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("chat", {"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
])
def test_bad_input_is_400_naming_the_field(state, route, body, param, fragment):
    if route == "chat":
        url, base = "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES}
    else:
        url, base = "/v1/completions", {"model": "tiny", "prompt": "x"}
    response = run(state, lambda client, http: http.post(url, json={**base, **body}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert state.engine.engine.get_num_unfinished_requests() == 0


def test_structural_tag_response_format_and_its_errors(state):
    """``response_format: {"type": "structural_tag", ...}`` (vLLM's form) reaches the grammar: every
    trigger in the reply opens a whole structure; a tag whose begin misses the triggers is a 400."""
    tag = {"type": "structural_tag", "triggers": ["<tool="], "structures": [
        {"begin": "<tool=echo>", "end": "</tool>",
         "schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["n"]}}]}

    def post(response_format):
        return run(state, lambda client, http: http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 40, "temperature": 1.0, "seed": 5,
            "response_format": response_format}))

    response = post(tag)
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["message"]["content"]
    for part in text.split("<tool=")[1:]:
        head = part if len(part) < 30 else part[:30]
        assert re.match(r'echo>\{"n":[0-9]\}</tool>', part) or response.json()["choices"][0]["finish_reason"] == "length", head
    bad = {**tag, "structures": [{**tag["structures"][0], "begin": "<other>"}]}
    response = post(bad)
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format", response.text
    assert "does not start with any trigger" in response.json()["error"]["message"]


def test_guided_decoding_backend_is_the_engines_or_a_400(state):
    """vLLM V1 selects the backend per engine: a request may name the engine's backend (or
    "auto"); another is a 400 naming ``guided_decoding_backend``, and nothing reaches the engine."""
    running = state.engine.engine.structured_output_manager.backend_name
    other = {"guidance": "xgrammar", "xgrammar": "guidance"}[running]

    def post(backend):
        return run(state, lambda client, http: http.post("/v1/completions", json={
            "model": "tiny", "prompt": "x", "max_tokens": 8, "guided_choice": ["yes", "no"],
            "guided_decoding_backend": backend}))

    for backend in (running, "auto"):
        response = post(backend)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] in ("yes", "no"), response.text
    for backend in (other, "outlines"):
        response = post(backend)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "guided_decoding_backend" and repr(running) in error["message"], error
    assert state.engine.engine.get_num_unfinished_requests() == 0


# -- tool_choice "auto": the model writes calls in its own format, the server's parser finds them.
# A random model writes no call by chance, so each test forces the reply's form with a regex
# (structured_outputs beside tool_choice "auto"); what is tested is the parser, the response and
# the stream, through the real client.
HERMES_REPLY = (r'(Checking\. )?<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,8}", '
                r'"unit": "(C|F)"\}\}\n</tool_call>\n<tool_call>\n\{"name": "get_time", "arguments": '
                r'\{"tz": "[A-Z]{3}"\}\}\n</tool_call>')
PYTHONIC_REPLY = r"\[get_weather\(city='[A-Z][a-z]{1,8}', unit='(C|F)'\), get_time\(tz='[A-Z]{3}'\)\]"


@pytest.fixture(scope="module", params=["hermes", "pythonic"])
def auto_state(request, long_checkpoint):
    args = EngineArgs(model=long_checkpoint, dtype="float32", max_model_len=4096, block_size=4,
                      kv_cache_memory_bytes=64 << 20, seed=0)
    st = build_state(args, ["tiny"], chat_template=load_chat_template("gemma-tools"), log_requests=False,
                     log_stats_interval_s=None, enable_auto_tool_choice=True, tool_call_parser=request.param)
    yield request.param, st
    st.engine.shutdown()


def test_auto_tool_choice_parses_calls_streamed_and_whole(auto_state):
    parser, state = auto_state
    regex = HERMES_REPLY if parser == "hermes" else PYTHONIC_REPLY
    kwargs = dict(model="tiny", messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], temperature=1.0, max_tokens=200,
                  extra_body={"structured_outputs": {"regex": regex}})

    async def fn(client, http):
        whole = await client.chat.completions.create(seed=21, n=2, **kwargs)  # tool_choice left out = "auto"
        streams = [[c async for c in await client.chat.completions.create(seed=21, n=2, stream=True, **kwargs)]]
        streams.append([c async for c in await client.chat.completions.create(
            seed=21, n=2, stream=True, tool_choice="auto", **kwargs)])
        return whole, streams
    whole, streams = run(state, fn)
    assert len(whole.choices) == 2
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls"
        weather, time_call = choice.message.tool_calls
        assert (weather.function.name, time_call.function.name) == ("get_weather", "get_time")
        jsonschema.validate(json.loads(weather.function.arguments), WEATHER_TOOL["function"]["parameters"])
        assert re.fullmatch(r"[A-Z]{3}", json.loads(time_call.function.arguments)["tz"])
        assert choice.message.content in ((None, "Checking. ") if parser == "hermes" else (None,))
    for chunks in streams:
        for choice in whole.choices:
            mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
            calls = [tc for c in mine for tc in (c.delta.tool_calls or [])]
            assert [tc.index for tc in calls] == [0, 1]
            assert all(tc.id.startswith("chatcmpl-tool-") and tc.type == "function" for tc in calls)
            # Same seed, same text: the streamed calls are the whole reply's.
            assert [(tc.function.name, tc.function.arguments) for tc in calls] == \
                [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
            content = "".join(c.delta.content or "" for c in mine)
            assert content == (choice.message.content or "")
            assert [c.finish_reason for c in mine if c.finish_reason] == ["tool_calls"]


def test_auto_tool_choice_plain_reply_and_round_trip(auto_state):
    """A reply that is no call stays content (finish_reason "stop"); the calls go back with the
    tool results (the gemma-tools template renders them) for the next turn."""
    parser, state = auto_state
    tools = [WEATHER_TOOL, TIME_TOOL]

    async def fn(client, http):
        plain = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=tools, tool_choice="auto", temperature=1.0, seed=3, max_tokens=50,
            extra_body={"structured_outputs": {"regex": r"[a-z]{2,8}( [a-z]{2,8}){1,4}\."}})
        called = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=tools, temperature=1.0, seed=4, max_tokens=200,
            extra_body={"structured_outputs": {"regex": HERMES_REPLY if parser == "hermes" else PYTHONIC_REPLY}})
        message = called.choices[0].message
        follow_up = MESSAGES + [message.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": tc.id, "content": "18 C" if k == 0 else "10:00"}
            for k, tc in enumerate(message.tool_calls)]
        answer = await client.chat.completions.create(model="tiny", messages=follow_up, tools=tools,
                                                      temperature=1.0, seed=5, max_tokens=8)
        return plain, called, answer
    plain, called, answer = run(state, fn)
    choice = plain.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){1,4}\.", choice.message.content)
    assert called.choices[0].finish_reason == "tool_calls"
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The calls and both results are in the second prompt (each result's text, the calls' JSON).
    assert answer.usage.prompt_tokens > called.usage.prompt_tokens + 20
