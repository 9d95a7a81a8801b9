"""Prompt embeddings (vLLM's ``prompt_embeds``): checking a caller's tensor, decoding the server's
base64 ``torch.save`` bytes (vLLM's wire format, ``vllm/renderers/embed_utils.py``), and the
digest the prefix cache keys their blocks on (``core.request.PromptEmbeds``).

An embedded position keeps the placeholder token id ``PLACEHOLDER_TOKEN_ID`` (0, as vLLM) in the
request's ``prompt_token_ids``; the model runner feeds the tensor's row there instead.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from typing import Any

import torch

from pagedllm.core.request import PromptEmbeds

PLACEHOLDER_TOKEN_ID = 0
"""The token id an embedded prompt position holds for the bookkeeping (vLLM's)."""

NOT_ENABLED = ("prompt_embeds needs an engine started with enable_prompt_embeds=True "
               "(pagedllm serve --enable-prompt-embeds)")


def check_prompt_embeds(value: Any, hidden_size: int) -> torch.Tensor:
    """A caller's embeddings as the engine keeps them.

    Args:
        value: [num_tokens, hidden_size] (or [1, num_tokens, hidden_size], squeezed as vLLM does)
            floating-point tensor: the output of the model's input embedding layer.
        hidden_size: the model's hidden size.
    Returns:
        [num_tokens, hidden_size] contiguous CPU tensor, dtype unchanged (the model runner casts).
    Raises:
        ValueError: naming ``prompt_embeds``: not a tensor, another shape, a hidden size other than
            the model's, a dtype that is not floating point, or no rows.
    """
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() == 3 and value.shape[0] == 1:
        value = value.squeeze(0)
    if value.dim() != 2:
        raise ValueError(f"prompt_embeds must have shape (num_tokens, hidden_size), got {tuple(value.shape)}")
    if value.shape[1] != hidden_size:
        raise ValueError(f"prompt_embeds hidden size {value.shape[1]} does not match the model's hidden_size "
                         f"{hidden_size}")
    if not value.is_floating_point():
        raise ValueError(f"prompt_embeds must be a floating-point tensor, got dtype {value.dtype}")
    if value.shape[0] == 0:
        raise ValueError("prompt_embeds must not be empty (0 tokens)")
    return value.detach().to("cpu").contiguous()


def make_prompt_embeds(embeds: torch.Tensor, is_token_ids: list[bool] | None = None) -> PromptEmbeds:
    """``PromptEmbeds`` with its digest: SHA-256 of the dtype, shape, bytes and mask."""
    h = hashlib.sha256(f"{embeds.dtype}{tuple(embeds.shape)}".encode())
    h.update(embeds.view(torch.uint8).numpy().tobytes())
    if is_token_ids is not None:
        h.update(bytes(is_token_ids))
    return PromptEmbeds(embeds, None if is_token_ids is None else list(is_token_ids), h.hexdigest())


def decode_prompt_embeds(data: str | bytes, hidden_size: int) -> torch.Tensor:
    """One ``prompt_embeds`` item of an HTTP request: base64 of ``torch.save(tensor)`` bytes
    (``pagedllm.utils.serial_utils.tensor2base64``), loaded with ``weights_only=True`` on the CPU.

    Raises:
        ValueError: naming ``prompt_embeds``: not base64, not a saved tensor, or as
            ``check_prompt_embeds``.
    """
    try:
        payload = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"prompt_embeds must be base64 (of torch.save bytes): {e}") from e
    try:
        tensor = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:   # torch raises many types for bytes that are no tensor file
        reason = str(e).strip()[:200] or type(e).__name__
        raise ValueError(f"prompt_embeds could not be loaded as a torch tensor: {reason}") from e
    if isinstance(tensor, torch.Tensor) and tensor.layout != torch.strided:
        raise ValueError(f"prompt_embeds must be a dense tensor, got layout {tensor.layout}")
    return check_prompt_embeds(tensor, hidden_size)


def mixed_prompt(segments: list[list[int]], tensors: list[torch.Tensor]) -> dict[str, Any]:
    """A prompt of token ids with embedded spans (a chat prompt with ``prompt_embeds`` parts):
    ``segments[0]``, the rows of ``tensors[0]``, ``segments[1]``, ... (one more segment than
    tensors; checked tensors of one width).

    Returns:
        ``{"prompt_token_ids", "prompt_embeds", "prompt_is_token_ids"}`` for ``InputProcessor``
        (``prompt_embeds`` full length, zeros at the token positions), or just
        ``{"prompt_token_ids"}`` when ``tensors`` is empty.
    """
    ids: list[int] = list(segments[0])
    if not tensors:
        return {"prompt_token_ids": ids}
    mask = [True] * len(ids)
    for tensor, segment in zip(tensors, segments[1:]):
        ids += [PLACEHOLDER_TOKEN_ID] * len(tensor) + list(segment)
        mask += [False] * len(tensor) + [True] * len(segment)
    full = torch.zeros(len(ids), tensors[0].shape[1], dtype=tensors[0].dtype)
    embedded = torch.tensor([not m for m in mask])
    full[embedded] = torch.cat([t.to(full.dtype) for t in tensors])
    return {"prompt_token_ids": ids, "prompt_embeds": full, "prompt_is_token_ids": mask}
