"""Batched token sampling from the last position's logits (the order of vLLM V1's ``Sampler``).

1. Raw log-probabilities (vLLM's ``raw_logprobs``) from the unprocessed logits.
2. ``allowed_token_ids`` / bad words / ``min_tokens`` masks (-inf), ``logit_bias``, logits
   processors, repetition (CTRL, prompt + output) then frequency / presence penalties (output).
3. Greedy rows: argmax of the processed logits. Random rows: temperature, min_p, top_k, top_p,
   then one inverse-CDF draw per row; watermarked rows (``watermark_config``) take the keyed
   Gumbel-max draw after the same steps instead (``watermarking/sampling.py``).

Greedy and unseeded rows go through the batch in one pass; the only per-row Python loops are the
seeded generators (one uniform each) and logits processors. top_k / top_p never sort a whole
vocabulary row: candidates come from ``torch.topk`` (k = top_k, or ``TOP_P_CANDIDATE_CAP`` for
top_p alone); a row whose candidates hold less than ``top_p`` of the mass retries with 16x more,
and only past that is sorted whole.

Sampling draws exactly one float64 uniform per random row per step, from the row's own generator
when seeded, so a seeded row's tokens depend only on its seed and its logits, never on the rest of
the batch. Inverse CDF over float64 cumulative sums costs one exp and one scan per row, which on
the CPU is several times cheaper than a vocabulary-wide exponential race and samples the same
distribution.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.sample.metadata import LogitsAdjustments, RandomSampling, SamplingMetadata

if TYPE_CHECKING:
    from pagedllm.sample.batch_logits_processors import BatchLogitsProcessors

_NEG_INF = float("-inf")
# top_p candidates grow by this factor (TOP_P_CANDIDATE_CAP, x16, ..., then the whole row) while
# they hold less than top_p of the mass; on the CPU topk(16384) costs about topk(1024).
_TOP_P_CAP_GROWTH = 16
_UINT64_MASK = (1 << 64) - 1


def make_generator(seed: int, device) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed`` (taken modulo 2**64, so negative
    and large Python ints work); one per seeded request (sample ``i`` of ``n`` uses
    ``seed + i``)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & _UINT64_MASK)
    return gen


@dataclass
class SamplerOutput:
    """One step's sampled tokens and their raw log-probabilities.

    Attributes:
        sampled_token_ids: [N] int64.
        sampled_logprobs: [N] float32, log-softmax of the raw logits at the sampled id; NaN on
            rows that need none (``SamplingMetadata.logprob_rows``).
        topk_token_ids: [N, K] int64, the K = ``max_num_logprobs`` most likely ids under the raw
            logits, most likely first; None when no row asked for logprobs.
        topk_logprobs: [N, K] float32, their raw log-probabilities; None likewise.
        sampled_ranks: [N] int64, 1-based rank of the sampled id under the raw logits (1 + number
            of strictly larger logits); None likewise.
    """

    sampled_token_ids: torch.Tensor
    sampled_logprobs: torch.Tensor
    topk_token_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


class Sampler:
    """Picks one token per row from ``[N, vocab]`` logits; stateless (generators live with the
    requests).

    Args:
        greedy_argmax: for batches of plain greedy rows, ``[N, V] logits -> [N] int64`` equal to
            ``logits.max(dim=-1).indices``, or None where it cannot run (then torch runs); the
            model runner passes ``layers.fused_ops.greedy_argmax`` when the model runs the fused
            CPU ops. None: torch always.
    """

    def __init__(self, greedy_argmax: Callable[[torch.Tensor], torch.Tensor | None] | None = None) -> None:
        self.greedy_argmax = greedy_argmax

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata,
                 processors: BatchLogitsProcessors | None = None) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: [N, vocab_size] logits of each row's last position, float32 or the model dtype
                (widened to float32 unless every row is a plain greedy row); not modified.
            metadata: built by ``SamplingMetadata.build`` for the same N rows.
            processors: the class-based logits processors, already told this step's batch (row
                ``i`` = batch index ``i``), or None: those that can change an argmax run after the
                per-request processors, before the penalties; the argmax-invariant ones after
                temperature, for the random rows only (vLLM's order).
        Returns:
            ``SamplerOutput``; logprobs and ranks are from the raw logits.
        Raises:
            ValueError: if ``logits`` is not [metadata.num_reqs, metadata.vocab_size].
        """
        if logits.dim() != 2 or tuple(logits.shape) != (metadata.num_reqs, metadata.vocab_size):
            raise ValueError(
                f"logits must be [{metadata.num_reqs}, {metadata.vocab_size}], "
                f"got {list(logits.shape)}")
        rows = metadata.logprob_rows
        early = processors is not None and processors.changes_argmax
        if metadata.all_greedy and metadata.adjustments is None and metadata.max_num_logprobs is None \
                and rows is not None and rows.numel() == 0 and not early:
            # Plain greedy rows, no logprobs: the argmax of the logits in their own dtype. ``max``'s
            # indices are the first maximum, as ``argmax``'s; a bfloat16 row widened to float32 has
            # the same order, so this is the float32 path's answer without the [N, V] conversion
            # (and torch's bfloat16 ``max`` is faster than its bfloat16 ``argmax``).
            sampled = self.greedy_argmax(logits) if self.greedy_argmax is not None else None
            if sampled is None:
                sampled = logits.max(dim=-1).indices
            return SamplerOutput(sampled_token_ids=sampled,
                                 sampled_logprobs=torch.full(sampled.shape, float("nan"), device=logits.device))
        if logits.dtype != torch.float32:
            logits = logits.float()
        raw = logits
        x = _apply_adjustments(raw, metadata.adjustments, processors)
        late = processors.argmax_invariant if processors is not None else []
        sampled = self._sample_with_late_processors(x, metadata, processors) if late and not metadata.all_greedy \
            else self._sample(x, metadata)

        sampled_logit = raw.gather(1, sampled.unsqueeze(1)).squeeze(1)  # [N]
        k = metadata.max_num_logprobs
        if k is not None or rows is None:
            raw_lse = raw.logsumexp(dim=-1)  # [N]
            sampled_logprobs = sampled_logit - raw_lse
        else:  # only some rows (maybe none) need it; the rest get NaN
            sampled_logprobs = torch.full_like(sampled_logit, float("nan"))
            if rows.numel():
                lse = raw.index_select(0, rows).logsumexp(dim=-1)
                sampled_logprobs[rows] = sampled_logit.index_select(0, rows) - lse
        out = SamplerOutput(sampled_token_ids=sampled, sampled_logprobs=sampled_logprobs)
        if k is not None:
            k = min(k, metadata.vocab_size)
            top_vals, top_ids = raw.topk(k, dim=-1)  # [N, K], descending
            out.topk_token_ids = top_ids
            out.topk_logprobs = top_vals - raw_lse.unsqueeze(1)
            out.sampled_ranks = (raw > sampled_logit.unsqueeze(1)).sum(dim=-1) + 1
        return out

    def _sample(self, x: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """[N] int64 token ids from processed logits ``x`` [N, V]."""
        if md.all_greedy:
            return x.argmax(dim=-1)
        if md.all_random:
            return _sample_random(x, md.random, owned=False)
        out = torch.empty(md.num_reqs, dtype=torch.int64, device=x.device)
        out[md.greedy_rows] = x.index_select(0, md.greedy_rows).argmax(dim=-1)
        out[md.random_rows] = _sample_random(x.index_select(0, md.random_rows), md.random,
                                             owned=True)
        return out


    @staticmethod
    def _sample_with_late_processors(x: torch.Tensor, md: SamplingMetadata,
                                     processors: BatchLogitsProcessors) -> torch.Tensor:
        """[N] int64 tokens when argmax-invariant processors run (vLLM's order): greedy rows take
        the argmax of ``x``; then the whole batch divided by its temperatures (greedy rows by 1)
        goes through the processors, and the random rows sample from the result."""
        out = torch.empty(md.num_reqs, dtype=torch.int64, device=x.device)
        if not md.all_random:
            out[md.greedy_rows] = x.index_select(0, md.greedy_rows).argmax(dim=-1)
        rs = md.random
        scaled = x.clone()                                  # x may be the raw logits
        if rs.temperature is not None:
            temps = rs.temperature if md.all_random else torch.ones(md.num_reqs, device=x.device).index_copy_(
                0, md.random_rows, rs.temperature)
            scaled.div_(temps.unsqueeze(1))
        scaled = processors.apply_argmax_invariant(scaled)
        rows = scaled if md.all_random else scaled.index_select(0, md.random_rows)
        tokens = _sample_random(rows, dataclasses.replace(rs, temperature=None), owned=True)
        if md.all_random:
            return tokens
        out[md.random_rows] = tokens
        return out


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                            num_logprobs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                        torch.Tensor]:
    """Raw log-probabilities of the prompt tokens (vLLM's ``prompt_logprobs``).

    Args:
        logits: [T, V] float32 logits at positions ``p .. p+T-1``.
        target_ids: [T] int64, the token at the following position of each row.
        num_logprobs: k top entries per row (0 for none).
    Returns:
        (target_logprobs [T] float32, target_ranks [T] int64 1-based, topk_ids [T, k] int64,
        topk_logprobs [T, k] float32), top entries most likely first.
    Raises:
        ValueError: if the shapes disagree or ``num_logprobs`` < 0.
    """
    if logits.dim() != 2 or target_ids.shape != (logits.shape[0],):
        raise ValueError(f"logits must be [T, V] and target_ids [T], got {list(logits.shape)} "
                         f"and {list(target_ids.shape)}")
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs must be >= 0, got {num_logprobs}")
    with torch.inference_mode():
        logits = logits.float()
        lse = logits.logsumexp(dim=-1, keepdim=True)  # [T, 1]
        target_logit = logits.gather(1, target_ids.long().unsqueeze(1))  # [T, 1]
        ranks = (logits > target_logit).sum(dim=-1) + 1
        k = min(num_logprobs, logits.shape[1])
        top_vals, top_ids = logits.topk(k, dim=-1)
        return (target_logit - lse).squeeze(1), ranks, top_ids, top_vals - lse


