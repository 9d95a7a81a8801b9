"""Which rows of a step are watermarked, with what context, and their draw (vLLM's
``GPUWatermarkSampler``, on the worker).

A row is watermarked when its request's resolved ``SamplingParams.watermarking`` is True (random
sampling; ``WatermarkConfig.watermarks``) and its context is not a repeat (deduplication, below);
every other row samples as usual. The context is the request's last ``context_width`` generated
tokens, -1 where fewer exist (the prompt is never part of it), as vLLM builds it and as the
detector reads text.

Deduplication (vLLM's ``repeated_context_mask``): the history is the generated tokens
(``"single_turn"``) or prompt + generated tokens (``"all"``, where a context with -1 in it is
never watermarked); position ``p`` of the history has the context of the ``w`` ids before it (-1
before the history). A row's context is a repeat when it equals the context at one of the last
``deduplicate_contexts_max_history`` positions: reusing a context would reuse its keyed noise,
which biases the text towards loops and adds no evidence.

The draw applies the same processing as the ordinary one before it (vLLM's order): penalties,
temperature, min_p, then the top-k / top-p masks, then ``argmax(logits + Gumbel noise)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from pagedllm.config import WatermarkConfig
from pagedllm.watermarking.gumbel import GumbelWatermarker

_NEG_INF = float("-inf")


def last_context(output_token_ids: Sequence[int], width: int) -> list[int]:
    """The last ``width`` generated ids, left-padded with -1."""
    tail = list(output_token_ids[-width:]) if width else []
    return [-1] * (width - len(tail)) + tail


def is_repeated_context(history: Sequence[int], context: Sequence[int], max_history: int | None) -> bool:
    """Whether ``context`` equals the context (the ``w`` ids before, -1 padded) of one of the last
    ``max_history`` positions of ``history`` (all when None); numpy, O(len(history) * w)."""
    width = len(context)
    length = len(history)
    if length == 0:
        return False
    start = 0 if max_history is None else max(0, length - max_history)
    padded = np.concatenate([np.full(width, -1, dtype=np.int64), np.asarray(history, dtype=np.int64)])
    # window p = padded[p : p + w]: the context of history[p]; positions start .. length-1
    windows = np.lib.stride_tricks.sliding_window_view(padded[start:length + width - 1], width)
    return bool((windows == np.asarray(context, dtype=np.int64)).all(axis=1).any())


def top_k_top_p_mask(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``x`` with the tokens outside each row's top-k and then top-p nucleus set to -inf (one
    sort per row; the nucleus keeps, in descending order, each token whose preceding mass among the
    top-k is below ``top_p``, and always the first), as the ordinary sampler keeps them.

    Args:
        x: [W, V] float32 logits after temperature and min_p.
        top_k: [W] int64 tokens kept (V = off).
        top_p: [W] float64 nucleus mass (+inf = off).
    Returns:
        [W, V] float32, a new tensor.
    """
    vals, order = x.sort(dim=-1, descending=True)   # [W, V]
    pos = torch.arange(x.shape[1], device=x.device)
    outside_k = pos.unsqueeze(0) >= top_k.unsqueeze(1)
    vals = vals.masked_fill(outside_k, _NEG_INF)
    probs = torch.softmax(vals.double(), dim=-1)
    remove = (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    remove[:, 0] = False
    return torch.empty_like(x).scatter_(1, order, vals.masked_fill(remove, _NEG_INF))


@dataclass
class WatermarkRows:
    """One step's watermarked rows among the random rows.

    Attributes:
        rows: [W] int64 indices into the step's random rows.
        contexts: [W, w] int64 contexts.
        top_k: [W] int64 (V = off) and ``top_p`` [W] float64 (+inf = off), or both None when no
            watermarked row filters.
        watermarker: draws the tokens.
    """

    rows: torch.Tensor
    contexts: torch.Tensor
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    watermarker: GumbelWatermarker

    def sample(self, x: torch.Tensor) -> torch.Tensor:
        """[W] int64 tokens from ``x`` [W, V] float32, these rows' logits after min_p.

        When every row sets top_k, the noise is needed only at the candidates: the PRF runs on the
        ``max(top_k)`` best ids of each row instead of the whole vocabulary (the same uniforms, so
        the same token as the full-vocabulary argmax over the masked logits)."""
        if self.top_k is None:
            return self.watermarker.sample(x, self.contexts)
        k_max = int(self.top_k.max())
        if k_max >= x.shape[1]:
            return self.watermarker.sample(top_k_top_p_mask(x, self.top_k, self.top_p), self.contexts)
        vals, ids = x.topk(k_max, dim=-1)   # [W, K] descending
        kept = top_k_top_p_mask(vals, self.top_k, self.top_p)   # already sorted: masks in place of sort
        u = self.watermarker.prf.uniform(self.contexts, ids)   # [W, K]
        noisy = u.log_().neg_().log_().neg_().add_(kept)
        return ids.gather(1, noisy.argmax(dim=-1, keepdim=True)).squeeze(1)


class WatermarkSampler:
    """The engine's watermark on a worker: picks a step's watermarked rows.

    Args:
        config: the engine's ``WatermarkConfig``.
    """

    def __init__(self, config: WatermarkConfig) -> None:
        self.config = config
        self.watermarker = GumbelWatermarker(config.key, config.context_width, config.prf)

    def __repr__(self) -> str:
        return f"WatermarkSampler({self.config!r})"

    def _context(self, params, output_ids: Sequence[int], prompt_ids: Sequence[int]) -> list[int] | None:
        """The row's context, or None when this step samples it without the watermark."""
        cfg = self.config
        w = cfg.context_width
        if params.watermarking is not True:
            return None
        context = last_context(output_ids, w)
        scope = cfg.deduplicate_contexts
        if scope == "none":
            return context
        if scope == "all":
            if len(output_ids) < w:
                return None
            history = list(prompt_ids) + list(output_ids)
        else:
            history = output_ids
        return None if is_repeated_context(history, context, cfg.deduplicate_contexts_max_history) else context

    def rows(self, params: Sequence, output_token_ids: Sequence[Sequence[int]],
             prompt_token_ids: Sequence[Sequence[int]], random_idx: Sequence[int], vocab_size: int,
             device) -> WatermarkRows | None:
        """The watermarked rows among the random rows ``random_idx`` (batch indices), or None.

        Args:
            params, output_token_ids, prompt_token_ids: per batch row, as ``SamplingMetadata.build``.
            random_idx: the batch rows that sample at random, in random-row order.
            vocab_size: logits width (tokens).
            device: where the tensors go.
        """
        rows, contexts, ks, ps = [], [], [], []
        for j, i in enumerate(random_idx):
            ctx = self._context(params[i], output_token_ids[i], prompt_token_ids[i])
            if ctx is None:
                continue
            p = params[i]
            rows.append(j)
            contexts.append(ctx)
            ks.append(p.top_k if 0 < p.top_k < vocab_size else vocab_size)
            ps.append(p.top_p if p.top_p < 1.0 else float("inf"))
        if not rows:
            return None
        filtered = any(k < vocab_size for k in ks) or any(q != float("inf") for q in ps)
        return WatermarkRows(
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            contexts=torch.tensor(contexts, dtype=torch.int64, device=device),
            top_k=torch.tensor(ks, dtype=torch.int64, device=device) if filtered else None,
            top_p=torch.tensor(ps, dtype=torch.float64, device=device) if filtered else None,
            watermarker=self.watermarker)
