"""OpenAI / vLLM conformance of the server, in-process (httpx ASGI transport, the official openai
client) on a tiny random Llama whose tokenizer adds a BOS: prompts ending inside a character,
byte tokens in logprobs, echo (with max_tokens 0, special tokens, streaming, n > 1), the
completions max_tokens default, continuous usage stats, chat echo, refused and unknown fields,
the n cap, the empty prompt, prompts over max_model_len, and /metrics without *_created."""

from __future__ import annotations

import logging
import shutil

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.chat_utils import load_chat_template
from pagedllm.entrypoints.openai.api_server import build_state
from pagedllm.entrypoints.openai.serving_engine import readable_token
from pagedllm.tokenizer import _byte_level_decoding_table
from asgi_utils import run_with_clients

MAX_MODEL_LEN = 128
MAX_N = 8
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def bos_checkpoint(make_tiny_checkpoint, tmp_path_factory):
    """The tiny Llama with a tokenizer that adds ``<bos>`` (as Gemma's does)."""
    from tokenizers import Tokenizer, processors

    folder = tmp_path_factory.mktemp("tiny_llama_bos")
    shutil.copytree(make_tiny_checkpoint("llama"), folder, dirs_exist_ok=True)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", bos)])
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


@pytest.fixture(scope="module")
def state(bos_checkpoint):
    args = EngineArgs(model=bos_checkpoint, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=4,
                      kv_cache_memory_bytes=4 << 20, seed=0, max_logprobs=5)
    st = build_state(args, ["tiny"], chat_template=load_chat_template("gemma"), log_requests=False,
                     log_stats_interval_s=None, max_n=MAX_N)
    yield st
    st.engine.shutdown()


@pytest.fixture(scope="module")
def tok(state):
    return state.engine.tokenizer


run = run_with_clients


def byte_ids(tok, data: bytes) -> list[int]:
    """The byte-level tokens of ``data``, one per byte."""
    char_of = {b: c for c, b in _byte_level_decoding_table().items()}
    return [tok.backend.token_to_id(char_of[b]) for b in data]


def token_to_bytes(token: str) -> bytes:
    """Invert the logprob token string: ``bytes:\\xNN...`` or plain text."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:"):].split("\\x")[1:])
    return token.encode()


def assert_offsets_fit(text: str, lp, special: set[str]) -> None:
    """``text_offset`` is where each token's text starts in ``text``; a token the text does not hold
    (an added BOS, part of a character) shares the next token's offset."""
    assert len(lp.tokens) == len(lp.text_offset) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(0 <= o <= len(text) for o in lp.text_offset)
    for token, offset in zip(lp.tokens, lp.text_offset):
        if not token.startswith("bytes:") and not (token in special and not text.startswith(token, offset)):
            assert text.startswith(token, offset), (token, offset, text)


# -- 1. prompts ending inside a character ---------------------------------------------------------

def test_prompt_ending_inside_a_character(state, tok):
    head = tok.encode("Hello world")  # <bos> Hello world
    euro = byte_ids(tok, "€".encode())
    prompt = head + euro[:2]
    the = tok.encode(" the", add_special_tokens=False)[:1]
    done = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "extra_body": {"allowed_token_ids": euro[2:]}}

    async def calls(client, http):
        plain = await client.completions.create(**done)
        streamed = [c async for c in await client.completions.create(**done, stream=True)]
        echo = await client.completions.create(**done, echo=True, logprobs=1)
        echo_streamed = [c async for c in await client.completions.create(**done, echo=True, stream=True)]
        other = await client.completions.create(**{**done, "extra_body": {"allowed_token_ids": the}}, echo=True)
        return plain, streamed, echo, echo_streamed, other

    plain, streamed, echo, echo_streamed, other = run(state, calls)
    assert plain.choices[0].text == "€" and plain.usage.completion_tokens == 1
    assert "".join(c.choices[0].text for c in streamed) == "€"
    whole = tok.decode(prompt + euro[2:], skip_special_tokens=False)
    assert whole == "<bos>Hello world€"
    assert echo.choices[0].text == whole
    assert "".join(c.choices[0].text for c in echo_streamed) == whole
    lp = echo.choices[0].logprobs
    assert lp.tokens[-3:] == ["bytes:\\xe2", "bytes:\\x82", "bytes:\\xac"]
    assert lp.text_offset[-3:] == [len("<bos>Hello world")] * 3
    assert_offsets_fit(whole, lp, {"<bos>"})
    # A generated token that does not complete the prompt's character: its bytes are dropped.
    assert other.choices[0].text == "<bos>Hello world" + tok.decode(the)


# -- 2. byte tokens in logprobs -------------------------------------------------------------------

