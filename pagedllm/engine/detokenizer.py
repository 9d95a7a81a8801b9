"""Incremental detokenization with stop strings (vLLM V1's ``FastIncrementalDetokenizer``).

Text is produced with ``tokenizers.decoders.DecodeStream``, which decodes a sliding window of ids
and emits only the new suffix once it is valid UTF-8: spaces between tokens come out right (the
window carries the previous tokens) and a character split over several byte-fallback tokens
(``<0xF0><0x9F>...``) appears only once complete. The stream is primed with the end of the prompt
so the first generated token also decodes in context.

A prompt may end partway through a character (token-id prompts can end with the first bytes of
one). Those tokens (:func:`incomplete_tail_length`) are fed to the stream after priming, so the
output text holds only what the generated tokens add: if their bytes complete the prompt's
character, that character is the output's first; if not, the prompt's dangling bytes are dropped
(they never show up as U+FFFD in the output), and no text of the prompt ever does.

Stop strings are searched only in text that is new since the last update (plus the tail a stop
string could straddle), and while a request runs, ``get_next_output_text`` holds back the last
``len(longest stop) - 1`` characters (vLLM's stop buffer) so a stop string is never streamed.
"""

from __future__ import annotations

import logging

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_INVALID_PREFIX_ERR = "Invalid prefix encountered"
# The prompt suffix that primes the stream: the shortest of at least _MIN_PRIME_TOKENS tokens (up
# to _MAX_PRIME_TOKENS) that decodes without a replacement character.
_MIN_PRIME_TOKENS = 4
_MAX_PRIME_TOKENS = 24
# A UTF-8 character has at most 4 bytes, so at most 4 trailing tokens can hold part of one.
_MAX_UTF8_BYTES = 4
_REPLACEMENT = "\ufffd"


