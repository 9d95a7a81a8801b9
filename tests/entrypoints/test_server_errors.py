"""The real server (``pagedllm serve``, subprocess) on a tiny checkpoint: every 400/401/404 case with
OpenAI's error body (lone surrogates, n over max_num_seqs, chat templates that load files or run past
their budget, unresolvable schema $refs, non-finite floats, the max_tokens rules), API keys, served
names, tokenize/detokenize, graceful shutdown."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import pytest
from error_utils import assert_error

KEY = "test-key"
MAX_MODEL_LEN = 64
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def tiny_path(make_tiny_checkpoint):
    return make_tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def server(launch_server, tiny_path):
    args = ["serve", tiny_path, "--served-model-name", "tiny", "tiny-alias",
            "--api-key", KEY, "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", "4MiB",
            "--dtype", "float32", "--max-logprobs", "5", "--block-size", "4",
            "--trust-request-chat-template"]   # test_chat_errors sends its own templates
    return launch_server(args, "tiny_server", module="pagedllm.entrypoints.cli")


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
        yield client


def completion(http: httpx.Client, **fields) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4,
                                              "temperature": 0, **fields})


def test_models_lists_each_served_name(http, server, tiny_path):
    data = http.get("/v1/models").json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == ["tiny", "tiny-alias"]
    for card in data["data"]:
        assert card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN
        assert card["root"] == tiny_path
    models = server.client(api_key=KEY).models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    # Both names serve the model.
    assert completion(http, model="tiny-alias").json()["model"] == "tiny-alias"


def test_api_key_required_on_v1_routes(server, http):
    anonymous = httpx.Client(base_url=server.url, timeout=60)
    assert_error(anonymous.get("/v1/models"), 401, "API key", code="invalid_api_key")
    assert_error(anonymous.post("/v1/completions", json={"prompt": "x"}), 401)
    wrong = anonymous.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
    assert_error(wrong, 401, "Incorrect API key", code="invalid_api_key")
    for path in ("/health", "/version", "/metrics"):
        assert anonymous.get(path).status_code == 200, path
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").completions.create(model="tiny", prompt="x", max_tokens=1)
    assert server.client(api_key=KEY).completions.create(model="tiny", prompt="x", max_tokens=1).choices


def test_unknown_model_404(server, http):
    assert_error(completion(http, model="gpt-4"), 404, "gpt-4", param="model", code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        server.client(api_key=KEY).completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert_error(http.post("/v1/chat/completions", json={"model": "nope", "messages": [
        {"role": "user", "content": "x"}]}), 404, param="model")


def test_unknown_route_404(http):
    assert_error(http.get("/v1/nothing"), 404)


@pytest.mark.parametrize("fields, fragment, param", [
    ({"temperature": -1}, "temperature", "temperature"),
    ({"top_p": 1.5}, "top_p", "top_p"),
    ({"top_p": 0}, "top_p", "top_p"),
    ({"top_k": -5}, "top_k", "top_k"),
    ({"min_p": 2}, "min_p", "min_p"),
    ({"n": 0}, "n must", "n"),
    ({"max_tokens": -3}, "max_tokens", "max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty", "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty"),
    ({"min_tokens": 10, "max_tokens": 4}, "min_tokens", "min_tokens"),
    ({"logit_bias": {"5": 200}}, "logit_bias", "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias"),
    ({"logprobs": 6}, "max_logprobs", "logprobs"),
    ({"logprobs": -1}, "logprobs", "logprobs"),
    ({"stop": [""]}, "stop", "stop"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"n": 1.5}, "n", "n"),
])
def test_invalid_sampling_values_400(http, fields, fragment, param):
    assert_error(completion(http, **fields), 400, fragment, param=param)


@pytest.mark.parametrize("fields, param", [
    ({"prompt": [1, 2, 100000]}, "prompt"),
    ({"prompt": [[5, 6], [7, -1]]}, "prompt"),
    ({"logit_bias": {"100000": 5}}, "logit_bias"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
    ({"allowed_token_ids": [5, 100000]}, "allowed_token_ids"),
])
def test_out_of_vocabulary_ids_400(http, fields, param):
    error = assert_error(completion(http, **fields), 400, "100000" if "-1" not in str(fields) else "-1")
    assert error["param"] in (param, None)


# This tokenizer adds no BOS, so "" has no token (with Gemma's, "" is [<bos>] and runs).
@pytest.mark.parametrize("prompt", ["", [], [[]], ["ok", ""], [[1, 2], []]])
def test_empty_prompt_400(http, prompt):
    assert_error(completion(http, prompt=prompt), 400, "empty", param="prompt")


def test_prompt_plus_max_tokens_over_max_model_len_400(http):
    ids = list(range(10, 40))  # 30 tokens
    error = assert_error(completion(http, prompt=ids, max_tokens=40), 400, str(MAX_MODEL_LEN), "70", "30", "40",
                         param="max_tokens", code="context_length_exceeded")
    assert "maximum context length" in error["message"]
    assert completion(http, prompt=ids, max_tokens=34).status_code == 200
    # A prompt that alone is too long gets the same code.
    assert_error(completion(http, prompt=list(range(10, 10 + MAX_MODEL_LEN + 1))), 400, str(MAX_MODEL_LEN),
                 str(MAX_MODEL_LEN + 1), param="prompt", code="context_length_exceeded")
    # A prompt that fills the context leaves no room for the default 16 tokens.
    body = {"model": "tiny", "prompt": list(range(10, 10 + MAX_MODEL_LEN))}
    assert_error(http.post("/v1/completions", json=body), 400, str(MAX_MODEL_LEN), code="context_length_exceeded")


def test_omitted_max_tokens_means_16(http):
    ids = list(range(10, 50))  # 40 tokens
    body = {"model": "tiny", "prompt": ids, "temperature": 0, "ignore_eos": True}
    data = http.post("/v1/completions", json=body).json()
    assert data["usage"] == {"prompt_tokens": 40, "completion_tokens": 16, "total_tokens": 56}
    assert data["choices"][0]["finish_reason"] == "length"
    # 16 do not fit after 50 prompt tokens: a 400, as when the client asks for 16 itself.
    body["prompt"] = list(range(10, 60))
    assert_error(http.post("/v1/completions", json=body), 400, "66", code="context_length_exceeded")


def test_malformed_json_400(http):
    response = http.post("/v1/completions", content=b'{"model": "tiny", "prompt": ',
                         headers={"Content-Type": "application/json"})
    assert_error(response, 400, "Malformed JSON")
    assert_error(http.post("/v1/completions", json={"model": "tiny"}), 400, "prompt", param="prompt")
    assert_error(http.post("/v1/completions", json=["not", "an", "object"]), 400)
    assert_error(http.post("/v1/chat/completions", content=b"nope", headers={"Content-Type": "application/json"}),
                 400, "Malformed JSON")


def test_invalid_stream_gets_400_before_any_event(http):
    body = {"model": "tiny", "prompt": "x", "stream": True, "temperature": -2}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 400
        assert response.headers["content-type"].startswith("application/json")
        text = response.read().decode()
    assert "data:" not in text and "temperature" in text
    chat = {"model": "tiny", "messages": [], "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=chat) as response:
        assert response.status_code == 400
        assert "data:" not in response.read().decode()


def test_best_of_and_suffix_rules(http):
    assert_error(completion(http, best_of=3, stream=True), 400, "stream", param="best_of")
    assert_error(completion(http, best_of=1, n=2), 400, "best_of", param="best_of")
    assert_error(completion(http, suffix="the end"), 400, "suffix", param="suffix")
    assert_error(completion(http, stream_options={"include_usage": True}), 400, param="stream_options")
    data = completion(http, best_of=3, n=2, temperature=1.0, seed=1).json()
    assert [c["index"] for c in data["choices"]] == [0, 1]


def test_chat_errors(http):
    messages = [{"role": "user", "content": "hi"}]
    chat = lambda **f: http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, **f})
    # The tiny model has no chat template and the server was started without --chat-template.
    assert_error(chat(), 400, "no chat template", "--chat-template")
    assert_error(chat(messages=[]), 400, "empty", param="messages")
    assert_error(chat(logprobs=True, top_logprobs=6), 400, "top_logprobs", param="top_logprobs")
    assert_error(chat(top_logprobs=2), 400, "logprobs", param="top_logprobs")
    assert_error(chat(temperature=-1, chat_template="{{ messages[0]['content'] }}"), 400, "temperature")
    assert_error(chat(messages=[{"role": "user", "content": "hi"}], chat_template="{{ raise_exception('nope') }}"),
                 400, "nope")
    assert_error(chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, param="tools")
    ok = chat(chat_template="{{ messages[0]['content'] }}", max_tokens=2, temperature=0)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert ok.json()["usage"]["prompt_tokens"] == len(http.post("/tokenize", json={
        "prompt": "hi", "add_special_tokens": False}).json()["tokens"])


def test_openai_client_sees_400_bodies(server):
    client = server.client(api_key=KEY)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", temperature=-1, max_tokens=2)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True, extra_body={"top_p": 7})


def test_tokenize_and_detokenize(http):
    data = http.post("/tokenize", json={"prompt": "The quick brown fox", "return_token_strs": True}).json()
    assert data["count"] == len(data["tokens"]) == len(data["token_strs"]) and data["max_model_len"] == MAX_MODEL_LEN
    back = http.post("/detokenize", json={"tokens": data["tokens"]}).json()
    assert back["prompt"].endswith("The quick brown fox")
    assert_error(http.post("/detokenize", json={"tokens": [1, 100000]}), 400, "100000", param="tokens")
    assert_error(http.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404)
    assert_error(http.post("/tokenize", json={}), 400)


def raw(http: httpx.Client, path: str, body: str) -> httpx.Response:
    """POST a JSON text as is (NaN, Infinity and lone-surrogate escapes that json.dumps of a
    client would refuse or re-encode)."""
    return http.post(path, content=body.encode(), headers={"Content-Type": "application/json"})


CHAT_TEMPLATE = "{{ messages[0]['content'] }}"


@pytest.mark.parametrize("path, body, param, where", [
    ("/v1/completions", '{"model": "tiny", "prompt": "ab\\ud800c", "max_tokens": 2}', "prompt", "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt", "prompt[1]"),
    ("/v1/completions", '{"model": "tiny", "prompt": "ok", "stop": ["\\ud800"], "max_tokens": 2}', "stop", "stop[0]"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "ab\\ud800c"}]}',
     "messages", "messages[0].content"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
                             '"text": "\\ud800"}]}]}', "messages", "messages[0].content[0].text"),
    ("/tokenize", '{"prompt": "ab\\ud800c"}', "prompt", "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages", "messages[0].content"),
])
def test_lone_surrogate_is_400_naming_the_field(http, path, body, param, where):
    """JSON can carry a lone UTF-16 surrogate (an escape a client can send); it is no Unicode text
    and the tokenizer refused it with a TypeError (a 500)."""
    assert_error(raw(http, path, body), 400, f"{where} holds a lone UTF-16 surrogate", param=param)
    assert completion(http).status_code == 200   # the server serves on


def test_n_and_best_of_above_max_num_seqs_are_400(http):
    """--max-n defaults to min(128, --max-num-seqs) (64 here): a request's samples run as one
    group in one step, so more than max_num_seqs could never be scheduled (it was a 500)."""
    for fields, param, fragments in (({"n": 65, "temperature": 1}, "n", ("must be <= 64", "--max-num-seqs")),
                                     ({"best_of": 65, "temperature": 1}, "best_of", ("must be <= 64",)),
                                     ({"n": 65, "use_beam_search": True}, "n", ("beam width", "max_num_seqs (64)"))):
        assert_error(completion(http, **fields), 400, *fragments, param=param)
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                   "chat_template": CHAT_TEMPLATE, "n": 65, "temperature": 1})
    assert_error(chat, 400, "must be <= 64", param="n")
    ok = completion(http, n=3, best_of=4, temperature=1, seed=1)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 3


@pytest.mark.parametrize("template, fragments", [
    ("{% include 'other.jinja' %}", ["{% include %}", "self-contained"]),
    ("{% import 'macros.jinja' as m %}{{ m.x() }}", ["{% import %}"]),
    ("{% from 'macros.jinja' import x %}{{ x() }}", ["{% from ... import %}"]),
    ("{% extends 'base.jinja' %}", ["{% extends %}"]),
    ("{% for %}", ["does not parse"]),
    ("{% for i in range(1000000) %}x{% endfor %}", ["OverflowError", "MAX_RANGE"]),
    ("{{ 1 // 0 }}", ["ZeroDivisionError"]),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", ["more than 10000000 steps"]),
    ("{% for i in range(9999) %}{{ 'x' * 99999 }}{% endfor %}", ["more than 67108864 characters"]),
])
def test_bad_or_unbounded_chat_template_is_400_naming_chat_template(http, template, fragments):
    """A request's template (served here with --trust-request-chat-template) that loads other
    files, fails, or runs past the render budget (steps, output) is a 400 naming chat_template;
    the nested loop (~10^10 steps unbounded) stops at the step budget."""
    messages = [{"role": "user", "content": "hi"}]
    for path, extra in (("/v1/chat/completions", {"model": "tiny", "max_tokens": 2}), ("/tokenize", {})):
        response = http.post(path, json={"messages": messages, "chat_template": template, **extra})
        assert_error(response, 400, *fragments, param="chat_template")
    assert completion(http).status_code == 200


SCHEMA_MISSING_DEF = {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}


@pytest.mark.parametrize("path, fields, param, fragment", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA_MISSING_DEF}}}, "response_format",
     "response_format: the $ref '#/$defs/Missing' at #/properties/a cannot"),
    ("/v1/completions", {"guided_json": {"$ref": "https://example.com/schema.json"}}, "guided_json",
     "remote and file references are not fetched"),
    ("/v1/completions", {"structured_outputs": {"json": {"items": {"$ref": "#/definitions/Gone"}}}},
     "structured_outputs", "structured_outputs.json: the $ref '#/definitions/Gone' at #/items cannot"),
    ("/v1/chat/completions", {"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": SCHEMA_MISSING_DEF}}]}, "tools", "tools[0].function.parameters: the $ref"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "f"}}, "tools": [{
        "type": "function", "function": {"name": "f", "parameters": SCHEMA_MISSING_DEF}}]}, "tools", "'#/$defs/Missing'"),
])
def test_unresolvable_schema_ref_is_400(http, path, fields, param, fragment):
    """A $ref that does not resolve inside the schema was accepted and left that part of the
    output unconstrained (xgrammar warns and goes on): now a 400 naming the field."""
    body = {"model": "tiny", "max_tokens": 4, **fields}
    body.update({"messages": [{"role": "user", "content": "hi"}], "chat_template": CHAT_TEMPLATE}
                if path.startswith("/v1/chat") else {"prompt": "hi"})
    assert_error(http.post(path, json=body), 400, fragment, param=param)


def test_tool_parameters_with_their_own_defs_are_constrained(http):
    """A tool whose parameters use ``$defs`` (e.g. from pydantic's model_json_schema) keeps its
    references under tool_choice "required" (they are re-rooted in the combined schema): the reply
    is a call of that tool whose argument follows the referenced definition."""
    params = {"type": "object", "$defs": {"Small": {"type": "integer", "minimum": 0, "maximum": 9}},
              "properties": {"x": {"$ref": "#/$defs/Small"}}, "required": ["x"], "additionalProperties": False}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "chat_template": CHAT_TEMPLATE,
            "max_tokens": 40, "temperature": 0, "tool_choice": "required", "parallel_tool_calls": False,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}]}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    content = choice["message"].get("content") or ""
    calls = choice["message"].get("tool_calls") or []
    assert choice["finish_reason"] == "tool_calls" and len(calls) == 1, choice
    assert calls[0]["function"]["name"] == "f"
    assert json.loads(calls[0]["function"]["arguments"])["x"] in range(10)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty", "length_penalty"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_sampling_floats_are_400(http, field, value):
    beam = ', "use_beam_search": true, "n": 2' if field == "length_penalty" else ""
    body = f'{{"model": "tiny", "prompt": "hi", "max_tokens": 2, "{field}": {value}{beam}}}'
    assert_error(raw(http, "/v1/completions", body), 400, param=field)


def test_max_tokens_rules_follow_vllm_and_name_the_field(http):
    """max_tokens / max_completion_tokens below 1 is a 400 with vLLM's message, naming the field
    the request used; 0 with echo is the prompt only (vLLM's echo without generation)."""
    assert_error(completion(http, max_tokens=0), 400, "max_tokens must be at least 1, got 0", param="max_tokens")
    assert_error(completion(http, max_tokens=None, max_completion_tokens=-2), 400,
                 "max_completion_tokens must be at least 1, got -2", param="max_completion_tokens")
    assert_error(completion(http, max_tokens=None, max_completion_tokens=MAX_MODEL_LEN), 400,
                 f"maximum context length is {MAX_MODEL_LEN}", param="max_completion_tokens",
                 code="context_length_exceeded")
    messages = [{"role": "user", "content": "hi"}]
    chat = lambda **f: http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages,
                                                               "chat_template": CHAT_TEMPLATE, **f})
    assert_error(chat(max_completion_tokens=0), 400, "max_completion_tokens must be at least 1",
                 param="max_completion_tokens")
    assert_error(chat(max_tokens=0), 400, "max_tokens must be at least 1", param="max_tokens")
    assert_error(chat(max_completion_tokens=10 * MAX_MODEL_LEN), 400, param="max_completion_tokens",
                 code="context_length_exceeded")
    echo = completion(http, max_tokens=0, echo=True, logprobs=1).json()
    assert echo["choices"][0]["text"] == "The quick brown fox"
    assert echo["usage"]["completion_tokens"] == 0 and echo["choices"][0]["finish_reason"] == "length"
    assert echo["choices"][0]["logprobs"]["token_logprobs"][0] is None


