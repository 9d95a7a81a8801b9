"""Prompt embeddings over HTTP, in-process (ASGI transport) with the real ``openai`` client, as
vLLM's ``prompt_embed_inference_with_openai_client.py`` sends them: base64 ``torch.save`` bytes in
``/v1/completions``' ``prompt_embeds`` (extra body) and ``prompt_embeds`` chat content parts. The
completion equals the offline ``LLM.generate({"prompt_embeds": ...})``; bad input is a 400 naming
``prompt_embeds``."""

from __future__ import annotations

import openai
import pytest
import torch

from asgi_utils import run_with_clients
from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.api_server import build_state
from pagedllm.utils.serial_utils import tensor2base64

PROMPTS = [list(range(30, 49)), [5, 9, 13, 200, 17, 3, 3, 40, 41]]
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
ENGINE = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, seed=0)


def hf_embeds(path: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model.get_input_embeddings()(torch.tensor([ids])).squeeze(0)


def make_state(path: str, enable: bool):
    args = EngineArgs(model=path, enable_prompt_embeds=enable, **ENGINE)
    return build_state(args, ["tiny"], chat_template=TEMPLATE, log_stats_interval_s=None)


@pytest.fixture(scope="module")
def path(make_tiny_checkpoint):
    return make_tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def state(path):
    st = make_state(path, True)
    yield st
    st.engine.shutdown()


def test_completion_equals_offline(path, state):
    embeds = [hf_embeds(path, p) for p in PROMPTS]
    llm = LLM(path, enable_prompt_embeds=True, **ENGINE)
    offline = llm.generate([{"prompt_embeds": e} for e in embeds],
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    want = [o.outputs[0].text for o in offline]
    assert all(want)

    async def calls(client, http):
        single = await client.completions.create(model="tiny", prompt=None, max_tokens=6, temperature=0.0,
                                                 extra_body={"prompt_embeds": tensor2base64(embeds[0]),
                                                             "ignore_eos": True})
        # A list of embeddings and a text prompt: the embeddings' choices come first (vLLM's order).
        both = await client.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0.0,
                                               extra_body={"prompt_embeds": [tensor2base64(e) for e in embeds],
                                                           "ignore_eos": True})
        return single, both

    single, both = run_with_clients(state, calls)
    assert single.choices[0].text == want[0]
    assert single.usage.prompt_tokens == len(PROMPTS[0])
    assert [c.text for c in both.choices[:2]] == want and len(both.choices) == 3


def test_chat_prompt_embeds_part_equals_text(path, state):
    """A ``prompt_embeds`` content part of the user's text embeds answers as the text does."""
    from transformers import AutoTokenizer

    text = "hello world"
    ids = AutoTokenizer.from_pretrained(path)(text, add_special_tokens=False).input_ids
    part = {"type": "prompt_embeds", "data": tensor2base64(hf_embeds(path, ids))}

    async def calls(client, http):
        kw = dict(model="tiny", max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
        plain = await client.chat.completions.create(messages=[{"role": "user", "content": text}], **kw)
        embedded = await client.chat.completions.create(messages=[{"role": "user", "content": [part]}], **kw)
        return plain, embedded

    plain, embedded = run_with_clients(state, calls)
    assert embedded.choices[0].message.content == plain.choices[0].message.content
    assert embedded.usage.prompt_tokens == plain.usage.prompt_tokens


def test_bad_prompt_embeds_are_400(path, state):
    good = tensor2base64(torch.zeros(3, 64))

    async def post(client, http, body):
        r = await http.post("/v1/completions", json={"model": "tiny", "max_tokens": 2, **body})
        return r.status_code, r.json().get("error", {})

    async def calls(client, http):
        return [await post(client, http, body) for body in (
            {"prompt_embeds": tensor2base64(torch.zeros(3, 32))},
            {"prompt_embeds": tensor2base64(torch.zeros(3, 64, dtype=torch.int32))},
            {"prompt_embeds": "not base64!"},
            {"prompt_embeds": tensor2base64({"a": 1})},
            {"prompt_embeds": good, "echo": True},
            {})]

    results = run_with_clients(state, calls)
    for (status, error), (param, words) in zip(results, [
            ("prompt_embeds", "hidden size 32"), ("prompt_embeds", "floating-point"), ("prompt_embeds", "base64"),
            ("prompt_embeds", "torch.Tensor"), ("echo", "echo"), ("prompt", "prompt_embeds")]):
        assert status == 400 and error["param"] == param and words in error["message"], (status, error)


def test_not_enabled_is_400(path):
    st = make_state(path, False)
    try:
        async def calls(client, http):
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model="tiny", prompt=None, max_tokens=2,
                                                extra_body={"prompt_embeds": tensor2base64(torch.zeros(3, 64))})
            return info.value

        error = run_with_clients(st, calls)
        assert error.body["param"] == "prompt_embeds" and "enable_prompt_embeds" in error.body["message"]
    finally:
        st.engine.shutdown()
