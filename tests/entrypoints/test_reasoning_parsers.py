"""Reasoning parsers (deepseek_r1, qwen3) on hand-written replies, whole and streamed split at
every character boundary, and the --reasoning-parser flag; no model."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.entrypoints.openai.api_server import make_arg_parser
from pagedllm.reasoning import REASONING_PARSERS, ReasoningStream, get_reasoning_parser

CASES = [  # (reply, reasoning, content), both parsers with thinking on
    ("<think>The user wants a name.</think>Ada.", "The user wants a name.", "Ada."),
    ("The start tag is in the prompt.</think>\n\nAnswer", "The start tag is in the prompt.", "\n\nAnswer"),
    ("  <think>x < y and </thin k></think>ok", "x < y and </thin k>", "ok"),
    ("<think>cut short while thinking", "cut short while thinking", None),
    ("no tags at all", "no tags at all", None),                 # all reasoning: cut before </think>
    ("<think></think>only content", None, "only content"),
    ("<think>only reasoning</think>", "only reasoning", None),
    ("a</think>b</think>c", "a", "b</think>c"),
    ("<thinking>not the tag</think>z", "<thinking>not the tag", "z"),
    ("", None, None),
]


def _streamed(parser, text: str, cut: int, kwargs=None):
    """(reasoning, content) joined from the reply fed as two deltas split at ``cut``, and as one
    delta per character."""
    results = []
    for pieces in ([text[:cut], text[cut:]], list(text) or [""]):
        stream = ReasoningStream(parser, kwargs)
        reasoning = content = ""
        for k, piece in enumerate(pieces):
            r, c = stream.feed(piece, final=k == len(pieces) - 1)
            reasoning, content = reasoning + r, content + c
        results.append((reasoning or None, content or None))
    return results


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text,reasoning,content", CASES)
def test_whole_and_streamed_at_every_split(name, text, reasoning, content):
    parser = get_reasoning_parser(name)
    assert parser.extract_reasoning(text) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert _streamed(parser, text, cut) == [(reasoning, content)] * 2, cut


def test_stream_sends_reasoning_as_it_comes_and_holds_a_cut_tag():
    stream = ReasoningStream(get_reasoning_parser("deepseek_r1"))
    assert stream.feed("<thi") == ("", "")            # may be the start tag
    assert stream.feed("nk>Let me") == ("Let me", "")
    assert stream.feed(" see.</th") == (" see.", "")  # "</th" held back
    assert stream.feed("ink>The") == ("", "The")
    assert stream.feed(" end.", final=True) == ("", " end.")
    stream = ReasoningStream(get_reasoning_parser("deepseek_r1"))
    assert stream.feed("<b>") == ("<b>", "")          # not the start tag: reasoning
    assert stream.feed("</", final=True) == ("</", "")


def test_qwen3_with_thinking_disabled_is_all_content():
    parser = get_reasoning_parser("qwen3")
    off = {"enable_thinking": False}
    text = "<think>x</think>y"
    assert parser.extract_reasoning(text, off) == (None, text)
    assert parser.extract_reasoning(text, {"enable_thinking": True}) == ("x", "y")
    for cut in range(len(text) + 1):
        assert _streamed(parser, text, cut, off) == [(None, text)] * 2
    # deepseek_r1 has no switch.
    assert get_reasoning_parser("deepseek_r1").extract_reasoning(text, off) == ("x", "y")


def test_bad_reasoning_parser_name_names_the_flag_and_the_choices(capsys):
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError, match=r"--reasoning-parser must be one of \['deepseek_r1', 'qwen3'\], got 'r1'"):
        get_reasoning_parser("r1")
    parser = make_arg_parser(argparse.ArgumentParser(prog="pagedllm serve"))
    assert parser.parse_args(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    for flag, bad in (("--reasoning-parser", "r1"), ("--tool-call-parser", "llama3")):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, bad])
        err = capsys.readouterr().err
        assert f"argument {flag}: invalid choice: '{bad}'" in err, err
        assert ("'deepseek_r1', 'qwen3'" if flag == "--reasoning-parser" else
                "'hermes', 'llama3_json', 'pythonic', 'xlam'") in err, err


def test_build_state_refuses_a_bad_parser_name_before_loading_the_model():
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.openai.api_server import build_state

    args = EngineArgs(model="/nonexistent/model")
    with pytest.raises(ValueError, match="--reasoning-parser must be one of"):
        build_state(args, reasoning_parser="nope")
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        build_state(args, enable_auto_tool_choice=True, tool_call_parser="nope")