def _apply_adjustments(logits: torch.Tensor, adj: LogitsAdjustments | None,
                       processors: BatchLogitsProcessors | None = None) -> torch.Tensor:
    """The logits after masks, bias, per-request processors, the class-based processors that can
    change an argmax, penalties, then the Model Runner V2 processors (vLLM's V2 order); a new
    tensor unless there is nothing to do.

    Args:
        logits: [N, V] float32 raw logits (not modified).
        adj: the step's adjustments, None for none.
        processors: the class-based processors (their non-argmax-invariant ones run here).
    """
    early = processors is not None and processors.non_argmax_invariant
    v2 = processors.v2 if processors is not None else None
    if adj is None and not early and v2 is None:
        return logits
    x = logits.clone()  # [N, V], contiguous
    if adj is None:
        x = processors.apply_non_argmax_invariant(x) if early else x
        return v2.apply(x) if v2 is not None else x
    flat = x.view(-1)  # [N * V]; keys are row * V + token
    if adj.allowed_rows is not None:
        rows = x.index_select(0, adj.allowed_rows).masked_fill_(~adj.allowed_mask, _NEG_INF)
        x.index_copy_(0, adj.allowed_rows, rows)
    if adj.mask_keys is not None:
        flat.index_fill_(0, adj.mask_keys, _NEG_INF)
    if adj.bias_keys is not None:
        flat.index_add_(0, adj.bias_keys, adj.bias_values)
    for row, row_processors, output_ids in adj.logits_processors:
        values = x[row]
        for proc in row_processors:
            values = proc(output_ids, values)
        x[row] = values
    if early:
        x = processors.apply_non_argmax_invariant(x).contiguous()
        flat = x.view(-1)
    if adj.repetition_keys is not None:
        vals = flat[adj.repetition_keys]
        pen = adj.repetition_penalties
        flat[adj.repetition_keys] = torch.where(vals > 0, vals / pen, vals * pen)
    if adj.penalty_keys is not None:
        flat.index_add_(0, adj.penalty_keys, adj.penalty_deltas)
    if v2 is not None:   # Model Runner V2 processors: after the penalties, before temperature
        x = v2.apply(x)
    return x


