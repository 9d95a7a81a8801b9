"""How far a cheaper engine setting moves the model's outputs (``pagedllm bench accuracy``).

The same prompts go through a reference engine (float32, no quantization: the engine whose
greedy output matches transformers) and a candidate engine (the given settings, e.g.
``--quantization int8`` or ``--dtype bfloat16``), one after the other in this process. Each
request asks for greedy decoding of ``output_len`` tokens (EOS ignored) and for the log-probability
of every prompt token under teacher forcing (``prompt_logprobs=1``, which also gives each position's
top-1 token). Reported, over all scored prompt tokens (every prompt token but the first):

- ``perplexity`` and ``reference_perplexity``: ``exp(mean negative log-likelihood)``, and
  ``perplexity_ratio`` (candidate / reference);
- ``mean_abs_logprob_diff``: mean |log p_candidate(t) - log p_reference(t)| of the prompt tokens (nats);
- ``top1_agreement``: the fraction of prompt positions whose most likely next token is the same;
- ``greedy_exact_fraction``: requests whose ``output_len`` greedy tokens are all the same, and
  ``mean_greedy_prefix_tokens``: tokens generated before the first difference, averaged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RequestScore:
    """One request under one engine.

    Attributes:
        token_logprobs: log p(prompt[i] | prompt[:i]) for i >= 1 (natural log).
        top1: the most likely token id at each of those positions.
        output_token_ids: the greedy continuation.
    """

    token_logprobs: list[float]
    top1: list[int]
    output_token_ids: list[int]


def score_prompts(llm, prompts: list[list[int]], output_len: int) -> list[RequestScore]:
    """Teacher-forced prompt log-probabilities and a greedy continuation for each prompt.

    Args:
        llm: a ``pagedllm.LLM``.
        prompts: token ids, each at least 2 tokens.
        output_len: tokens to generate per prompt (>= 1).
    Raises:
        ValueError: for a prompt shorter than 2 tokens, or as ``LLM.generate``.
    """
    from pagedllm.sampling_params import SamplingParams

    if any(len(p) < 2 for p in prompts):
        raise ValueError("every prompt needs at least 2 tokens to score")
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    scores = []
    for out in outputs:
        positions = list(zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:]))
        scores.append(RequestScore(
            token_logprobs=[entries[token].logprob for entries, token in positions],
            top1=[next(t for t, lp in entries.items() if lp.rank == 1) for entries, _ in positions],
            output_token_ids=list(out.outputs[0].token_ids)))
    return scores


def compare_scores(reference: list[RequestScore], candidate: list[RequestScore]) -> dict:
    """The metrics of the module docstring for two engines' scores of the same prompts.

    Raises:
        ValueError: if the two lists do not describe the same prompts (lengths differ).
    """
    if len(reference) != len(candidate) or any(
            len(r.token_logprobs) != len(c.token_logprobs) for r, c in zip(reference, candidate)):
        raise ValueError("reference and candidate scores are not of the same prompts")
    ref_lp = [x for r in reference for x in r.token_logprobs]
    cand_lp = [x for c in candidate for x in c.token_logprobs]
    n = len(ref_lp)
    prefix = []
    for r, c in zip(reference, candidate):
        k = 0
        while k < min(len(r.output_token_ids), len(c.output_token_ids)) and r.output_token_ids[k] == c.output_token_ids[k]:
            k += 1
        prefix.append(k)
    ref_ppl = math.exp(-sum(ref_lp) / n)
    ppl = math.exp(-sum(cand_lp) / n)
    return {
        "num_requests": len(reference),
        "num_scored_tokens": n,
        "reference_perplexity": ref_ppl,
        "perplexity": ppl,
        "perplexity_ratio": ppl / ref_ppl,
        "mean_abs_logprob_diff": sum(abs(a - b) for a, b in zip(ref_lp, cand_lp)) / n,
        "top1_agreement": sum(a == b for r, c in zip(reference, candidate) for a, b in zip(r.top1, c.top1)) / n,
        "greedy_exact_fraction": sum(r.output_token_ids == c.output_token_ids
                                     for r, c in zip(reference, candidate)) / len(reference),
        "mean_greedy_prefix_tokens": sum(prefix) / len(prefix),
    }


ACCURACY_TABLE_KEYS = ("num_requests", "num_scored_tokens", "reference_perplexity", "perplexity",
                       "perplexity_ratio", "mean_abs_logprob_diff", "top1_agreement", "greedy_exact_fraction",
                       "mean_greedy_prefix_tokens")
