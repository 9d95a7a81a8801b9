"""``{"type": "mcp"}`` tools in ``/v1/responses`` against a real ``FastMCP`` server (the repo's
demo server, a subprocess on a free port: ``python``, ``search``, ``open``, ``find``), with the
real ``openai`` client on a tiny random Llama and the hermes parser. A random model writes no
``<tool_call>`` by chance, so the first round's reply is forced with a regex (the test wraps
``generate_round``); later rounds are free, and their prompts are checked for the tool's result."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.chat_utils import load_chat_template
from pagedllm.entrypoints.openai.api_server import build_state
from pagedllm.entrypoints.openai.mcp_client import McpServer, list_tools, transport_urls
from pagedllm.entrypoints.openai.mcp_tools import McpLimits
from asgi_utils import run_with_clients
from conftest import free_port

pytest.importorskip("mcp")
pytestmark = pytest.mark.timeout(600)
DEMO = Path(__file__).resolve().parents[2] / "tools" / "vllm_examples" / "demo_mcp_server.py"
ALL = ["python", "search", "open", "find"]


def _start_demo(transport: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(DEMO), "--port", str(port), "--transport", transport],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the demo MCP server did not start")


@pytest.fixture(scope="module")
def mcp_url():
    proc, url = _start_demo("streamable-http")
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def state(long_checkpoint):
    args = EngineArgs(model=long_checkpoint, dtype="float32", max_model_len=4096, block_size=4,
                      kv_cache_memory_bytes=64 << 20, seed=0)
    st = build_state(args, ["tiny"], chat_template=load_chat_template("gemma-tools"), log_requests=False,
                     log_stats_interval_s=None, enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield st
    st.engine.shutdown()


def _force_first_round(monkeypatch, state, name: str, arguments: dict, every_round: bool = False) -> list[dict]:
    """Force the first reply (or each) to be a hermes call of ``name``; returns the rendered
    prompts of all rounds (``prompt``, ``prompt_token_ids``)."""
    prompts: list[dict] = []
    generate, render = state.responses.generate_round, state.chat.render
    call = json.dumps({"name": name, "arguments": arguments}).replace("{", r"\{").replace("}", r"\}")
    call = call.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")

    def render_and_keep(chat):
        prompt = render(chat)
        prompts.append(prompt)
        return prompt

    async def forced(request, chat, *args):
        if not prompts or every_round:
            chat = chat.model_copy(update={"structured_outputs": {"regex": f"<tool_call>\n{call}\n</tool_call>"}})
        return await generate(request, chat, *args)
    monkeypatch.setattr(state.responses, "generate_round", forced)
    monkeypatch.setattr(state.chat, "render", render_and_keep)
    return prompts


def _create(client, url, **kwargs):
    tool = {"type": "mcp", "server_label": "demo", "server_url": url, **kwargs.pop("tool", {})}
    return client.responses.create(model="tiny", input="Search for machine learning", tools=[tool],
                                   max_output_tokens=kwargs.pop("max_output_tokens", 4), temperature=0, **kwargs)


@pytest.mark.parametrize("allowed, names", [
    (None, ALL), (["*"], ALL), (["search"], ["search"]),
    ({"tool_names": ["search", "open"], "read_only": False}, ["search", "open"])])
def test_list_tools_item_holds_the_allowed_tools(state, mcp_url, allowed, names):
    tool = {} if allowed is None else {"allowed_tools": allowed}
    response = run_with_clients(state, lambda client, http: _create(client, mcp_url, tool=tool))
    listed = response.output[0]
    assert listed.type == "mcp_list_tools" and listed.server_label == "demo" and listed.id.startswith("mcpl_")
    assert [t.name for t in listed.tools] == names
    assert listed.tools[0].input_schema["properties"] and listed.error is None
    assert response.status in ("completed", "incomplete") and response.output[-1].type == "message"


def test_model_call_runs_on_the_server_and_the_next_round_sees_it(state, mcp_url, monkeypatch):
    prompts = _force_first_round(monkeypatch, state, "search", {"query": "machine learning"})
    response = run_with_clients(state, lambda client, http: _create(client, mcp_url, max_output_tokens=120))
    types = [item.type for item in response.output]
    assert types[0] == "mcp_list_tools" and types[1] == "mcp_call" and types[-1] == "message", types
    call = response.output[1]
    assert (call.name, json.loads(call.arguments), call.server_label) == ("search", {"query": "machine learning"},
                                                                          "demo")
    assert call.output == "[2] Machine learning" and call.error is None and call.status == "completed"
    assert len(prompts) == 2 and "[2] Machine learning" not in prompts[0]["prompt"]
    assert '"query": "machine learning"' in prompts[1]["prompt"] and "[2] Machine learning" in prompts[1]["prompt"]
    assert response.usage.input_tokens == sum(len(p["prompt_token_ids"]) for p in prompts)   # both rounds


def test_disallowed_tool_call_is_an_error_item(state, mcp_url, monkeypatch):
    _force_first_round(monkeypatch, state, "open", {"id": "2"})
    response = run_with_clients(state, lambda client, http: _create(client, mcp_url, tool={
        "allowed_tools": ["search"]}, max_output_tokens=120))
    call = next(item for item in response.output if item.type == "mcp_call")
    assert call.name == "open" and call.output is None and call.status == "failed"
    assert call.error.type == "mcp_protocol_error" and "allowed tools" in call.error.message
    assert response.output[-1].type == "message"


def test_rounds_are_bounded(state, mcp_url, monkeypatch):
    prompts = _force_first_round(monkeypatch, state, "find", {"pattern": "protocol"}, every_round=True)
    monkeypatch.setattr(state.responses, "mcp_limits", McpLimits(max_rounds=3))
    response = run_with_clients(state, lambda client, http: _create(client, mcp_url, max_output_tokens=120))
    calls = [item for item in response.output if item.type != "mcp_list_tools"]
    assert [(c.type, c.output) for c in calls] == [("mcp_call", "3")] * 3 and len(prompts) == 3
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("tool, fragment", [
    ({"type": "mcp", "server_label": "a"}, "needs a 'server_url'"),
    ({"type": "mcp", "server_url": "http://h:1"}, "needs a string 'server_label'"),
    ({"type": "mcp", "server_label": "a", "server_url": "ftp://h"}, "http(s) URL"),
    ({"type": "mcp", "server_label": "a", "server_url": "http://h:1", "allowed_tools": "search"}, "list of tool names"),
    ({"type": "mcp", "server_label": "a", "server_url": "http://h:1", "headers": {"x": 1}}, "map names to strings")])
def test_bad_mcp_tools_are_400s(tool, fragment):
    from pagedllm.entrypoints.openai.errors import OpenAIError
    from pagedllm.entrypoints.openai.mcp_tools import parse_mcp_tools
    with pytest.raises(OpenAIError) as e:
        parse_mcp_tools([tool], McpLimits())
    assert e.value.status_code == 400 and e.value.param == "tools" and fragment in e.value.message
    with pytest.raises(OpenAIError, match="used twice"):
        parse_mcp_tools([{"type": "mcp", "server_label": "a", "server_url": "http://h:1"}] * 2, McpLimits())


def test_unreachable_server_is_a_424(state):
    async def fn(client, http):
        with pytest.raises(openai.APIStatusError) as e:
            await _create(client, f"http://127.0.0.1:{free_port()}")
        return e.value
    error = run_with_clients(state, fn)
    assert error.status_code == 424 and "MCP server: 'demo'" in error.message and "ConnectError" in error.message


def test_approval_is_a_400(state, mcp_url):
    async def fn(client, http):
        with pytest.raises(openai.BadRequestError) as e:
            await _create(client, mcp_url, tool={"require_approval": "always"})
        return e.value
    approval = run_with_clients(state, fn)
    assert "no approval flow" in approval.message and approval.body["param"] == "tools"


def test_stream_sends_the_mcp_events(state, mcp_url, monkeypatch):
    _force_first_round(monkeypatch, state, "search", {"query": "machine learning"})

    async def fn(client, http):
        stream = await _create(client, mcp_url, max_output_tokens=120, stream=True)
        return [event async for event in stream]
    events = run_with_clients(state, fn)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds[2:6] == ["response.output_item.added", "response.mcp_list_tools.in_progress",
                          "response.mcp_list_tools.completed", "response.output_item.done"]
    assert kinds[6:12] == ["response.output_item.added", "response.mcp_call_arguments.delta",
                           "response.mcp_call_arguments.done", "response.mcp_call.in_progress",
                           "response.mcp_call.completed", "response.output_item.done"]
    final = events[-1].response
    call = final.output[1]
    assert call.type == "mcp_call" and call.output == "[2] Machine learning" and final.output[-1].type == "message"
    assert events[11].item.id == events[6].item.id == events[10].item_id == call.id
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done == [item.type for item in final.output]


def test_missing_extra_is_a_400_naming_it(state, mcp_url, monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)   # `import mcp` now raises ImportError
    async def fn(client, http):
        with pytest.raises(openai.BadRequestError) as e:
            await _create(client, mcp_url)
        return e.value
    error = run_with_clients(state, fn)
    assert "pip install 'pagedllm[mcp]'" in error.message


def test_transports_tried_in_order_and_sse_fallback():
    assert transport_urls("http://h:1") == [("streamable_http", "http://h:1/mcp"), ("sse", "http://h:1/sse")]
    assert transport_urls("http://h:1/sse") == [("sse", "http://h:1/sse")]
    assert transport_urls("http://h:1/x/") == [("streamable_http", "http://h:1/x"), ("sse", "http://h:1/x")]
    import asyncio
    proc, url = _start_demo("sse")
    try:
        tools = asyncio.run(list_tools(McpServer("demo", url, timeout_s=20)))
    finally:
        proc.terminate()
        proc.wait(10)
    assert [t.name for t in tools] == ALL


def test_pagedllm_serve_with_an_mcp_tool(launch_server, long_checkpoint, mcp_url):
    server = launch_server(["serve", long_checkpoint, "--served-model-name", "tiny", "--dtype", "float32",
                            "--max-model-len", "4096", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                            "--chat-template", "gemma-tools"], module="pagedllm.entrypoints.cli")
    response = server.client().responses.create(
        model="tiny", input="Search for machine learning", max_output_tokens=4, temperature=0,
        tools=[{"type": "mcp", "server_label": "web_search_preview", "server_url": mcp_url,
                "allowed_tools": ["search"]}])
    assert response.output[0].type == "mcp_list_tools" and [t.name for t in response.output[0].tools] == ["search"]
    assert response.status in ("completed", "incomplete")
