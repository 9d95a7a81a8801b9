"""The llama3_json and xlam tool-call parsers on hand-written replies, whole and streamed split
at every character boundary; no model."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_parsers import ToolCallStream, get_tool_parser


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _streamed(parser_name: str, text: str, cut: int):
    """The reply fed as two deltas split at ``cut``, then as one delta per character."""
    results = []
    for pieces in ([text[:cut], text[cut:]], list(text)):
        stream = ToolCallStream(get_tool_parser(parser_name))
        content, calls = "", []
        for piece in pieces:
            c, tc = stream.feed(piece)
            content, calls = content + c, calls + tc
        c, tc = stream.finish()
        results.append((content + c, calls + tc))
    return results


LLAMA = [  # (reply, calls, content)
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}',
     [("get_weather", {"city": "Paris", "unit": "C"})], None),
    ('<|python_tag|>{"name": "f", "arguments": {"a": {"b": {"c": [1, 2]}}}}',
     [("f", {"a": {"b": {"c": [1, 2]}}})], None),
    ('{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"x": 1}} ;{"name": "h", "parameters": {"y": "a;b"}}',
     [("f", {}), ("g", {"x": 1}), ("h", {"y": "a;b"})], None),
    ('{"name": "f", "parameters": {"q": "}{"}}\n', [("f", {"q": "}{"})], None),  # trailing text dropped (vLLM)
    ("The weather is fine.", [], "The weather is fine."),
    ('Use {braces} like this.', [], "Use {braces} like this."),
    ('{"name": "f"}', [], '{"name": "f"}'),                          # neither arguments nor parameters
    ('{"name": 3, "parameters": {}}', [], '{"name": 3, "parameters": {}}'),
    ('{"name": "f", "parameters": {"a": 1}', [], '{"name": "f", "parameters": {"a": 1}'),  # cut short
]


def test_llama3_json_a_later_object_that_is_no_call_makes_the_reply_content():
    """vLLM's rule for a whole reply; a stream has sent the calls before it, as hermes does."""
    text = '{"name": "f", "parameters": {}}; {"arguments": {}}'
    result = get_tool_parser("llama3_json").extract_tool_calls(text)
    assert not result.tools_called and result.content == text
    for _, calls in _streamed("llama3_json", text, 0):
        assert _calls(calls) == [("f", {})]


def test_llama3_json_streams_each_call_when_complete_and_plain_text_at_once():
    stream = ToolCallStream(get_tool_parser("llama3_json"))
    assert stream.feed("<|python") == ("", [])
    assert stream.feed('_tag|>{"name": "f", "parameters": {"a": 1}}')[0] == ""
    assert stream.calls_sent and _calls(stream.calls_sent) == [("f", {"a": 1})]
    assert _calls(stream.feed('; {"name": "g", "parameters": {}}')[1]) == [("g", {})]
    assert stream.finish() == ("", [])
    stream = ToolCallStream(get_tool_parser("llama3_json"))
    assert stream.feed("Hello <|py") == ("Hello ", [])   # may open the tag: held back
    assert stream.feed("thon, no") == ("<|python, no", [])
    # Text before the JSON has gone out as content when the call comes (a whole reply drops it).
    assert stream.feed(' {"name": "f", "parameters": {}}')[0] == " "
    content, calls = stream.finish()
    assert content == "" and stream.tools_called


XLAM = [  # (reply, calls, content)
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]',
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})], None),
    ('I will check.\n```json\n[{"name": "f", "arguments": {"a": 1}}]\n```\nDone.',
     [("f", {"a": 1})], "I will check.\n\nDone."),
    ('```\n[{"name": "f", "arguments": {}}]\n```', [("f", {})], None),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": [1]}}]', [("f", {"a": [1]})], None),
    ('Sure <tool_call>[{"name": "f", "arguments": {}}]</tool_call>', [("f", {})], "Sure"),
    ('<think>need the weather</think>\n[{"name": "f", "arguments": {}}]', [("f", {})],
     "<think>need the weather</think>"),
    ('[{"name": "f", "arguments": "{\\"a\\": 2}"}, {"name": "g"}, 7]', [("f", {"a": 2})], None),  # bad entries skipped
    ("It is sunny [really].", [], "It is sunny [really]."),
    ('[1, 2]', [], "[1, 2]"),
    ('{"name": "f", "arguments": {}}', [], '{"name": "f", "arguments": {}}'),   # not an array
    ('See ```python\nprint(1)\n``` here', [], "See ```python\nprint(1)\n``` here"),
    ('[{"name": "f", "arguments": {}}', [], '[{"name": "f", "arguments": {}}'),  # cut short
]


@pytest.mark.parametrize("parser_name,text,calls,content",
                         [("llama3_json", *case) for case in LLAMA] + [("xlam", *case) for case in XLAM])
def test_whole_and_streamed_at_every_split(parser_name, text, calls, content):
    result = get_tool_parser(parser_name).extract_tool_calls(text)
    assert result.tools_called == bool(calls) and _calls(result.tool_calls) == calls and result.content == content
    for cut in range(len(text) + 1):
        for streamed_content, streamed_calls in _streamed(parser_name, text, cut):
            assert [c["index"] for c in streamed_calls] == list(range(len(calls)))
            assert _calls(streamed_calls) == calls and streamed_content == (content or "")


def test_xlam_streams_text_before_a_possible_call_block():
    stream = ToolCallStream(get_tool_parser("xlam"))
    assert stream.feed("I will check. ") == ("I will check.", [])   # trailing space: the parse strips it
    assert stream.feed("``") == ("", [])
    assert stream.feed('`json\n[{"name": "f", "arguments": {}}]\n```') == ("", [])   # calls go at the end
    content, calls = stream.finish()
    assert content == "" and _calls(calls) == [("f", {})]
    stream = ToolCallStream(get_tool_parser("xlam"))
    assert stream.feed("[") == ("", [])   # may be the array: held until the end
    assert stream.finish() == ("[", [])
