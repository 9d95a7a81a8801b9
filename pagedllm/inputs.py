"""vLLM's prompt dicts (``vllm.inputs.TextPrompt`` / ``TokensPrompt``): typed names for the
``{"prompt": ...}`` and ``{"prompt_token_ids": [...]}`` prompts every entry point accepts."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine (``prompt``: the text)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt given as token ids (``prompt_token_ids``: ids in the model's vocabulary)."""

    prompt_token_ids: list[int]


__all__ = ["TextPrompt", "TokensPrompt"]
