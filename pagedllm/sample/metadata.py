"""Per-step sampling tensors for the rows that sample this step (vLLM V1's ``SamplingMetadata``).

``SamplingMetadata.build`` turns one ``SamplingParams`` per sampling row into tensors, building only
what some row uses: a batch of plain greedy requests builds nothing but flags. Token-level edits
(masks, biases, penalties) are stored as flat indices ``row * vocab_size + token_id`` into the
``[num_reqs * vocab_size]`` view of the logits, so they cost O(tokens involved), never O(vocab) per
row; only ``allowed_token_ids`` needs a ``[rows, vocab]`` bool mask.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from pagedllm.sampling_params import LogitsProcessor, SamplingParams

if TYPE_CHECKING:
    from pagedllm.watermarking.sampling import WatermarkRows, WatermarkSampler

# top_p without top_k: the nucleus is looked for among the TOP_P_CANDIDATE_CAP most likely tokens
# (one torch.topk); only rows whose top-cap mass is below top_p fall back to a full sort.
TOP_P_CANDIDATE_CAP = 1024


@dataclass
class LogitsAdjustments:
    """Edits applied to the logits of all rows (greedy and random) before sampling, in this order.

    All ``*_keys`` are int64 flat indices ``row * vocab_size + token_id`` into ``logits.view(-1)``.

    Attributes:
        allowed_rows: [A] int64 rows that set ``allowed_token_ids``, or None.
        allowed_mask: [A, vocab_size] bool, True where the token is allowed, or None.
        mask_keys: [M] ids set to -inf: ``bad_words_token_ids``, and EOS + ``stop_token_ids`` of
            rows with fewer than ``min_tokens`` output tokens; or None.
        bias_keys, bias_values: [B] int64 / [B] float32, ``logit_bias`` added to the logit, or None.
        logits_processors: (row, processors, output_token_ids) per row with processors.
        repetition_keys, repetition_penalties: [P] int64 / [P] float32, one per distinct
            (row, token) of prompt + output in rows with ``repetition_penalty != 1``; the logit is
            divided by the penalty if positive, multiplied if not (CTRL, Keskar et al. 2019).
        penalty_keys, penalty_deltas: [Q] int64 / [Q] float32, one per distinct (row, token) of the
            output in rows with presence or frequency penalties; the delta
            ``-(frequency_penalty * count + presence_penalty)`` is added (OpenAI's definition).
    """

    allowed_rows: torch.Tensor | None = None
    allowed_mask: torch.Tensor | None = None
    mask_keys: torch.Tensor | None = None
    bias_keys: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    logits_processors: list[tuple[int, list[LogitsProcessor], list[int]]] = field(
        default_factory=list)
    repetition_keys: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    penalty_keys: torch.Tensor | None = None
    penalty_deltas: torch.Tensor | None = None


@dataclass
class RandomSampling:
    """Parameters of the rows that sample at random (temperature > 0), indexed 0..R-1 in the
    order of ``SamplingMetadata.random_rows``.

    Attributes:
        temperature: [R] float32, or None when every random row uses temperature 1.
        min_p: [R] float32 (0 = off), or None when no row uses it.
        filtered: [F] int64 random-row indices with top_k or top_p, or None when none.
        unfiltered: [U] int64 random-row indices with neither, or None when none.
        top_k: [F] int64 candidates kept per filtered row: ``top_k``, or for top_p alone
            ``min(TOP_P_CANDIDATE_CAP, vocab_size)`` (tokens).
        top_k_max, top_k_min: max / min of ``top_k`` (Python ints, no device sync).
        has_top_k: [F] bool, True where the row set ``top_k`` (top_p then renormalizes within it).
        any_top_k, all_top_k: whether some / every filtered row set ``top_k`` (no device sync).
        top_p: [F] float64 nucleus mass, +inf where off; None when no filtered row uses top_p.
        generators: random-row index -> the request's seeded ``torch.Generator``.
        default_generator: the engine's generator for the unseeded rows (None = global RNG).
        watermark: the watermarked rows among them (``watermarking/sampling.py``), or None.
    """

    temperature: torch.Tensor | None
    min_p: torch.Tensor | None
    filtered: torch.Tensor | None
    unfiltered: torch.Tensor | None
    top_k: torch.Tensor | None
    top_k_max: int
    top_k_min: int
    has_top_k: torch.Tensor | None
    any_top_k: bool
    all_top_k: bool
    top_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    default_generator: torch.Generator | None = None
    watermark: WatermarkRows | None = None


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step, one row per request that samples.

    Attributes:
        num_reqs: rows (N).
        vocab_size: logits width (tokens).
        all_greedy: every row picks the argmax (no random tensors built).
        all_random: every row samples at random.
        greedy_rows: [G] int64 greedy rows in a mixed batch, else None.
        random_rows: [R] int64 random rows in a mixed batch, else None.
        random: parameters of the random rows, None when ``all_greedy``.
        adjustments: masks, biases, processors and penalties, None when no row uses any.
        max_num_logprobs: most ``logprobs`` asked by any row (K of the top-k), None if none asked.
        logprob_rows: [L] int64 rows whose sampled token needs its log-probability (``logprobs``
            asked, or ``best_of`` > ``n``, which ranks samples by cumulative logprob), or None
            when every row does. The log-softmax normaliser over the whole vocabulary costs about
            as much as the argmax and the sampling together, so other rows skip it (as vLLM,
            which reports ``cumulative_logprob`` only when logprobs are asked for).
    """

    num_reqs: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy_rows: torch.Tensor | None
    random_rows: torch.Tensor | None
    random: RandomSampling | None
    adjustments: LogitsAdjustments | None
    max_num_logprobs: int | None
    logprob_rows: torch.Tensor | None = None

    @classmethod
    def build(cls, params: list[SamplingParams], output_token_ids: list[list[int]],
              prompt_token_ids: list[list[int]], generators: list[torch.Generator | None] | None,
              vocab_size: int, device, default_generator: torch.Generator | None = None,
              watermark: WatermarkSampler | None = None) -> "SamplingMetadata":
        """Build the tensors for one step.

        Args:
            params: one ``SamplingParams`` per row (request that samples this step), batch order.
            output_token_ids: per row, the tokens generated so far (read, not kept, except by
                logits processors, which get the list itself).
            prompt_token_ids: per row, the prompt (for ``repetition_penalty``).
            generators: per row, the request's seeded generator (see ``make_generator``) or None
                for the shared global RNG; None means no row is seeded. Ignored on greedy rows.
            vocab_size: logits width (tokens).
            device: where the tensors go (the logits' device).
            default_generator: the engine's generator for unseeded random rows (None = torch's
                global RNG).
            watermark: the engine's watermark (``WatermarkSampler``), None when it has none.
        Returns:
            The metadata; only the features some row uses have tensors.
        Token ids named by the params (``logit_bias``, ``allowed_token_ids``,
        ``bad_words_token_ids``) must lie in ``[0, vocab_size)``: ``InputProcessor.process`` checks
        them once when the request is added, not here every step.

        Raises:
            ValueError: if the per-row lists differ in length.
        """
        n = len(params)
        if generators is None:
            generators = [None] * n
        if not (len(output_token_ids) == len(prompt_token_ids) == len(generators) == n):
            raise ValueError(
                f"params, output_token_ids, prompt_token_ids and generators must have one entry "
                f"per row, got {n}, {len(output_token_ids)}, {len(prompt_token_ids)}, "
                f"{len(generators)}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")

        greedy = [p.sampling_type_greedy for p in params]
        random_idx = [i for i in range(n) if not greedy[i]]
        all_greedy = not random_idx
        all_random = len(random_idx) == n
        mixed = not all_greedy and not all_random
        greedy_rows = random_rows = None
        if mixed:
            greedy_rows = torch.tensor([i for i in range(n) if greedy[i]], dtype=torch.int64,
                                       device=device)
            random_rows = torch.tensor(random_idx, dtype=torch.int64, device=device)

        random = None
        if not all_greedy:
            random = _build_random(params, random_idx, generators, vocab_size, device, default_generator)
            if watermark is not None:
                random.watermark = watermark.rows(params, output_token_ids, prompt_token_ids, random_idx,
                                                  vocab_size, device)

        adjustments = _build_adjustments(params, output_token_ids, prompt_token_ids, vocab_size,
                                         device)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        needs = [i for i, p in enumerate(params) if p.needs_sampled_logprobs]
        if len(needs) == n:
            logprob_rows = None
        else:
            logprob_rows = torch.tensor(needs, dtype=torch.int64, device=device) if needs else _no_rows(device)
        return cls(num_reqs=n, vocab_size=vocab_size, all_greedy=all_greedy, all_random=all_random,
                   greedy_rows=greedy_rows, random_rows=random_rows, random=random,
                   adjustments=adjustments, max_num_logprobs=max(asked) if asked else None,
                   logprob_rows=logprob_rows)


@functools.cache
def _no_rows(device) -> torch.Tensor:
    """A [0] int64 tensor on ``device``, shared by the steps where no row needs its sampled
    logprob (plain greedy decoding: one tensor less to build per step); read, never written."""
    return torch.empty(0, dtype=torch.int64, device=device)


def _build_random(params: Sequence[SamplingParams], random_idx: list[int],
                  generators: Sequence[torch.Generator | None], vocab_size: int,
                  device, default_generator=None) -> RandomSampling:
    """Tensors of the random rows ``random_idx`` (see ``RandomSampling``)."""
    rp = [params[i] for i in random_idx]
    temps = [p.temperature for p in rp]
    temperature = None
    if any(t != 1.0 for t in temps):
        temperature = torch.tensor(temps, dtype=torch.float32, device=device)
    min_p = None
    if any(p.min_p > 0.0 for p in rp):
        min_p = torch.tensor([p.min_p for p in rp], dtype=torch.float32, device=device)

    # top_k >= vocab_size keeps everything: treat it as off.
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in rp]
    use_top_p = [p.top_p < 1.0 for p in rp]
    filtered = [j for j in range(len(rp)) if top_ks[j] > 0 or use_top_p[j]]
    unfiltered = [j for j in range(len(rp)) if not (top_ks[j] > 0 or use_top_p[j])]
    cap = min(TOP_P_CANDIDATE_CAP, vocab_size)
    k_eff = [top_ks[j] if top_ks[j] > 0 else cap for j in filtered]
    top_k = has_top_k = top_p = None
    if filtered:
        top_k = torch.tensor(k_eff, dtype=torch.int64, device=device)
        has_top_k = torch.tensor([top_ks[j] > 0 for j in filtered], dtype=torch.bool, device=device)
        if any(use_top_p[j] for j in filtered):
            top_p = torch.tensor([rp[j].top_p if use_top_p[j] else float("inf") for j in filtered],
                                 dtype=torch.float64, device=device)

    def _index(rows: list[int]) -> torch.Tensor | None:
        return torch.tensor(rows, dtype=torch.int64, device=device) if rows else None

    gens = {j: generators[i] for j, i in enumerate(random_idx) if generators[i] is not None}
    return RandomSampling(temperature=temperature, min_p=min_p, filtered=_index(filtered),
                          unfiltered=_index(unfiltered), top_k=top_k,
                          top_k_max=max(k_eff) if k_eff else 0,
                          top_k_min=min(k_eff) if k_eff else 0, has_top_k=has_top_k,
                          any_top_k=any(top_ks[j] > 0 for j in filtered),
                          all_top_k=all(top_ks[j] > 0 for j in filtered), top_p=top_p,
                          generators=gens, default_generator=default_generator)