def test_logprob_tokens_name_their_bytes(state, tok):
    euro = byte_ids(tok, "€".encode())
    allowed = euro + tok.encode("a", add_special_tokens=False)

    async def calls(client, http):
        chats, completions = [], []
        for seed in range(6):
            common = dict(model="tiny", max_tokens=6, temperature=1.0, seed=seed,
                          extra_body={"allowed_token_ids": allowed})
            chats.append(await client.chat.completions.create(
                messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3, **common))
            completions.append(await client.completions.create(prompt="Hello", logprobs=3, **common))
        return chats, completions

    chats, completions = run(state, calls)
    seen = set()
    for chat in chats:
        choice = chat.choices[0]
        content = choice.logprobs.content
        assert len(content) == chat.usage.completion_tokens
        for item in [*content, *(t for c in content for t in c.top_logprobs)]:
            assert item.token == readable_token(bytes(item.bytes))
            seen.add(item.token)
        joined = b"".join(bytes(item.bytes) for item in content)
        assert joined.decode("utf-8", errors="replace").rstrip("\ufffd") == choice.message.content
    for completion in completions:
        choice = completion.choices[0]
        joined = b"".join(token_to_bytes(t) for t in choice.logprobs.tokens)
        assert joined.decode("utf-8", errors="replace").rstrip("\ufffd") == choice.text
        for top in choice.logprobs.top_logprobs:
            seen.update(top)
    assert {"bytes:\\xe2", "bytes:\\x82", "bytes:\\xac", "a"} <= seen


def test_logprob_formatting_of_a_split_character(state, tok):
    from pagedllm.outputs import Logprob

    ids = tok.encode("a", add_special_tokens=False) + byte_ids(tok, "€".encode()) + \
        tok.encode(" b", add_special_tokens=False)
    entries = [{t: Logprob(-0.5, 1)} for t in ids]
    content = state.chat.chat_logprobs(ids, entries, 0)
    assert [c.token for c in content] == ["a", "bytes:\\xe2", "bytes:\\x82", "bytes:\\xac", " b"]
    assert b"".join(bytes(c.bytes) for c in content) == "a€ b".encode()


# -- 3. echo ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_echo_max_tokens_zero_returns_prompt_and_its_logprobs(state, tok, stream):
    prompt = "Your answer: Yes"
    n_prompt = len(tok.encode(prompt))

    async def call(client, http):
        kwargs = dict(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
        if not stream:
            return [await client.completions.create(**kwargs)]
        return [c async for c in await client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True})]

    chunks = run(state, call)
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (n_prompt, 0)
    choices = [c.choices[0] for c in chunks if c.choices]
    assert len(choices) == 1
    choice = choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt and lp.tokens[0] == "<bos>"
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[1:]) == prompt
    assert_offsets_fit(prompt, lp, {"<bos>"})


@pytest.mark.parametrize("prompt_kind", ["text", "text_without_special", "ids"])
@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_fields_agree_with_text(state, tok, prompt_kind, max_tokens):
    text = "The quick brown fox"
    prompt = tok.encode(text) if prompt_kind == "ids" else text
    extra = {"add_special_tokens": False} if prompt_kind == "text_without_special" else {}
    n_prompt = len(tok.encode(text, add_special_tokens=prompt_kind != "text_without_special"))
    echoed = "<bos>" + text if prompt_kind == "ids" else text
    kwargs = dict(model="tiny", prompt=[prompt, prompt], max_tokens=max_tokens, echo=True, logprobs=2,
                  temperature=1.0, seed=3, n=2, extra_body={**extra, "ignore_eos": True})

    async def calls(client, http):
        whole = await client.completions.create(**kwargs)
        streamed = [c async for c in await client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True})]
        return whole, streamed

    whole, streamed = run(state, calls)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert whole.usage.prompt_tokens == 2 * n_prompt and whole.usage.completion_tokens == 4 * max_tokens
    assert streamed[-1].usage.model_dump() == whole.usage.model_dump()
    for choice in whole.choices:
        assert choice.text.startswith(echoed)
        lp = choice.logprobs
        assert len(lp.tokens) == n_prompt + max_tokens
        assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
        assert_offsets_fit(choice.text, lp, {"<bos>"})
        generated = lp.tokens[n_prompt:]
        if not any(t.startswith("bytes:") for t in generated):
            assert "".join(generated) == choice.text[len(echoed):]
            assert lp.text_offset[n_prompt:] == [len(echoed) + len("".join(generated[:i]))
                                                 for i in range(max_tokens)]
    # Streamed choices (same seeds) carry the same text and logprobs, chunk by chunk.
    for choice in whole.choices:
        parts = [c.choices[0] for c in streamed if c.choices and c.choices[0].index == choice.index]
        assert "".join(p.text for p in parts) == choice.text
        assert sum((p.logprobs.tokens for p in parts), []) == choice.logprobs.tokens
        assert sum((p.logprobs.text_offset for p in parts), []) == choice.logprobs.text_offset
        assert sum((p.logprobs.token_logprobs for p in parts), []) == pytest.approx(choice.logprobs.token_logprobs)


