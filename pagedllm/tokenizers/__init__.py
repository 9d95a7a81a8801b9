"""vLLM's ``vllm.tokenizers`` import path: ``TokenizerLike`` (what a tokenizer offers) and
``get_tokenizer`` / ``cached_get_tokenizer`` (a tokenizer by model name, as the engine loads it),
``cached_tokenizer_from_config`` (the one of a ``ModelConfig``)."""

from __future__ import annotations

import functools
import os
from typing import Protocol, Sequence, runtime_checkable

from pagedllm.tokenizer import Tokenizer


@runtime_checkable
class TokenizerLike(Protocol):
    """The tokenizer interface vLLM's examples use (``pagedllm.tokenizer.Tokenizer`` has it)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def get_tokenizer(tokenizer_name: str) -> Tokenizer:
    """The tokenizer of ``tokenizer_name``: a folder with ``tokenizer.json``, or any model argument
    the engine takes (``"default"``, a ``.gguf`` file, an HF folder; ``loaders.resolve_model``),
    loaded as the engine loads it.

    Raises:
        ValueError: if the name resolves to nothing with a ``tokenizer.json``.
    """
    from pagedllm.loaders import resolve_model

    path = os.path.abspath(os.path.expanduser(tokenizer_name))
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return Tokenizer.from_pretrained(path)
    return Tokenizer.from_pretrained(resolve_model(tokenizer_name).folder)


@functools.lru_cache(maxsize=8)
def cached_get_tokenizer(tokenizer_name: str) -> Tokenizer:
    """``get_tokenizer``, loaded once per name (vLLM's ``cached_get_tokenizer``; an LRU of 8)."""
    return get_tokenizer(tokenizer_name)


def cached_tokenizer_from_config(model_config) -> Tokenizer:
    """The engine's tokenizer for a ``ModelConfig`` (vLLM's ``cached_tokenizer_from_config``):
    ``model_config.tokenizer``, else its resolved ``model_folder``, else its ``model`` argument
    (None: the default model), through ``cached_get_tokenizer``.

    Raises:
        ValueError: if that resolves to nothing with a ``tokenizer.json``.
    """
    name = model_config.tokenizer or model_config.model_folder or model_config.model or "default"
    return cached_get_tokenizer(name)


__all__ = ["TokenizerLike", "cached_get_tokenizer", "cached_tokenizer_from_config", "get_tokenizer"]
