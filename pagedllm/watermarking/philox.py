"""The watermark's pseudorandom function: Philox4x32-10 keyed by the secret key, over a context of
previous token ids and a candidate token id (vLLM's ``PhiloxPRF``, ``philox4x32-10-v1``).

Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011):
a 4 x 32-bit counter and a 2 x 32-bit key; each of the 10 rounds multiplies counter words 0 and 2 by
``M0`` / ``M1`` (64-bit products split into high and low halves) and mixes them with words 1 and 3
and the key; the key grows by the Weyl constants ``W0`` / ``W1`` between rounds.

The construction on top (vLLM's, so that text watermarked by either engine is detected by the
other): the 64-bit key splits into ``k0`` (low 32 bits) and ``k1`` (high 32 bits). A context of
``w`` int64 ids (-1 = before the text) is taken modulo 2**32 and absorbed four words at a time
into a state that starts as ``(CONTEXT_DOMAIN, w, 0, 0)``: the state XOR the block (missing words
of the last block are ``0xFFFFFFFF - i`` at place ``i``) is encrypted under ``(k0 ^ offset, k1)``,
``offset`` being the block's first position. A token ``t`` then reads word ``t & 3`` of the
encryption of ``(t >> 2, s0, s1, s2)`` under ``(k0 ^ s3, k1 ^ TOKEN_DOMAIN)``, and the word's top
24 bits ``m`` give the uniform ``(m + 1) / (2**24 + 1)`` in (0, 1), a float32. Four consecutive
token ids share one encryption, so a whole vocabulary costs ``V / 4`` of them per context.

All arithmetic is int64 on 32-bit values (a 32 x 32-bit product wraps modulo 2**64 in int64, which
keeps its bits), device-agnostic torch; on the CPU, ``vocab_uniform`` runs the rounds in C++
(``csrc/philox.cpp``, the same bits, 5-6x faster at batch 16) when that builds.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from pagedllm.platforms.cpu_extension import CpuExtension

_MASK32 = 0xFFFFFFFF
# Salmon et al. 2011, Philox4x32: the round multipliers and the key schedule's Weyl constants.
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
# vLLM's domain-separation words (ASCII "WMCX", "WMTK").
CONTEXT_DOMAIN = 0x574D4358
TOKEN_DOMAIN = 0x574D544B
# Uniforms are (m + 1) / (2**24 + 1) for the top 24 bits m of a word: exact in float32, never 0 or 1.
_UNIFORM_BITS = 24
# vocab_uniform's working set: counters per chunk (int64: 512 KiB per temporary).
_CHUNK_ELEMENTS = 1 << 16
# The C++ vocabulary kernel (``load_philox_kernel``).
EXTENSION = CpuExtension("watermark_philox", Path(__file__).resolve().parent / "csrc" / "philox.cpp",
                         "watermark Philox kernel", "the torch Philox rounds")

Words = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def mulhilo32(multiplier: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``multiplier * x`` for 32-bit ``x`` (int64 tensor).

    The 64-bit product is formed in int64, where torch's multiplication wraps modulo 2**64 (two's
    complement), so its bit pattern is the unsigned product's: the low word is ``p & 0xFFFFFFFF``
    and the high word ``(p >> 32) & 0xFFFFFFFF`` (the arithmetic shift's sign bits are masked
    off). Four passes instead of the nine of a product split into 16-bit halves; the known-answer
    and vLLM reference tests check the bits.
    """
    p = x * multiplier
    return (p >> 32) & _MASK32, p & _MASK32