# -- 4. completions default max_tokens; 5. continuous usage stats ----------------------------------

def test_completion_max_tokens_defaults_to_16_chat_to_the_context(state, tok):
    async def calls(client, http):
        completion = await client.completions.create(model="tiny", prompt="Hi", temperature=0,
                                                     extra_body={"ignore_eos": True})
        chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                    temperature=0, extra_body={"ignore_eos": True})
        return completion, chat

    completion, chat = run(state, calls)
    assert completion.usage.completion_tokens == 16 and completion.choices[0].finish_reason == "length"
    assert chat.usage.total_tokens == MAX_MODEL_LEN


def test_continuous_usage_stats(state):
    options = {"include_usage": True, "continuous_usage_stats": True}

    async def calls(client, http):
        completion = [c async for c in await client.completions.create(
            model="tiny", prompt=["Hello there", "The quick"], max_tokens=4, n=2, temperature=1.0, seed=1,
            logprobs=0, stream=True, stream_options=options, extra_body={"ignore_eos": True})]
        chat = [c async for c in await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, logprobs=True,
            stream=True, stream_options=options, extra_body={"ignore_eos": True})]
        return completion, chat

    completion, chat = run(state, calls)
    for chunks, total in ((completion, 16), (chat, 5)):
        assert all(c.usage is not None for c in chunks)
        prompt_tokens = chunks[-1].usage.prompt_tokens
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == total
        running = 0
        for c in chunks[:-1]:
            # Every token comes with its logprob entry: count them as they arrive.
            logprobs = c.choices[0].logprobs
            if logprobs is not None:
                running += len(logprobs.tokens) if chunks is completion else len(logprobs.content)
            assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == \
                (prompt_tokens, running, prompt_tokens + running)
        assert running == total


# -- 6. chat echo, refused and unknown fields -------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_with_continue_final_message(state, stream):
    start = "An apple a day keeps"
    messages = [{"role": "user", "content": "Finish the saying."}, {"role": "assistant", "content": start}]
    common = dict(model="tiny", messages=messages, max_tokens=5, temperature=0)
    cont = {"add_generation_prompt": False, "continue_final_message": True}

    async def calls(client, http):
        async def content(**kwargs):
            kwargs = {**common, **kwargs}
            if not stream:
                return (await client.chat.completions.create(**kwargs)).choices[0].message.content
            chunks = [c async for c in await client.chat.completions.create(**kwargs, stream=True)]
            return "".join(c.choices[0].delta.content or "" for c in chunks)
        return (await content(extra_body={**cont, "echo": True}), await content(extra_body=cont),
                await content(extra_body={"echo": True}),
                await content(messages=messages[:1], extra_body={"echo": True}))

    echoed, plain, with_prompt, last_is_user = run(state, calls)
    assert echoed == start + plain and plain
    # With a generation prompt the reply's role is the assistant's: the assistant message is echoed.
    assert with_prompt.startswith(start)
    # The last message is the user's, not the reply's role: nothing is echoed.
    assert not last_is_user.startswith("Finish the saying.")


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("field, value", [
    # (structured output fields work now: tests/entrypoints/test_structured_output_server.py;
    # use_beam_search: tests/entrypoints/test_server_beam_search.py; guided_decoding_backend:
    # test_structured_output_server.py)
    ("guided_whitespace_pattern", r"\s*"),
    ("length_penalty", 0.5), ("priority", 1),
    ("truncate_prompt_tokens", 3), ("return_tokens_as_token_ids", True), ("logits_processors", ["x"]),
])
def test_unimplemented_fields_are_400_naming_them(state, route, field, value):
    body = {"model": "tiny", "max_tokens": 2, field: value}
    body.update({"prompt": "Hi"} if route == "completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    response = run(state, lambda client, http: http.post(path, json=body))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"] and "not supported" in error["message"]


@pytest.mark.parametrize("fields", [
    {"use_beam_search": False}, {"response_format": {"type": "text"}}, {"priority": 0},
    {"tool_choice": "none"}, {"guided_json": None}, {"length_penalty": 1.0},
])
def test_fields_asking_for_nothing_pass(state, fields):
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], **fields}
    response = run(state, lambda client, http: http.post("/v1/chat/completions", json=body))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("field, value", [("tool_choice", "required"), ("functions", [{"name": "f"}]),
                                          ("reasoning_effort", "high"), ("modalities", ["audio"])])
