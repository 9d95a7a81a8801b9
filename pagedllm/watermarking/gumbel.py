"""Gumbel-max watermarked sampling (vLLM's ``GumbelWatermarker``).

The Gumbel-max trick: ``argmax_i (l_i + g_i)`` with ``g_i = -log(-log(u_i))``, ``u_i`` i.i.d.
U(0, 1), is a draw from ``softmax(l)`` (Gumbel 1954; Maddison et al. 2014). The watermark takes
the ``u_i`` from a keyed PRF of the previous ``context_width`` generated tokens instead of a random
generator (Aaronson 2022; Kuditipudi et al. 2023, as vLLM cites them): over keys each token keeps
its probability, while whoever holds the key sees that the chosen tokens have large ``u``
(``detector.py``).
"""

from __future__ import annotations

import torch

from pagedllm.watermarking.philox import PhiloxPRF, create_prf


class GumbelWatermarker:
    """Picks tokens by the keyed Gumbel-max trick.

    Args:
        key: the secret key (int in [0, 2**64)).
        context_width: previous generated tokens the PRF reads (>= 1).
        prf: ``"philox"`` or a ``PhiloxPRF``.
    Raises:
        ValueError: for a bad key, width or PRF name.
    """

    def __init__(self, key: int, context_width: int = 4, prf: PhiloxPRF | str = "philox") -> None:
        if isinstance(context_width, bool) or not isinstance(context_width, int) or context_width < 1:
            raise ValueError(f"context_width must be an int >= 1, got {context_width!r}")
        self.prf = create_prf(prf, key) if isinstance(prf, str) else prf
        self.context_width = context_width

    def __repr__(self) -> str:
        return f"GumbelWatermarker(context_width={self.context_width}, prf={self.prf!r})"

    def gumbel_noise(self, contexts: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[N, V] float32 Gumbel noise ``-log(-log(u))`` of every token per context ([N, w] int64)."""
        u = self.prf.vocab_uniform(contexts, vocab_size)   # [N, V] in (0, 1)
        return u.log_().neg_().log_().neg_()

    def sample(self, logits: torch.Tensor, contexts: torch.Tensor) -> torch.Tensor:
        """The watermarked draw: ``argmax(logits + gumbel_noise(contexts))`` per row.

        Args:
            logits: [N, V] float32 processed logits (after penalties, temperature, min_p and the
                top-k / top-p masks; -inf = excluded).
            contexts: [N, w] int64, each row's last ``w`` generated tokens (-1 before the first).
        Returns:
            [N] int64 token ids.
        Raises:
            ValueError: if the shapes disagree.
        """
        if logits.dim() != 2 or contexts.shape != (logits.shape[0], self.context_width):
            raise ValueError(f"logits must be [N, V] and contexts [N, {self.context_width}], "
                             f"got {list(logits.shape)} and {list(contexts.shape)}")
        fused = self.prf.gumbel_argmax(contexts, logits)   # the CPU kernel: one pass, no [N, V] noise
        if fused is not None:
            return fused
        return (self.gumbel_noise(contexts, logits.shape[1]).add_(logits)).argmax(dim=-1)
