"""``BaseThinkingReasoningParser``: reasoning between a start and an end tag
(``<think>...</think>``), vLLM's rules for DeepSeek R1 style models.

A start tag opening the reply (after whitespace) is dropped with what precedes it (vLLM drops
the text before a ``<think>`` anywhere; here it counts only at the start, so a stream can send
reasoning before the reply ends). Everything before the end tag is reasoning, with or without a
start tag (templates put ``<think>`` in the prompt); the text after it is the content. A reply
without an end tag is all reasoning (cut short while thinking).
"""

from __future__ import annotations

from typing import Any

from pagedllm.utils.text import may_open
from pagedllm.reasoning.abs_reasoning_parsers import ReasoningParser


class BaseThinkingReasoningParser(ReasoningParser):
    start_token = "<think>"
    end_token = "</think>"

    def split(self, text: str, final: bool, chat_template_kwargs: dict[str, Any] | None = None
              ) -> tuple[str | None, str | None]:
        body = text.lstrip()
        if body.startswith(self.start_token):
            body = body[len(self.start_token):]
        elif not final and self.start_token.startswith(body):
            return None, None  # nothing yet, or what may become the start tag
        else:
            body = text
        reasoning, end, content = body.partition(self.end_token)
        if not end and not final:
            reasoning = reasoning[:len(reasoning) - may_open(reasoning, self.end_token)]
        return reasoning or None, content or None
