"""``StructuredOutputRequest``: one request's grammar state, the handle a ``core.Request`` holds."""

from __future__ import annotations

from concurrent.futures import Future, wait

import numpy as np

from pagedllm.structured_output.backend import GrammarMatcher, StructuredOutputBackend


class StructuredOutputRequest:
    """A compiled grammar (a future while it compiles) and this request's own matcher.

    Each sample of ``n``, each request sharing KV blocks through the prefix cache, has its own
    matcher; the compiled grammar is shared. The matcher lives only here, so it goes away with
    the ``core.Request`` when the request finishes or is aborted.

    Args:
        compiled: the compile job's future (``StructuredOutputManager``).
        backend: the future of the engine's backend (built in the same pool, before the compile).
    """

    def __init__(self, compiled: Future, backend: Future[StructuredOutputBackend]) -> None:
        self._compiled = compiled
        self._backend = backend
        self._matcher: GrammarMatcher | None = None
        self._error: str | None = None

    def is_ready(self) -> bool:
        """True once the compile has ended; the first such call builds the matcher (or records
        the compile's error)."""
        if self._matcher is not None or self._error is not None:
            return True
        if not self._compiled.done():
            return False
        try:
            self._matcher = self._backend.result().new_matcher(self._compiled.result())
        except Exception as e:  # noqa: BLE001 - reported through ``error``
            self._error = f"{type(e).__name__}: {e}"
        return True

    def wait(self) -> None:
        """Block until the compile has ended (then ``is_ready()`` is True). For engines that must
        admit the request at the same step on every rank (external_launcher)."""
        wait([self._compiled])
        self.is_ready()

    @property
    def error(self) -> str | None:
        """Why the grammar failed to compile, or None."""
        return self._error

    @property
    def matcher(self) -> GrammarMatcher:
        """The matcher.

        Raises:
            RuntimeError: before ``is_ready()`` is True, or after a failed compile.
        """
        if self._matcher is None:
            raise RuntimeError(f"the grammar is not ready (error: {self._error})")
        return self._matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance the matcher by the sampled tokens; False (matcher unusable from that token
        on) when the grammar rejects one."""
        matcher = self.matcher
        return all(matcher.accept_token(t) for t in token_ids)

    def is_terminated(self) -> bool:
        """True when the grammar has ended (it accepted a stop token, or allows nothing more)."""
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` ([rows, ceil(vocab/32)] int32,
        C-contiguous numpy)."""
        self.matcher.fill_bitmask(bitmask, row)

    def fork(self) -> "StructuredOutputRequest":
        """A copy whose matcher continues from this one's state independently (for forked
        sequences, e.g. beam search); shares the compiled grammar."""
        other = StructuredOutputRequest(self._compiled, self._backend)
        other._matcher = self.matcher.fork()
        return other