def _flat_keys(rows: list[int], ids: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """int64 ``row * vocab_size + id`` for every id of ``ids[k]`` in row ``rows[k]``, dropping ids
    outside ``[0, vocab_size)`` (e.g. a prompt id of a wider tokenizer)."""
    lengths = torch.tensor([len(x) for x in ids], dtype=torch.int64, device=device)
    row_t = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64, device=device), lengths)
    tok = torch.tensor([t for x in ids for t in x], dtype=torch.int64, device=device)
    keep = (tok >= 0) & (tok < vocab_size)
    return (row_t * vocab_size + tok)[keep]


def _allowed_ids(p: SamplingParams, num_output_tokens: int) -> list[int]:
    trace = p.trace_decode_token_ids
    if trace:
        return [trace[min(num_output_tokens, len(trace) - 1)]]
    return list(p.allowed_token_ids)


# Per row, the rules ``_build_adjustments`` applies (and ``is_plain_greedy`` reads): one place each.

def _restricts_tokens(p: SamplingParams) -> bool:
    """``allowed_token_ids`` or a trace to replay: a ``[vocab]`` mask of the tokens it may take."""
    return p.allowed_token_ids is not None or bool(p.trace_decode_token_ids)


def _masked_ids(p: SamplingParams, num_output_tokens: int) -> set[int]:
    """Token ids set to -inf: bad words, and EOS + stop ids while under ``min_tokens``."""
    ids: set[int] = set(p.bad_words_token_ids or ())
    if num_output_tokens < p.min_tokens:
        ids.update(p.eos_token_ids)
        ids.update(p.stop_token_ids or ())
    return ids