def test_unimplemented_chat_fields_are_400(state, field, value):
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], field: value}
    response = run(state, lambda client, http: http.post("/v1/chat/completions", json=body))
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_unknown_field_is_a_warning(state, caplog):
    body = {"model": "tiny", "max_tokens": 2, "prompt": "Hi", "frobnicate": 3}
    with caplog.at_level(logging.WARNING, logger="pagedllm.entrypoints.openai.serving_engine"):
        response = run(state, lambda client, http: http.post("/v1/completions", json=body))
    assert response.status_code == 200
    assert "frobnicate" in caplog.text


# -- 7. chat roles through the server --------------------------------------------------------------

@pytest.mark.parametrize("messages, fragment", [
    ([{"role": "tool", "content": "42"}], "'tool' role"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "only as the first message"),
    ([{"role": "assistant", "content": "a"}], "must alternate"),
])
def test_chat_roles_the_template_cannot_hold_are_400(state, messages, fragment):
    body = {"model": "tiny", "max_tokens": 2, "messages": messages}
    response = run(state, lambda client, http: http.post("/v1/chat/completions", json=body))
    assert response.status_code == 400 and fragment in response.json()["error"]["message"]


@pytest.mark.parametrize("first", ["system", "developer"])
def test_system_and_developer_messages_reach_the_prompt(state, tok, first):
    messages = [{"role": first, "content": "Be brief."}, {"role": "user", "content": "Hi"}]

    async def calls(client, http):
        rendered = (await http.post("/tokenize", json={"messages": messages})).json()
        alone = (await http.post("/tokenize", json={"messages": messages[:1]})).json()
        return rendered, alone

    rendered, alone = run(state, calls)
    assert tok.decode(rendered["tokens"], skip_special_tokens=False) == \
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.decode(alone["tokens"], skip_special_tokens=False) == \
        "<bos><start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\n"


# -- 8. limits ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("route, fields, param", [
    ("completions", {"n": MAX_N + 1}, "n"), ("completions", {"n": 1, "best_of": 1000}, "best_of"),
    ("chat", {"n": 1000}, "n"),
])
def test_n_and_best_of_are_capped(state, route, fields, param):
    body = {"model": "tiny", "max_tokens": 2, **fields}
    body.update({"prompt": "Hi"} if route == "completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    response = run(state, lambda client, http: http.post(path, json=body))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and f"<= {MAX_N}" in error["message"] and "--max-n" in error["message"]


def test_n_at_the_cap_runs(state):
    body = {"model": "tiny", "max_tokens": 1, "prompt": "Hi", "n": MAX_N}
    response = run(state, lambda client, http: http.post("/v1/completions", json=body))
    assert response.status_code == 200 and len(response.json()["choices"]) == MAX_N


def test_empty_prompt_one_rule_for_tokenize_and_completions(state, tok):
    bos = tok.bos_token_id

    async def calls(client, http):
        return (await http.post("/tokenize", json={"prompt": ""}),
                await http.post("/v1/completions", json={"model": "tiny", "prompt": "", "max_tokens": 2}),
                await http.post("/tokenize", json={"prompt": "", "add_special_tokens": False}),
                await http.post("/v1/completions", json={"model": "tiny", "prompt": "", "max_tokens": 2,
                                                         "add_special_tokens": False}))

    tokenized, completion, bare, bare_completion = run(state, calls)
    assert tokenized.json()["tokens"] == [bos]
    assert completion.status_code == 200 and completion.json()["usage"]["prompt_tokens"] == 1
    # Without special tokens "" has no token at all: both say so.
    assert bare.json()["tokens"] == []
    assert bare_completion.status_code == 400 and bare_completion.json()["error"]["param"] == "prompt"
    assert "empty" in bare_completion.json()["error"]["message"]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_prompt_alone_over_max_model_len_is_context_length_exceeded(state, route):
    long_text = "fox " * (2 * MAX_MODEL_LEN)
    if route == "completions":
        path, body = "/v1/completions", {"model": "tiny", "prompt": long_text, "max_tokens": 1}
    else:
        path, body = "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": long_text}],
                                              "max_tokens": 1}
    response = run(state, lambda client, http: http.post(path, json=body))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in error["message"]
    assert error["param"] == ("prompt" if route == "completions" else "messages")


# -- 9. /metrics --------------------------------------------------------------------------------------

def test_metrics_have_no_created_series(state):
    async def calls(client, http):
        await client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        return (await http.get("/metrics")).text

    text = run(state, calls)
    assert "pagedllm:request_success_total" in text and "pagedllm:time_to_first_token_seconds_bucket" in text
    assert "_created" not in text
