"""Tool-call parsers for tool_choice "auto" (hermes, pythonic), whole-reply and streamed, and the
tool-aware Gemma template; no model."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.chat_utils import apply_chat_template, load_chat_template
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCallStream, get_tool_parser

HERMES_TWO = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
PYTHONIC_TWO = "[get_weather(city='Paris', unit=\"C\", days=[1, 2], exact=True), get_time(tz=None)]"


def _calls(result):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.tool_calls]


def test_hermes_extracts_calls_and_content():
    parser = get_tool_parser("hermes")
    result = parser.extract_tool_calls(HERMES_TWO)
    assert result.tools_called and result.content == "Let me check. "
    assert _calls(result) == [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"tz": "CET"})]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in result.tool_calls)
    assert len({c["id"] for c in result.tool_calls}) == 2
    # Only calls: no content. A last block cut before its closing tag counts when its JSON is whole.
    only = parser.extract_tool_calls('<tool_call>\n{"name": "f", "parameters": {"a": 1}}\n')
    assert only.tools_called and only.content is None and _calls(only) == [("f", {"a": 1})]
    for text in ["no calls here", '<tool_call>\n{"name": "f", "arguments": {"a": 1\n</tool_call>',
                 '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>["f"]</tool_call>']:
        result = parser.extract_tool_calls(text)
        assert not result.tools_called and result.content == text and result.tool_calls == []


def test_pythonic_extracts_literal_keyword_calls():
    parser = get_tool_parser("pythonic")
    result = parser.extract_tool_calls("  " + PYTHONIC_TWO + "\n")
    assert result.tools_called and result.content is None
    assert _calls(result) == [("get_weather", {"city": "Paris", "unit": "C", "days": [1, 2], "exact": True}),
                              ("get_time", {"tz": None})]
    assert _calls(parser.extract_tool_calls("[tools.search(q='x')]")) == [("tools.search", {"q": "x"})]
    for text in ["The weather is fine.", "[f('positional')]", "[f(a=g())]", "[f(a=1)", "[]", "[1, 2]",
                 "[f(**kw)]", "[__import__('os').system(cmd='ls')]"]:
        result = parser.extract_tool_calls(text)
        assert not result.tools_called and result.content == text, text


def _stream(parser_name: str, text: str, piece: int):
    stream = ToolCallStream(get_tool_parser(parser_name))
    content, calls, first_call_at = "", [], None
    for i in range(0, len(text), piece):
        c, tc = stream.feed(text[i:i + piece])
        content += c
        if tc and first_call_at is None:
            first_call_at = i + piece
        calls += tc
    c, tc = stream.finish()
    return content + c, calls + tc, first_call_at, stream


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_hermes_streaming_equals_the_whole_parse(piece):
    content, calls, first_call_at, stream = _stream("hermes", HERMES_TWO, piece)
    whole = get_tool_parser("hermes").extract_tool_calls(HERMES_TWO)
    assert content == whole.content and stream.tools_called
    assert [c["index"] for c in calls] == [0, 1]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]
    if piece == 1:  # the first call goes out as soon as its closing tag is in, not at the end
        assert first_call_at == HERMES_TWO.index("</tool_call>") + len("</tool_call>")


def test_hermes_streaming_holds_back_a_possible_tag_and_releases_plain_text():
    stream = ToolCallStream(get_tool_parser("hermes"))
    assert stream.feed("Sure <tool_") == ("Sure ", [])   # "<tool_" may open a call: held back
    assert stream.feed("box> is a word") == ("<tool_box> is a word", [])
    assert stream.finish() == ("", [])
    content, calls, _, stream = _stream("hermes", "plain <b>text</b> ends <", 1)
    assert content == "plain <b>text</b> ends <" and calls == [] and not stream.tools_called


@pytest.mark.parametrize("piece", [1, 1000])
def test_pythonic_streaming(piece):
    content, calls, first_call_at, _ = _stream("pythonic", PYTHONIC_TWO, piece)
    assert content == "" and [c["index"] for c in calls] == [0, 1] and first_call_at is None  # sent at the end
    assert json.loads(calls[0]["function"]["arguments"])["days"] == [1, 2]
    content, calls, _, _ = _stream("pythonic", "It is sunny [really].", piece)
    assert content == "It is sunny [really]." and calls == []
    content, calls, _, _ = _stream("pythonic", "[not a call]", piece)
    assert content == "[not a call]" and calls == []


def test_unknown_parser_names_the_field():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "pythonic", "xlam"]
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        get_tool_parser("mistral")


class _Tokens:
    special_tokens = {"bos_token": "<bos>", "eos_token": "<eos>"}
    chat_template = None


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_gemma_tools_template_renders_tools_calls_and_responses():
    template = load_chat_template("gemma-tools")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "18 C"},
        {"role": "tool", "tool_call_id": "b", "content": "25 C"},
    ]
    text = apply_chat_template(_Tokens(), messages, template, tools=TOOLS)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nYou can call these functions:\n"
        '{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
        '"required": ["city"]}}\n\nTo call a function, reply with one block per call and nothing else:\n'
        '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>\n'
        "Otherwise reply in plain text.\n\nWeather in Paris and Rome?<end_of_turn>\n"
        '<start_of_turn>model\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><end_of_turn>\n'
        "<start_of_turn>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n25 C\n</tool_response>"
        "<end_of_turn>\n<start_of_turn>model\n")
    # The model's calls in that form parse back with the hermes parser.
    model_turn = text.split("<start_of_turn>model\n")[1].split("<end_of_turn>")[0]
    assert _calls(get_tool_parser("hermes").extract_tool_calls(model_turn)) == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    # Without tools it renders exactly like the plain Gemma template.
    plain = [messages[0], messages[1], {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Ok"}]
    assert apply_chat_template(_Tokens(), plain, template) == \
        apply_chat_template(_Tokens(), plain, load_chat_template("gemma"))


def test_gemma_tools_template_refuses_bad_order():
    template = load_chat_template("gemma-tools")
    for messages in ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}],
                     [{"role": "tool", "content": "b"}]):
        with pytest.raises(ValueError, match="must follow the assistant message"):
            apply_chat_template(_Tokens(), messages, template, tools=TOOLS)
    with pytest.raises(ValueError, match="alternate"):
        apply_chat_template(_Tokens(), [{"role": "assistant", "content": "a"}], template)
    with pytest.raises(ValueError, match="only as the first message"):
        apply_chat_template(_Tokens(), [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
                            template)
