"""vLLM's ``vllm.utils.serial_utils`` helper for prompt embeddings over HTTP: ``tensor2base64``
gives the ``prompt_embeds`` string ``/v1/completions`` takes (``engine/prompt_embeds.py`` decodes it)."""

from __future__ import annotations

import base64
import io

import torch


def tensor2base64(x: torch.Tensor) -> str:
    """Base64 (ASCII) of ``torch.save(x)``'s bytes: vLLM's wire format for ``prompt_embeds``."""
    with io.BytesIO() as buf:
        torch.save(x, buf)
        return base64.b64encode(buf.getvalue()).decode("utf-8")
