"""Chat template loading and rendering (shared by the server and LLM.chat)."""

from __future__ import annotations

import re

import pytest

from pagedllm.entrypoints.chat_utils import (GEMMA_CHAT_TEMPLATE_PATH, ChatTemplateError, apply_chat_template,
                                             load_chat_template, parse_chat_messages, render_chat_prompt)
from pagedllm.tokenizer import Tokenizer

GEMMA = GEMMA_CHAT_TEMPLATE_PATH.read_text()
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return Tokenizer.from_pretrained(tiny_tokenizer_dir)


def test_load_chat_template_from_file_name_or_text(tmp_path):
    assert load_chat_template(None) is None
    assert load_chat_template(str(GEMMA_CHAT_TEMPLATE_PATH)) == GEMMA
    assert load_chat_template("gemma") == GEMMA
    assert load_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    path = tmp_path / "t.jinja"
    path.write_text("{{ bos_token }}x")
    assert load_chat_template(path) == "{{ bos_token }}x"
    with pytest.raises(ValueError, match="neither a file"):
        load_chat_template("no/such/template.jinja")


def test_gemma_template_renders_turns(tokenizer):
    text = apply_chat_template(tokenizer, CONVERSATION, GEMMA)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
                    "<start_of_turn>model\nHello!<end_of_turn>\n"
                    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n")
    no_prompt = apply_chat_template(tokenizer, CONVERSATION[:2], GEMMA, add_generation_prompt=False)
    assert no_prompt.endswith("<end_of_turn>\n")


def test_render_equals_transformers_apply_chat_template(tokenizer, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    messages = [dict(m) for m in CONVERSATION]
    messages[-1] = {"role": "user", "content": "What is 2+2?"}
    expected = hf.apply_chat_template(messages, chat_template=GEMMA, tokenize=False, add_generation_prompt=True)
    assert apply_chat_template(tokenizer, messages, GEMMA) == expected
    rendered = render_chat_prompt(tokenizer, messages, GEMMA)
    # The template writes the BOS; tokenizing must not add a second one.
    assert rendered["prompt_token_ids"] == tokenizer.encode(expected, add_special_tokens=False)
    assert rendered["prompt_token_ids"].count(tokenizer.bos_token_id) == 1


def test_model_without_template_is_a_clear_error(tokenizer):
    assert tokenizer.chat_template is None
    with pytest.raises(ChatTemplateError, match="--chat-template"):
        apply_chat_template(tokenizer, CONVERSATION)


def test_bad_messages(tokenizer):
    with pytest.raises(ValueError, match="must not be empty"):
        parse_chat_messages([])
    with pytest.raises(ValueError, match="role"):
        parse_chat_messages([{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError, match="not supported"):
        parse_chat_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match="has no content"):
        parse_chat_messages([{"role": "user"}])
    with pytest.raises(ChatTemplateError, match="alternate"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], GEMMA)


def test_llm_chat_equals_generate_on_rendered_prompt(make_tiny_checkpoint, tokenizer):
    from pagedllm import LLM, SamplingParams

    llm = LLM(make_tiny_checkpoint("llama"), dtype="float32", max_model_len=512,
              kv_cache_memory_bytes=16 << 20, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    conversations = [CONVERSATION[1:2], CONVERSATION[:3] + [{"role": "user", "content": "And 3+3?"}]]
    chat_outs = llm.chat(conversations, params, use_tqdm=False, chat_template="gemma")
    prompts = [render_chat_prompt(tokenizer, c, GEMMA) for c in conversations]
    gen_outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in chat_outs] == [o.outputs[0].token_ids for o in gen_outs]
    assert chat_outs[0].prompt_token_ids == prompts[0]["prompt_token_ids"]
    single = llm.chat(CONVERSATION[1:2], params, use_tqdm=False, chat_template=str(GEMMA_CHAT_TEMPLATE_PATH))
    assert single[0].outputs[0].token_ids == chat_outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="--chat-template"):
        llm.chat(CONVERSATION[1:2], params, use_tqdm=False)
    with pytest.raises(ValueError, match="must not be empty"):
        llm.chat([], params, use_tqdm=False)


# -- every OpenAI role with the shipped Gemma template: rendered in full, or a clear error ---------

ROLES = ["system", "developer", "user", "assistant", "tool"]


def _expected_gemma(roles: list[str]) -> tuple[str | None, str | None]:
    """What Gemma 3's turn format makes of these roles, written independently of the template:
    (text, None), or (None, a fragment of the error) for the first message it cannot hold. A first
    system/developer message opens the first user turn (alone, it is that turn); then user and
    assistant ("model") alternate, starting with user; Gemma has no tool turn."""
    contents = [f"text of message {i} ({role})" for i, role in enumerate(roles)]
    prefix = ""
    rest = list(zip(roles, contents))
    if roles and roles[0] in ("system", "developer"):
        prefix, rest = contents[0] + "\n\n", rest[1:]
        if not rest:
            return f"<bos><start_of_turn>user\n{contents[0]}<end_of_turn>\n<start_of_turn>model\n", None
    out = "<bos>"
    for i, (role, content) in enumerate(rest):
        if role in ("system", "developer"):
            return None, f"{role} message only as the first message"
        if role == "tool":
            return None, "no 'tool' role"
        if role != ("user" if i % 2 == 0 else "assistant"):
            return None, "must alternate user/assistant/user/assistant/... starting with user"
        out += f"<start_of_turn>{'model' if role == 'assistant' else 'user'}\n{prefix if i == 0 else ''}{content}" \
               "<end_of_turn>\n"
    return out + "<start_of_turn>model\n", None


@pytest.mark.parametrize("roles", [[r] for r in ROLES] + [[a, b] for a in ROLES for b in ROLES]
                         + [["system", "user", "assistant", "user"], ["developer", "user", "assistant", "user"],
                            ["user", "assistant", "tool"], ["system", "user", "assistant", "system"],
                            ["user", "assistant", "user", "developer"]])
def test_gemma_template_renders_every_role_or_refuses_clearly(tokenizer, roles):
    messages = [{"role": role, "content": f"text of message {i} ({role})"} for i, role in enumerate(roles)]
    expected, error = _expected_gemma(roles)
    if expected is not None:
        text = apply_chat_template(tokenizer, messages, GEMMA)
        assert text == expected
        for m in messages:  # nothing dropped
            assert text.count(m["content"]) == 1
        return
    with pytest.raises(ChatTemplateError, match=re.escape(error)):
        apply_chat_template(tokenizer, messages, GEMMA)