def _draw_uniforms(rs: RandomSampling, num_rows: int, device) -> torch.Tensor:
    """[R] float64 uniforms in [0, 1): seeded rows from their own generator (one draw each),
    the others from one draw of the engine's default generator (or the global RNG)."""
    if not rs.generators:
        return torch.rand(num_rows, dtype=torch.float64, device=device, generator=rs.default_generator)
    u = torch.empty(num_rows, dtype=torch.float64, device=device)
    unseeded = [j for j in range(num_rows) if j not in rs.generators]
    if unseeded:
        u[torch.tensor(unseeded, dtype=torch.int64, device=device)] = torch.rand(
            len(unseeded), dtype=torch.float64, device=device, generator=rs.default_generator)
    for j, gen in rs.generators.items():
        u[j] = torch.rand(1, dtype=torch.float64, device=device, generator=gen)[0]
    return u


def _sample_random(x: torch.Tensor, rs: RandomSampling, owned: bool) -> torch.Tensor:
    """[R] int64 tokens of the random rows; the watermarked ones (``rs.watermark``) take the
    keyed Gumbel-max draw instead of the uniform one (which they still draw, so a seeded row's
    generator advances as without the watermark).

    Args:
        x: [R, V] float32 processed logits of the random rows.
        rs: their parameters.
        owned: True when ``x`` may be modified in place.
    """
    if rs.temperature is not None:
        x = x.div_(rs.temperature.unsqueeze(1)) if owned else x / rs.temperature.unsqueeze(1)
        owned = True
    if rs.min_p is not None:
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p); log(0) = -inf masks nothing.
        threshold = x.amax(dim=-1, keepdim=True) + rs.min_p.log().unsqueeze(1)  # [R, 1]
        x = x.masked_fill_(x < threshold, _NEG_INF) if owned else x.masked_fill(x < threshold,
                                                                                _NEG_INF)
    wm = rs.watermark
    watermarked = None
    if wm is not None:   # (read-only: every random row watermarked needs no copy)
        watermarked = wm.sample(x if wm.rows.numel() == x.shape[0] else x.index_select(0, wm.rows))
    out = _draw_tokens(x, rs)
    if watermarked is not None:
        out[wm.rows] = watermarked
    return out


