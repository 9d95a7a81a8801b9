"""Chat templates: load ``--chat-template``, check messages, render them (shared by the server and
``LLM.chat``).

Rendering goes through transformers' own Jinja renderer
(``transformers.utils.chat_template_utils.render_jinja_template``, the function behind
``PreTrainedTokenizer.apply_chat_template``) with the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) as template variables, so the text equals
``AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=False)`` without
paying for a second tokenizer load. The rendered text is tokenized with
``add_special_tokens=False``: the template writes the BOS itself (as vLLM does for chat).

A model without a chat template falls back, as vLLM's per-model-type fallbacks do, to a bundled
one for its ``model_type`` (``CHAT_TEMPLATE_FALLBACKS``: Gemma 3 → ``pagedllm/data/gemma_chat_template.jinja``,
Gemma 3's turn format; so the default model, a base model, chats; one WARNING); any other model
without one is an error, never a guess.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from pagedllm.tokenizer import Tokenizer, check_text

logger = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
GEMMA_CHAT_TEMPLATE_PATH = DATA_DIR / "gemma_chat_template.jinja"
# The tool-aware variant: tools in the first user turn, calls as hermes <tool_call> blocks.
GEMMA_TOOL_CHAT_TEMPLATE_PATH = DATA_DIR / "gemma_tool_chat_template.jinja"
# Names --chat-template accepts besides a path or a literal template.
BUNDLED_CHAT_TEMPLATES = {"gemma": GEMMA_CHAT_TEMPLATE_PATH, "gemma-tools": GEMMA_TOOL_CHAT_TEMPLATE_PATH}
# model_type (config.json) -> the bundled template a model without its own renders with
# (vLLM's model-type fallbacks); Gemma 3 base checkpoints ship none.
CHAT_TEMPLATE_FALLBACKS = {"gemma3": GEMMA_CHAT_TEMPLATE_PATH, "gemma3_text": GEMMA_CHAT_TEMPLATE_PATH}
_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: no template, or the template rejected it.

    Attributes:
        param: the request field at fault: ``"messages"`` (the template rejected the
            conversation, e.g. roles that do not alternate) or ``"chat_template"`` (the template
            itself: it does not parse, its code failed, it ran past its ``RenderBudget``).
    """

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


class NoChatTemplateError(ChatTemplateError):
    """Neither the request, the server nor the tokenizer has a chat template (a base model)."""


