"""The vLLM-style example programs of examples/vllm_style/ (one per vLLM example family, written by
this project with vLLM's imports changed to pagedllm's and the model set to the default model) run
as a user runs them, each in its own process, and each one's output is checked: offline ones
alone, online ones against one ``pagedllm serve``. Nothing is fetched."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
EXAMPLES = Path(__file__).parents[2] / "examples" / "vllm_style"


def run_example(name: str, *args: str, timeout: float = 400) -> str:
    """stdout of ``python examples/vllm_style/<name> <args>`` (its exit status must be 0)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_basic():
    out = run_example("basic.py")
    # repr() quotes a text holding an apostrophe with double quotes
    outputs = [text for _, text in re.findall(r"^Output:    (['\"])(.*)\1$", out, re.M)]
    assert len(outputs) == 4 and all(outputs), out


def test_chat():
    out = run_example("chat.py")
    assert r"<start_of_turn>user\nYou are a helpful assistant" in out   # the system turn, Gemma's way (repr)
    assert "Batch of 3 conversations, identical replies: True" in out    # greedy: same reply each time


def test_llm_engine_example():
    out = run_example("llm_engine_example.py", "--model", "default", "--max_model_len", "512")
    finished = re.findall(r"RequestOutput\(request_id='(\d)'.*?finished=True", out)
    assert sorted(finished) == ["0", "1", "2"], out
    assert out.count("CompletionOutput(index=1") == 1   # request 2 has n=2


def test_async_llm_streaming():
    out = run_example("async_llm_streaming.py")
    assert out.count(" Done!") == 3 and out.count(" Prompt: ") == 3


def test_prefix_caching():
    out = run_example("prefix_caching.py")
    assert "Generated answers are the same: True" in out
    cached = [int(n) for n in re.findall(r"cached tokens: (\d+)", out)]
    assert len(cached) == 4 and min(cached) >= 64, out   # the shared prefix came from the cache


def test_structured_outputs_offline():
    out = run_example("structured_outputs.py")
    lines = dict(re.findall(r"^(\w+): (.*)$", out, re.M))
    assert ast.literal_eval(lines["choice"].split(" (finish")[0]) in ("Positive", "Negative")
    email = ast.literal_eval(lines["regex"].split(" (finish")[0])
    assert re.fullmatch(r"\w{1,20}@\w{1,10}\.com\n", email) or "finish_reason length" in lines["regex"]
    car = json.loads(ast.literal_eval(lines["json"].split(" (finish")[0]))
    assert set(car) == {"brand", "model", "car_type"} and car["car_type"] in ("sedan", "SUV", "Truck", "Coupe")
    sql = ast.literal_eval(lines["grammar"].split(" (finish")[0])
    assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", sql), sql


def test_logits_processor():
    out = run_example("logits_processor.py")
    ids = [ast.literal_eval(x) for x in re.findall(r"Generated token ids: (\[.*\])", out)]
    assert ids[0] == [67] * 6 and ids[2] == [42] * 6
    assert ids[1] != [67] * 6 and ids[3] != [42] * 6 and len(ids[1]) == len(ids[3]) == 6


def test_profiling(tmp_path):
    out = run_example("profiling.py", str(tmp_path / "traces"))
    traces = list((tmp_path / "traces").iterdir())
    assert len(traces) == 1 and traces[0].name.startswith("rank0") and traces[0].stat().st_size > 1000, out


@pytest.fixture(scope="module")
def server(launch_server):
    return launch_server(["serve", "--chat-template", "gemma-tools", "--max-model-len", "1024"],
                         "vllm-style-examples", module="pagedllm.entrypoints.cli")


def test_online_structured_outputs(server):
    out = run_example("openai_chat_structured_outputs.py", "--port", str(server.port))
    lines = dict(re.findall(r"^(\w+): (.*)$", out, re.M))
    assert lines["choice"] in ("positive", "negative")
    assert re.fullmatch(r"[a-z.]{1,20}@[a-z]{1,10}\.com\n", json.loads(lines["regex"])), lines["regex"]
    person = json.loads(lines["json"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert lines["parsed"].startswith("People(name=")


def test_online_tools_required(server):
    out = run_example("openai_chat_tools_required.py", "--port", str(server.port))
    calls = re.findall(r"^(required|named): get_current_weather (\{.*\})$", out, re.M)
    assert {kind for kind, _ in calls} == {"required", "named"}, out
    for _, arguments in calls:
        args = ast.literal_eval(arguments)
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")


def test_online_beam_search(server):
    out = run_example("openai_completion_beam_search.py", "--port", str(server.port))
    beams = re.findall(r"^beam (\d): '(.*)'$", out, re.M)
    assert [i for i, _ in beams] == ["0", "1", "2"] and len({t for _, t in beams}) == 3, out


def test_online_responses(server):
    out = run_example("openai_responses.py", "--port", str(server.port))
    first = re.search(r"^first: (resp_\S+) (\w+) '(.*)'$", out, re.M)
    follow = re.search(r"^follow_up: (resp_\S+) (\w+) '(.*)' input_tokens (\d+) > (\d+)$", out, re.M)
    assert first and follow, out
    assert first.group(2) in ("completed", "incomplete") and first.group(3)
    assert follow.group(1) != first.group(1) and int(follow.group(4)) > int(follow.group(5))  # the first turn came along
    stream = re.search(r"^stream: response.created response.completed '(.+)'$", out, re.M)
    assert stream, out
