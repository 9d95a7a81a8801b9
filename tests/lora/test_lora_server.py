"""The server's adapters with the openai client (the app in-process over httpx's ASGI transport):
``--lora-modules`` in ``/v1/models`` with their ``parent``, the request's ``model`` picks the
adapter (PEFT's tokens), unknown names are 404 with an OpenAI error body, and adapters loaded and
unloaded at run time (``--enable-runtime-lora-updating``)."""

import asyncio

import httpx
import openai
import pytest
from lora_utils import NEW_TOKENS, PROMPTS

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.api_server import build_app, build_state
from pagedllm.entrypoints.openai.serving_lora import parse_lora_modules


def _run(state, fn):
    async def main():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)
            return await fn(client, http)
    return asyncio.run(main())


def test_lora_modules_flag_forms():
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}']) == [("a", "/x"), ("b", "/y")]
    with pytest.raises(ValueError, match="--lora-modules"):
        parse_lora_modules(["no-path"])


def test_adapters_through_the_openai_client(llama_lora):
    from transformers import AutoTokenizer

    base, (a0, a1, a2) = llama_lora["base"], llama_lora["adapters"]
    tokenizer = AutoTokenizer.from_pretrained(base)

    def decode(ids):   # the server holds back a trailing incomplete UTF-8 sequence (U+FFFD here)
        return tokenizer.decode(ids).rstrip("\ufffd")
    args = EngineArgs(model=base, dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, seed=0,
                      enable_lora=True, max_loras=2, enable_prefix_caching=False)
    state = build_state(args, ["tiny"], chat_template=None, log_stats_interval_s=None,
                        lora_modules=[("a0", a0), ("a1", a1)], enable_runtime_lora_updating=True)

    async def complete(client, model, i=0):
        out = await client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=NEW_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})
        return out.choices[0].text.rstrip("\ufffd")

    async def calls(client, http):
        models = {m.id: m for m in (await client.models.list()).data}
        assert set(models) == {"tiny", "a0", "a1"}
        assert models["a0"].model_extra["parent"] == "tiny" and models["a0"].model_extra["root"] == a0
        texts = await asyncio.gather(*(complete(client, m, i) for m in ("a0", "a1", "tiny") for i in (0, 1)))
        want = [decode(ref[i]) for ref in (*llama_lora["refs"][:2], llama_lora["base_ref"]) for i in (0, 1)]
        assert texts == want
        with pytest.raises(openai.NotFoundError) as err:
            await complete(client, "a2")
        assert err.value.body["code"] == "model_not_found"
        with pytest.raises(openai.BadRequestError, match="beam"):
            await client.completions.create(model="a0", prompt=PROMPTS[0], max_tokens=2, n=2,
                                            extra_body={"use_beam_search": True})
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": a2})
        assert r.status_code == 200, r.text
        assert await complete(client, "a2") == decode(llama_lora["refs"][2][0])
        assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})).status_code == 200
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"})
        assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
        assert "bad" not in {m.id for m in (await client.models.list()).data}

    try:
        _run(state, calls)
    finally:
        state.engine.shutdown()