def test_sigterm_exits_cleanly(server):
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_to_the_whole_process_group_exits_cleanly(launch_server, tiny_path, sig):
    """Ctrl-C in a terminal, ``timeout`` or ``kill -- -PGID`` signal the server and its engine-core
    process together: the engine process ignores it and is stopped in order by the server, which
    exits with status 0 without reporting a dead engine, and leaves no process behind."""
    server = launch_server(["serve", tiny_path, "--max-model-len", "128", "--kv-cache-memory-bytes", "4MiB",
                            "--dtype", "float32"], f"group_{sig.name}", module="pagedllm.entrypoints.cli",
                           start_new_session=True)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        out = client.post("/v1/completions", json={"model": tiny_path, "prompt": "The quick", "max_tokens": 4})
        assert out.status_code == 200, out.text
    pgid = server.proc.pid
    os.killpg(pgid, sig)
    assert server.proc.wait(60) == 0, server.log_tail()
    log = server.log_tail(200)
    assert "died" not in log and "engine is dead" not in log, log
    deadline = time.monotonic() + 30
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(pgid), "a process of the server's group outlived it"


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is left in process group ``pgid``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def test_a_stream_still_running_at_the_shutdown_timeout_ends_with_an_error_event(launch_server, tiny_path):
    """SIGINT with ``--shutdown-timeout 0.05`` while a long stream runs (500 tokens: ~0.4 s offline on
    the tiny model, more through the server): after 0.05 s the stream gets an
    OpenAI error body (the server is shutting down) and ``[DONE]``, not a dropped connection,
    and the server exits with status 0."""
    import json
    import time

    server = launch_server(["serve", tiny_path, "--max-model-len", "512", "--kv-cache-memory-bytes", "16MiB",
                            "--dtype", "float32", "--block-size", "16", "--shutdown-timeout", "0.05"],
                           "shutdown_timeout_server", module="pagedllm.entrypoints.cli")
    body = {"model": tiny_path, "prompt": "The quick brown fox", "max_tokens": 500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events = []
    with httpx.Client(base_url=server.url, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for line in lines:                      # the first token: the request is running
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    break
            signalled = time.monotonic()
            server.proc.send_signal(signal.SIGINT)
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "shutting down" in error["message"], error
    assert len(events) >= 3                         # the first token, the error, [DONE]
    assert time.monotonic() - signalled < 30
    assert server.proc.wait(60) == 0