def incomplete_tail_length(tokenizer: Tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> int:
    """How many trailing tokens of ``token_ids`` hold an incomplete UTF-8 character.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        token_ids: e.g. a prompt.
        skip_special_tokens: decode as the caller will.
    Returns:
        0 when the ids decode to complete characters; else the fewest trailing tokens (at most 4)
        whose removal leaves text that does not end in U+FFFD.
    """
    if not token_ids:
        return 0
    window = token_ids[-(_MAX_UTF8_BYTES + 4):]
    if not tokenizer.decode(window, skip_special_tokens=skip_special_tokens).endswith(_REPLACEMENT):
        return 0
    for t in range(1, min(_MAX_UTF8_BYTES, len(window)) + 1):
        head = window[:len(window) - t]
        if not tokenizer.decode(head, skip_special_tokens=skip_special_tokens).endswith(_REPLACEMENT):
            return t
    return min(_MAX_UTF8_BYTES, len(token_ids))


class IncrementalDetokenizer:
    """The output text of one request (one sample), built token by token.

    Attributes:
        token_ids: output token ids seen so far (including a stop token that was not decoded).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        """
        Args:
            tokenizer: a ``tokenizers.Tokenizer``; a transformers fast tokenizer is unwrapped to its
                ``backend_tokenizer``.
            prompt_token_ids: the prompt, whose last tokens prime the decoder.
            params: the request's ``stop``, ``include_stop_str_in_output``, ``min_tokens`` and
                ``skip_special_tokens`` are used.
        """
        self._tokenizer: Tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._skip_special_tokens = params.skip_special_tokens
        self._stop: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # Characters held back from streaming while running, so a stop string is never sent.
        self._stop_buffer_length = (max(len(s) for s in self._stop) - 1
                                    if self._stop and not self._include_stop else 0)
        self.token_ids: list[int] = []
        self._output_text = ""
        self._last_output_text_offset = 0
        prompt = list(prompt_token_ids)
        tail = incomplete_tail_length(self._tokenizer, prompt, self._skip_special_tokens)
        window = self._prime_ids(prompt[:len(prompt) - tail])
        self._stream = DecodeStream(ids=window, skip_special_tokens=self._skip_special_tokens)
        # The prompt's dangling bytes wait in the stream for the generated ones (each step returns
        # None: the text still ends in an incomplete character). What they decode to so far, minus
        # the U+FFFD, is prompt text the first emitted chunk would repeat; it is cut from it.
        self._prompt_pending = ""
        self._prompt_dangling = 0  # U+FFFD characters the dangling bytes decode to on their own
        if tail:
            for tok in prompt[len(prompt) - tail:]:
                self._step(tok)
            before = self._tokenizer.decode(window, skip_special_tokens=self._skip_special_tokens)
            after = self._tokenizer.decode(window + prompt[len(prompt) - tail:],
                                           skip_special_tokens=self._skip_special_tokens)
            pending = after[len(before):] if after.startswith(before) else ""
            self._prompt_pending = pending.rstrip(_REPLACEMENT)
            self._prompt_dangling = len(pending) - len(self._prompt_pending)

    @property
    def output_text(self) -> str:
        """The text so far (cut at a matched stop string), including held-back characters."""
        return self._output_text

    @property
    def has_stop_strings(self) -> bool:
        """True when the request has stop strings to look for."""
        return bool(self._stop)

    def update(self, new_token_ids: list[int], num_output_tokens: int,
               stop_terminated: bool = False) -> str | None:
        """Decode newly generated tokens and look for a stop string.

        Stop strings are honoured only once ``num_output_tokens >= params.min_tokens``, and only
        when they end in text from output token number ``min_tokens`` (1-based) or later. The
        earliest-ending match wins; the text is cut before it, or after it with
        ``include_stop_str_in_output`` (text decoded after the match is dropped either way).

        Args:
            new_token_ids: tokens appended to the request this step, in order.
            num_output_tokens: the request's output length after appending them (tokens).
            stop_terminated: the last new token is an EOS / stop token id that ends the request;
                unless ``include_stop_str_in_output`` its text is not added (as vLLM).
        Returns:
            The matched stop string, or None. After a match the caller finishes the request.
        """
        if not new_token_ids:
            return None
        ids = list(new_token_ids)
        skipped_stop_id = None
        if stop_terminated and not self._include_stop:
            skipped_stop_id = ids.pop()
        first_index = num_output_tokens - len(new_token_ids) + 1  # 1-based index of ids[0]
        stop_check_offset = len(self._output_text)
        text = self._output_text
        for j, tok in enumerate(ids):
            self.token_ids.append(tok)
            chunk = self._step(tok)
            if chunk and (self._prompt_pending or self._prompt_dangling):
                chunk = self._cut_prompt_tail(chunk)
            if chunk:
                text += chunk
            if first_index + j < self._min_tokens:
                # Text of the first min_tokens - 1 tokens cannot end a stop string.
                stop_check_offset = len(text)
        if skipped_stop_id is not None:
            self.token_ids.append(skipped_stop_id)
        self._output_text = text

        if not self._stop or num_output_tokens < self._min_tokens:
            return None
        new_chars = len(text) - stop_check_offset
        if new_chars <= 0:
            return None
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stop:
            start = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
            if start != -1:
                cand = (start + len(stop), start, stop)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is None:
            return None
        end, start, stop = best
        self._output_text = text[:end] if self._include_stop else text[:start]
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to hand out now.

        Args:
            finished: the request is done; nothing is held back.
            delta: return only the part not returned by an earlier delta call.
        Returns:
            While running, the text without its last ``len(longest stop) - 1`` characters
            (everything when there are no stop strings or they are kept in the output); all of it
            once finished. With ``delta``, only the new part ("" if none).
        """
        buffer_length = 0 if finished else self._stop_buffer_length
        length = len(self._output_text) - buffer_length
        if not delta:
            return self._output_text[:length] if buffer_length else self._output_text
        last = self._last_output_text_offset
        if last < length:
            self._last_output_text_offset = length
            return self._output_text[last:length]
        return ""

    def _cut_prompt_tail(self, chunk: str) -> str:
        """Remove from the first emitted chunk what the prompt's dangling tokens contributed: text
        they completed before their partial character, and that character's U+FFFD if the
        generated bytes did not complete it."""
        if self._prompt_pending and chunk.startswith(self._prompt_pending):
            chunk = chunk[len(self._prompt_pending):]
        dangling = 0
        while dangling < self._prompt_dangling and dangling < len(chunk) and chunk[dangling] == _REPLACEMENT:
            dangling += 1
        self._prompt_pending, self._prompt_dangling = "", 0
        return chunk[dangling:]

    def _prime_ids(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt suffix that primes the stream (as vLLM): short, but decoding cleanly."""
        if len(prompt_token_ids) <= _MIN_PRIME_TOKENS:
            return prompt_token_ids
        for n in range(_MIN_PRIME_TOKENS, min(len(prompt_token_ids), _MAX_PRIME_TOKENS) + 1):
            suffix = prompt_token_ids[-n:]
            text = self._tokenizer.decode(suffix, skip_special_tokens=self._skip_special_tokens)
            if "\ufffd" not in text:
                return suffix
        return prompt_token_ids[-_MAX_PRIME_TOKENS:]

    def _step(self, token_id: int) -> str | None:
        """Feed one id to the stream; the new text, or None while a character is incomplete."""
        try:
            return self._stream.step(self._tokenizer, token_id)
        except (OverflowError, TypeError):
            logger.warning("Skipping undecodable token id %r", token_id)
            return None
        except Exception as e:  # tokenizers raises a bare Exception here
            if not str(e).startswith(_INVALID_PREFIX_ERR):
                raise
            # Non-monotonic decoding (e.g. invalid UTF-8 in the window) breaks the stream's state;
            # start a fresh one (vLLM issue 17448).
            logger.warning("Resetting the decode stream after %r", str(e))
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._tokenizer, token_id)
