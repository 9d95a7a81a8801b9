"""``qwen3``: Qwen3's ``<think>`` reasoning ``</think>`` content (``BaseThinkingReasoningParser``'s
rules, as vLLM's current ``qwen3`` parser), except that with the request's
``chat_template_kwargs.enable_thinking`` false (the template then closes the thinking in the
prompt) the whole reply is content. vLLM also ends the reasoning at a ``<tool_call>`` followed by
``<function=`` (Qwen3-Coder's XML calls); that is not done here.
"""

from __future__ import annotations

from typing import Any

from pagedllm.reasoning.basic_parsers import BaseThinkingReasoningParser


class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    name = "qwen3"

    def split(self, text: str, final: bool, chat_template_kwargs: dict[str, Any] | None = None
              ) -> tuple[str | None, str | None]:
        if (chat_template_kwargs or {}).get("enable_thinking", True) is False:
            return None, text or None
        return super().split(text, final, chat_template_kwargs)