class ChatTemplateBudgetError(ChatTemplateError):
    """The template ran past its ``RenderBudget`` (steps, seconds or output characters), or uses
    a tag that needs other template files (``{% include %}``, ``{% import %}``, ``{% extends %}``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="chat_template")


@dataclass(frozen=True)
class RenderBudget:
    """Bounds on one chat-template render, so that a template (a request's, under
    ``--trust-request-chat-template``, or a model's) cannot hold a server thread without limit:
    a nested ``{% for %}`` over ``range(99999)`` twice runs ~10^10 steps (minutes to hours).

    Steps are lines of the compiled template executed (``sys.settrace`` on the template's own
    frames in the rendering thread; ~20 per message with the bundled Gemma template). Output is
    counted as the template yields it; one expression that builds a huge string at once
    (``'x' * 10**9``) is only seen when it is yielded.

    Attributes:
        max_steps: template lines executed (default 10^7: ~10 s of Python, ~10^5 messages).
        max_seconds: wall time of the render (seconds).
        max_output_chars: characters rendered (default 64 Mi: far above a max_model_len prompt).
    """

    max_steps: int = 10_000_000
    max_seconds: float = 30.0
    max_output_chars: int = 64 << 20


class _RenderMeter:
    """The trace functions that enforce a ``RenderBudget`` (only frames of compiled Jinja code,
    whose file name is ``<template>``, are traced line by line; every other call returns None)."""

    def __init__(self, budget: RenderBudget) -> None:
        self.budget = budget
        self.steps = 0
        self.chars = 0
        self.deadline = time.monotonic() + budget.max_seconds

    def on_call(self, frame, event, arg):
        return self.on_event if frame.f_code.co_filename == "<template>" else None

    def on_event(self, frame, event, arg):
        if event == "line":
            self.steps += 1
            if self.steps > self.budget.max_steps:
                raise ChatTemplateBudgetError(f"the chat template ran more than {self.budget.max_steps} steps")
            if not self.steps & 1023 and time.monotonic() > self.deadline:
                raise ChatTemplateBudgetError(f"the chat template ran longer than {self.budget.max_seconds} s")
        elif event == "return" and isinstance(arg, str):   # a piece of output yielded
            self.chars += len(arg)
            if self.chars > self.budget.max_output_chars:
                raise ChatTemplateBudgetError(f"the chat template rendered more than {self.budget.max_output_chars} "
                                              "characters")
        return self.on_event


@functools.lru_cache(maxsize=64)
def check_self_contained(template: str) -> None:
    """Raises:
        ChatTemplateBudgetError: the template loads other templates (``{% include %}``,
            ``{% import %}``, ``{% from ... import %}``, ``{% extends %}``): a chat template is one
            self-contained text, and the renderer has no loader (files are never read).
        ChatTemplateError: the template does not parse."""
    import jinja2
    import jinja2.nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e}", param="chat_template") from e
    for kind, tag in ((jinja2.nodes.Include, "include"), (jinja2.nodes.Import, "import"),
                      (jinja2.nodes.FromImport, "from ... import"), (jinja2.nodes.Extends, "extends")):
        if tree.find(kind) is not None:
            raise ChatTemplateBudgetError(f"the chat template uses {{% {tag} %}}, which loads another template file; "
                                          "a chat template must be self-contained")


def load_chat_template(chat_template: str | os.PathLike | None) -> str | None:
    """Resolve a ``--chat-template`` value to the template text.

    Args:
        chat_template: a path to a Jinja file, a bundled name (``"gemma"``), the template text
            itself (anything containing ``{`` or a newline), or None.
    Returns:
        The template text, or None when ``chat_template`` is None.
    Raises:
        ValueError: a value that is none of the above (e.g. a mistyped path).
    """
    if chat_template is None:
        return None
    value = os.fspath(chat_template)
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if value in BUNDLED_CHAT_TEMPLATES:
        return BUNDLED_CHAT_TEMPLATES[value].read_text(encoding="utf-8")
    if "{" in value or "\n" in value:
        return value
    raise ValueError(f"chat_template {value!r} is neither a file, a bundled name {sorted(BUNDLED_CHAT_TEMPLATES)}, "
                     "nor a Jinja template")


def resolve_chat_template(tokenizer: Tokenizer, chat_template: str | None) -> str:
    """The template to use: the explicit one, else the model's, else the bundled fallback for the
    model's ``model_type`` (``CHAT_TEMPLATE_FALLBACKS``; a WARNING the first time).

    Raises:
        NoChatTemplateError: when none exists.
    """
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if not template:
        template = _fallback_chat_template(getattr(tokenizer, "model_type", None))
    if not template:
        raise NoChatTemplateError(
            "this model has no chat template (it is probably a base model); start the server with "
            f"--chat-template <file> (pagedllm ships {GEMMA_CHAT_TEMPLATE_PATH.relative_to(DATA_DIR.parent.parent)} "
            "for Gemma models), pass chat_template= (offline; a request's needs a server started with "
            "--trust-request-chat-template), or use /v1/completions with a plain prompt")
    return template


@functools.cache
def _fallback_chat_template(model_type: str | None) -> str | None:
    path = CHAT_TEMPLATE_FALLBACKS.get(model_type)
    if path is None:
        return None
    logger.warning("the model (model_type %r) has no chat template; using the bundled %s (pass "
                   "--chat-template / chat_template= to choose another)", model_type, path.name)
    return path.read_text(encoding="utf-8")


PROMPT_EMBEDS_MARKER = "<|pagedllm_prompt_embeds_{}|>"
"""The text a ``prompt_embeds`` content part renders as (its index in the conversation); the
rendered prompt is then cut at each marker, and the part's embeddings go there."""


def extract_prompt_embeds_parts(messages: Iterable[Any]) -> tuple[list[Any], list[Any]]:
    """vLLM's ``{"type": "prompt_embeds", "data": <base64 torch.save bytes>}`` content parts
    replaced by text parts holding ``PROMPT_EMBEDS_MARKER.format(i)``.

    Returns:
        The messages (the input's own objects where nothing changed), and each part's ``data``
        in order (empty when there are none).
    """
    if isinstance(messages, (str, bytes, Mapping)):
        return messages, []
    out, data = [], []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(isinstance(p, Mapping) and p.get("type") == "prompt_embeds"
                                             for p in content):
            parts = []
            for part in content:
                if isinstance(part, Mapping) and part.get("type") == "prompt_embeds":
                    parts.append({"type": "text", "text": PROMPT_EMBEDS_MARKER.format(len(data))})
                    data.append(part.get("data"))
                else:
                    parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out, data


def _content_to_text(content: Any, index: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping):
                raise ValueError(f"messages[{index}].content parts must be objects, got {type(part).__name__}")
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"messages[{index}].content part type {kind!r} is not supported "
                                 "(this server takes text only)")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"messages[{index}].content text part needs a string 'text'")
            texts.append(text)
        return "\n".join(texts)
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts, "
                     f"got {type(content).__name__}")


