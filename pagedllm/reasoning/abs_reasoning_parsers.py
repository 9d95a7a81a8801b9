"""``ReasoningParser``: splits a reasoning model's reply into ``reasoning`` and ``content``
(``--reasoning-parser NAME``, vLLM's ``vllm/reasoning``).

Text based: the tags are found in the detokenized text (vLLM looks for their token ids; a
tokenizer without ``<think>`` tokens works here too). A parser is stateless; a streamed choice
keeps its state in a ``ReasoningStream``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class ReasoningParser(ABC):
    """Base class of the ``--reasoning-parser`` parsers."""

    name = ""

    def extract_reasoning(self, text: str, chat_template_kwargs: dict[str, Any] | None = None
                          ) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished reply; None for a part that is absent or empty.

        Args:
            text: the whole reply.
            chat_template_kwargs: the request's (e.g. ``enable_thinking``), or None.
        """
        return self.split(text, True, chat_template_kwargs)

    @abstractmethod
    def split(self, text: str, final: bool, chat_template_kwargs: dict[str, Any] | None = None
              ) -> tuple[str | None, str | None]:
        """(reasoning, content) of ``text``; with ``final`` False (a reply still being generated)
        only what no continuation can change: each part is then a prefix of that part for any
        longer text (a tag cut in two is held back)."""
        raise NotImplementedError


class ReasoningStream:
    """One streamed choice: feeds text deltas to a parser, yields (reasoning delta, content
    delta); joined, they equal ``extract_reasoning`` of the whole text.

    Args:
        parser: the server's reasoning parser.
        chat_template_kwargs: the request's, or None.
    """

    def __init__(self, parser: ReasoningParser, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.parser = parser
        self.chat_template_kwargs = chat_template_kwargs
        self.text = ""
        self.num_reasoning_sent = 0  # characters of the reasoning sent
        self.num_content_sent = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """Add a text delta (``final``: the reply ends with it); returns (reasoning, content)
        to send, "" for none."""
        self.text += delta
        reasoning, content = self.parser.split(self.text, final, self.chat_template_kwargs)
        reasoning, content = reasoning or "", content or ""
        out = reasoning[self.num_reasoning_sent:], content[self.num_content_sent:]
        self.num_reasoning_sent, self.num_content_sent = len(reasoning), len(content)
        return out