def philox4x32(counter: Words, key: tuple[torch.Tensor | int, torch.Tensor | int]) -> Words:
    """Philox4x32-10 of ``counter`` under ``key`` (Salmon et al. 2011), elementwise.

    Args:
        counter: four broadcastable int64 tensors holding 32-bit words.
        key: two 32-bit words (int64 tensors or ints).
    Returns:
        The four 32-bit output words, int64.
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(PHILOX_ROUNDS):
        if r:
            k0 = (k0 + PHILOX_W0) & _MASK32
            k1 = (k1 + PHILOX_W1) & _MASK32
        hi0, lo0 = mulhilo32(PHILOX_M0, c0)
        hi1, lo1 = mulhilo32(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def words_to_uniform(words: torch.Tensor) -> torch.Tensor:
    """32-bit words (int64) -> float32 uniforms ``(m + 1) / (2**24 + 1)`` of their top 24 bits."""
    top = (words & _MASK32) >> (32 - _UNIFORM_BITS)
    return ((top.double() + 1.0) / float((1 << _UNIFORM_BITS) + 1)).float()


class PhiloxPRF:
    """vLLM's ``PhiloxPRF``: keyed uniforms per (context, token).

    Args:
        key: the secret key, an int in [0, 2**64).
    Raises:
        ValueError: if the key is not an int in [0, 2**64).
    """

    version = "philox4x32-10-v1"

    def __init__(self, key: int) -> None:
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 1 << 64:
            raise ValueError(f"key must be an int in [0, 2**64), got {key!r}")
        self.key = key
        self._k0 = key & _MASK32
        self._k1 = key >> 32

    def __repr__(self) -> str:   # the key stays out of logs
        return f"PhiloxPRF(version={self.version!r})"

    def context_state(self, contexts: torch.Tensor) -> Words:
        """The four state words after absorbing each context.

        Args:
            contexts: [..., w] int64 token ids (-1 = before the text).
        Returns:
            Four [...] int64 tensors of 32-bit words.
        """
        ctx = contexts.to(torch.int64) & _MASK32
        width = ctx.shape[-1]
        shape = ctx.shape[:-1]
        dev = ctx.device
        state = [torch.full(shape, CONTEXT_DOMAIN, dtype=torch.int64, device=dev),
                 torch.full(shape, width, dtype=torch.int64, device=dev),
                 torch.zeros(shape, dtype=torch.int64, device=dev),
                 torch.zeros(shape, dtype=torch.int64, device=dev)]
        for offset in range(0, width, 4):
            block = [ctx[..., offset + i] if offset + i < width else _MASK32 - i for i in range(4)]
            counter = tuple(s ^ b for s, b in zip(state, block))
            state = list(philox4x32(counter, ((self._k0 ^ offset) & _MASK32, self._k1)))
        return tuple(state)

    def uniform(self, contexts: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Uniforms in (0, 1) for each context and token.

        Args:
            contexts: [..., w] int64.
            token_ids: int64 broadcastable against ``[..., 1]`` (e.g. [V] for a whole vocabulary
                per context, or [..., 1] for one token each).
        Returns:
            float32, shape ``broadcast(contexts.shape[:-1] + (1,), token_ids.shape)``.
        """
        s0, s1, s2, s3 = (s.unsqueeze(-1) for s in self.context_state(contexts))
        tok = token_ids.to(device=contexts.device, dtype=torch.int64) & _MASK32
        out = philox4x32((tok >> 2, s0, s1, s2), (self._k0 ^ s3, self._k1 ^ TOKEN_DOMAIN))
        lane = tok & 3
        word = torch.where(lane == 0, out[0], torch.where(lane == 1, out[1],
                                                          torch.where(lane == 2, out[2], out[3])))
        return words_to_uniform(word)

    def vocab_uniform(self, contexts: torch.Tensor, vocab_size: int, use_kernel: bool = True) -> torch.Tensor:
        """Uniforms of every token ``0 .. vocab_size-1`` per context, one encryption per four tokens
        (equal to ``uniform(contexts, arange(vocab_size))``, about 4x cheaper).

        Args:
            contexts: [N, w] int64.
            vocab_size: V (tokens).
            use_kernel: on the CPU, the C++ kernel (``csrc/philox.cpp``, the same bits) when it
                builds; else, and on other devices, torch.
        Returns:
            [N, V] float32.
        """
        state = self.context_state(contexts)
        if use_kernel and contexts.device.type == "cpu":
            kernel = load_philox_kernel()
            if kernel is not None:
                return kernel.philox_vocab_uniform(torch.stack(state, dim=-1), self._k0, self._k1 ^ TOKEN_DOMAIN,
                                                   vocab_size)
        s0, s1, s2, s3 = (s.unsqueeze(-1) for s in state)   # [N, 1] each
        key = (self._k0 ^ s3, self._k1 ^ TOKEN_DOMAIN)
        num_groups = (vocab_size + 3) // 4
        n = contexts.shape[0]
        out = torch.empty(n, num_groups, 4, dtype=torch.float32, device=contexts.device)
        # Chunks of about _CHUNK_ELEMENTS counters: the ~250 elementwise passes of the 10 rounds
        # then run on int64 tensors that stay in the CPU's L2 cache (about 3x faster at batch 16 than whole rows).
        step = max(1, _CHUNK_ELEMENTS // max(n, 1))
        for g0 in range(0, num_groups, step):
            groups = torch.arange(g0, min(g0 + step, num_groups), dtype=torch.int64, device=contexts.device)
            words = philox4x32((groups, s0, s1, s2), key)   # 4 x [N, chunk]
            out[:, g0:g0 + step] = words_to_uniform(torch.stack(words, dim=-1))   # [N, chunk, 4]
        return out.view(n, num_groups * 4)[:, :vocab_size]   # token 4g + j = word j of group g


    def gumbel_argmax(self, contexts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
        """``argmax(logits - log(-log(u)))`` per row in one C++ pass (no [N, V] temporaries), or
        None where the kernel does not run (not the CPU, not float32, or it did not build).

        Args:
            contexts: [N, w] int64.
            logits: [N, V] float32.
        Returns:
            [N] int64 token ids (the first maximum on ties), or None.
        """
        if logits.device.type != "cpu" or logits.dtype != torch.float32:
            return None
        kernel = load_philox_kernel()
        if kernel is None:
            return None
        state = torch.stack(self.context_state(contexts), dim=-1)   # [N, 4]
        return kernel.philox_gumbel_argmax(state, self._k0, self._k1 ^ TOKEN_DOMAIN, logits)


@functools.cache
def load_philox_kernel() -> ModuleType | None:
    """The C++ vocabulary kernel (``philox_vocab_uniform``), compiled first on a machine that has
    not yet; None (one WARNING) if that fails, and torch runs."""
    from pagedllm.platforms.cpu_extension import load_extension

    return load_extension(EXTENSION)


def create_prf(name: str, key: int) -> PhiloxPRF:
    """The PRF named ``name`` (vLLM's ``create_prf``; only ``"philox"``).

    Raises:
        ValueError: for another name, or a bad key.
    """
    if name != "philox":
        raise ValueError(f"prf must be 'philox', got {name!r}")
    return PhiloxPRF(key)