def parse_chat_messages(messages: Iterable[Any]) -> list[dict[str, Any]]:
    """Check OpenAI-style messages and turn them into plain dicts for the template.

    Content given as a list of ``{"type": "text", "text": ...}`` parts is joined with newlines
    (every template takes a string); keys whose value is None are dropped (transformers does the
    same). Pydantic models are dumped to dicts.

    Raises:
        ValueError: empty messages, a message without a known ``role``, non-text content, or a
            lone UTF-16 surrogate anywhere in a message (naming ``messages[i]...``).
    """
    if isinstance(messages, (str, bytes)) or isinstance(messages, Mapping):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
    result = []
    for i, message in enumerate(messages):
        if hasattr(message, "model_dump"):
            message = message.model_dump(exclude_none=True)
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}")
        check_text(dict(message), f"messages[{i}]")
        role = message.get("role")
        if role not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(_ROLES)}, got {role!r}")
        out = {k: v for k, v in message.items() if v is not None}
        content = _content_to_text(message.get("content"), i)
        if content is None and role != "assistant":
            raise ValueError(f"messages[{i}] ({role}) has no content")
        if content is not None:
            out["content"] = content
        result.append(out)
    if not result:
        raise ValueError("messages must not be empty")
    return result


def apply_chat_template(tokenizer: Tokenizer, messages: Iterable[Any], chat_template: str | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        tools: list[dict] | None = None, budget: RenderBudget | None = None,
                        **template_kwargs: Any) -> str:
    """Render a conversation to the prompt text.

    Args:
        tokenizer: supplies the model's template and special tokens.
        messages: OpenAI-style messages (see :func:`parse_chat_messages`).
        chat_template: template text overriding the model's (see :func:`load_chat_template`).
        add_generation_prompt: end with the header of an assistant turn.
        continue_final_message: leave the final (assistant) message open, to be continued.
        tools: JSON schemas handed to the template.
        budget: the bounds on the render (``RenderBudget``), for a template from an untrusted
            source (a request's); None: unbounded (metering slows a render ~50x, so a trusted
            template, the model's or the server's, runs without it).
        **template_kwargs: extra template variables (``chat_template_kwargs``).
    Raises:
        ChatTemplateError: no template, or the template raised (e.g. roles that do not alternate,
            any error of its code); ``ChatTemplateBudgetError``: it ran past ``budget`` or loads
            other templates.
        ValueError: bad messages, or both ``add_generation_prompt`` and ``continue_final_message``.
    """
    import jinja2
    from transformers.utils.chat_template_utils import render_jinja_template

    template = resolve_chat_template(tokenizer, chat_template)
    conversation = parse_chat_messages(messages)
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise ValueError("continue_final_message needs the last message to be from the assistant")
    variables = {**tokenizer.special_tokens, **template_kwargs}
    check_self_contained(template)
    previous = sys.gettrace()
    if budget is not None:
        sys.settrace(_RenderMeter(budget).on_call)   # this thread only
    try:
        rendered, _ = render_jinja_template(conversations=[conversation], tools=tools, chat_template=template,
                                            add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message, **variables)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template rejected the messages: {e}") from e
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError) as e:
        # The template's own code failed (1/0, a sandbox limit such as range() over 100,000, a
        # call on the wrong type): the template's error, not the server's.
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}", param="chat_template") from e
    finally:
        if budget is not None:
            sys.settrace(previous)
    return rendered[0]


def render_chat_prompt(tokenizer: Tokenizer, messages: Iterable[Any], chat_template: str | None = None,
                       add_generation_prompt: bool = True, continue_final_message: bool = False,
                       tools: list[dict] | None = None, budget: RenderBudget | None = None,
                       **template_kwargs: Any) -> dict[str, Any]:
    """:func:`apply_chat_template`, tokenized without adding special tokens.

    Returns:
        ``{"prompt": text, "prompt_token_ids": ids}``, a prompt the engine accepts.
    """
    text = apply_chat_template(tokenizer, messages, chat_template, add_generation_prompt,
                               continue_final_message, tools, budget, **template_kwargs)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