def _has_repetition_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0


def _has_output_penalties(p: SamplingParams, output_token_ids: Sequence[int]) -> bool:
    """Presence / frequency penalties with output tokens to penalise."""
    return (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and bool(output_token_ids)


def is_plain_greedy(p: SamplingParams, output_token_ids: Sequence[int]) -> bool:
    """Whether the sampler's token for this row is the plain argmax of its raw logits and nothing
    else is read from them: greedy, no sampled logprob (``logprobs``, ``best_of`` > ``n``), and
    none of ``_build_adjustments``' edits in effect (``allowed_token_ids``, trace, bad words,
    ``min_tokens`` masking, ``logit_bias``, logits processors, penalties), by the same rules.
    The model runner adds its own (grammar masks, batch-level logits processors).

    Args:
        p: the row's params.
        output_token_ids: the tokens it has generated so far.
    """
    return (p.sampling_type_greedy and not p.needs_sampled_logprobs and not _restricts_tokens(p)
            and not _masked_ids(p, len(output_token_ids)) and not p.logit_bias and not p.logits_processors
            and not _has_repetition_penalty(p) and not _has_output_penalties(p, output_token_ids))


def _build_adjustments(params: Sequence[SamplingParams], output_token_ids: Sequence[list[int]],
                       prompt_token_ids: Sequence[list[int]], vocab_size: int,
                       device) -> LogitsAdjustments | None:
    """Masks, biases, processors and penalties of all rows, or None when no row uses any."""
    adj = LogitsAdjustments()
    used = False

    # Trace replay: a row may emit only its trace's next token (logprobs stay the raw logits').
    allowed = [i for i, p in enumerate(params) if _restricts_tokens(p)]
    if allowed:
        # The input processor has checked the ids, so the flat keys stay in their rows.
        keys = _flat_keys(list(range(len(allowed))),
                          [_allowed_ids(params[i], len(output_token_ids[i])) for i in allowed], vocab_size, device)
        mask = torch.zeros(len(allowed) * vocab_size, dtype=torch.bool, device=device)
        mask[keys] = True
        adj.allowed_rows = torch.tensor(allowed, dtype=torch.int64, device=device)
        adj.allowed_mask = mask.view(len(allowed), vocab_size)
        used = True

    mask_rows: list[int] = []
    mask_ids: list[list[int]] = []
    for i, p in enumerate(params):
        ids = _masked_ids(p, len(output_token_ids[i]))
        if ids:
            mask_rows.append(i)
            mask_ids.append(sorted(ids))
    if mask_rows:
        adj.mask_keys = _flat_keys(mask_rows, mask_ids, vocab_size, device)
        used = True

    bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
    if bias_rows:
        adj.bias_keys = _flat_keys(bias_rows, [list(params[i].logit_bias) for i in bias_rows],
                                   vocab_size, device)
        adj.bias_values = torch.tensor(
            [v for i in bias_rows for v in params[i].logit_bias.values()], dtype=torch.float32,
            device=device)
        used = True

    for i, p in enumerate(params):
        if p.logits_processors:
            adj.logits_processors.append((i, list(p.logits_processors), output_token_ids[i]))
            used = True

    rep_rows = [i for i, p in enumerate(params) if _has_repetition_penalty(p)]
    if rep_rows:
        keys = _flat_keys(rep_rows, [list(prompt_token_ids[i]) + list(output_token_ids[i])
                                     for i in rep_rows], vocab_size, device)
        keys = torch.unique(keys)
        per_row = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32,
                               device=device)
        adj.repetition_keys = keys
        adj.repetition_penalties = per_row[keys // vocab_size]
        used = True

    pen_rows = [i for i, p in enumerate(params) if _has_output_penalties(p, output_token_ids[i])]
    if pen_rows:
        keys, counts = torch.unique(
            _flat_keys(pen_rows, [list(output_token_ids[i]) for i in pen_rows], vocab_size, device),
            return_counts=True)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32,
                            device=device)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32,
                            device=device)
        rows = keys // vocab_size
        adj.penalty_keys = keys
        adj.penalty_deltas = -(freq[rows] * counts.to(torch.float32) + pres[rows])
        used = True

    return adj if used else None
