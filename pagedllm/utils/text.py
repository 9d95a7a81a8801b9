"""Text helpers of the streamed reply parsers (tool calls, reasoning)."""

from __future__ import annotations


def may_open(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` are a proper prefix of ``tag`` (a streamed
    reply holds them back until the next delta says whether the tag follows); 0 if none."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