def _draw_tokens(x: torch.Tensor, rs: RandomSampling) -> torch.Tensor:
    """[R] int64 tokens drawn by inverse CDF from ``x`` [R, V] (after temperature and min_p),
    restricted to each row's top_k / top_p."""
    num_rows = x.shape[0]
    u = _draw_uniforms(rs, num_rows, x.device)

    if rs.filtered is None:
        return _inverse_cdf(torch.softmax(x, dim=-1), u)
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    if rs.unfiltered is not None:
        out[rs.unfiltered] = _inverse_cdf(torch.softmax(x.index_select(0, rs.unfiltered), dim=-1),
                                          u[rs.unfiltered])
    xf = x if rs.unfiltered is None else x.index_select(0, rs.filtered)
    out[rs.filtered] = _sample_top_k_top_p(xf, u[rs.filtered], rs.top_k, rs.top_k_max,
                                           rs.top_k_min, rs.has_top_k, rs.any_top_k,
                                           rs.all_top_k, rs.top_p)
    return out


def _sample_top_k_top_p(x: torch.Tensor, u: torch.Tensor, top_k: torch.Tensor, top_k_max: int,
                        top_k_min: int, has_top_k: torch.Tensor, any_top_k: bool,
                        all_top_k: bool, top_p: torch.Tensor | None) -> torch.Tensor:
    """Sample rows restricted to their top_k tokens and / or top_p nucleus, without a full sort.

    Keeps, in descending order, the first ``top_k[i]`` tokens, then of those the tokens whose
    preceding mass is < ``top_p[i]`` (always the first). With top_k set, top_p applies to the
    renormalized top-k distribution (as vLLM); without, to the full distribution, and a row whose
    ``top_k[i]`` candidates hold less than ``top_p[i]`` of it is redone with more candidates, up to
    the whole vocabulary (exact either way).

    Args:
        x: [F, V] float32 logits after temperature and min_p.
        u: [F] float64 uniforms in [0, 1).
        top_k: [F] int64 candidates per row (tokens); ``top_k_max`` / ``top_k_min`` its max / min.
        has_top_k: [F] bool, the row set top_k; ``any_top_k`` / ``all_top_k`` its any / all.
        top_p: [F] float64 nucleus mass (+inf = off), or None when no row uses it.
    Returns:
        [F] int64 token ids.
    """
    vocab_size = x.shape[1]
    vals, idx = x.topk(top_k_max, dim=-1)  # [F, K], descending
    if top_k_min < top_k_max:
        pos = torch.arange(top_k_max, device=x.device)
        vals.masked_fill_(pos.unsqueeze(0) >= top_k.unsqueeze(1), _NEG_INF)
    # Normalizer: within the top-k when the row set top_k, else over the whole row.
    if all_top_k:
        lse = vals.logsumexp(dim=-1)
    elif not any_top_k:
        lse = x.logsumexp(dim=-1)
    else:
        lse = torch.where(has_top_k, vals.logsumexp(dim=-1), x.logsumexp(dim=-1))
    probs = (vals - lse.unsqueeze(1)).exp().double()  # [F, K]; 0 where masked

    fallback = None
    if top_p is not None:
        cum = probs.cumsum(dim=-1)  # [F, K]
        remove = (cum - probs) >= top_p.unsqueeze(1)
        remove[:, 0] = False
        probs.masked_fill_(remove, 0.0)
        if not all_top_k and top_k_min < vocab_size:
            fb = (~has_top_k) & (top_k < vocab_size) & (cum[:, -1] < top_p)
            if bool(fb.any()):
                fallback = fb.nonzero().squeeze(1)

    tokens = idx.gather(1, _inverse_cdf(probs, u).unsqueeze(1)).squeeze(1)
    if fallback is not None:
        # The candidates hold too little mass: retry with _TOP_P_CAP_GROWTH x more, and at last
        # the whole row (a full sort; rare for a language model's distribution).
        m = fallback.numel()
        cap = min(vocab_size, top_k_max * _TOP_P_CAP_GROWTH)
        tokens[fallback] = _sample_top_k_top_p(
            x.index_select(0, fallback), u[fallback],
            torch.full((m,), cap, dtype=torch.int64, device=x.device), cap, cap,
            torch.zeros(m, dtype=torch.bool, device=x.device), False, False, top_p[fallback])
    return tokens


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn with probability proportional to ``weights`` per row.

    Args:
        weights: [M, W] non-negative (any float dtype; summed in float64).
        u: [M] float64 uniforms in [0, 1).
    Returns:
        [M] int64 column indices; a zero-weight column is never returned unless the whole row is 0.
    """
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # [M, W]
    total = cdf[:, -1:]  # [M, 1]
    # Target in [0, total): the first column with cdf > target has positive weight.
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_(max=weights.shape[1] - 1)
