"""Seeded benchmark workloads: random, ShareGPT-like (long-tailed) and JSONL files.

Every loader returns a list of :class:`BenchRequest` and is deterministic for a given seed (a
``numpy.random.Generator`` per call, no global state). Lengths are in tokens. No torch here.

- ``random``: vLLM's random dataset: lengths uniform in ``[len * (1 - r), len * (1 + r)]``,
  prompts of uniformly random token ids.
- ``sharegpt-like``: a synthetic stand-in for ShareGPT (no download): prompt and output lengths
  drawn from log-normal distributions (a long right tail, as real chat traffic has), median =
  ``input_len`` / ``output_len``, clipped to ``[4, 8 x median]``.
- ``prefix-sharing``: one shared random "system prompt" of ``PREFIX_SHARING_SYSTEM_LEN`` tokens
  followed by a distinct random question of 50-300 tokens, 64-128 output tokens (the prefix-caching
  workload; ``--input-len`` / ``--output-len`` do not apply).
- ``multi-turn``: simulated users each sending ``MULTI_TURN_NUM_TURNS`` turns; each prompt is the
  whole conversation so far (earlier user messages and synthetic assistant replies of the earlier
  turns' ``max_tokens`` length). A user's turns share ``conversation_id`` and are sent one after
  the other by ``bench serving``.
- a ``.jsonl`` file: one ``{"prompt": str | [int, ...], "max_tokens": int}`` object per line,
  optional ``"prompt_len"``.
- ``workload``: the project's 64-request workload, shipped as package data
  (``pagedllm/data/workload.jsonl``, all three fields per line).
- ``grounded``: 33 input-grounded requests (edits, quotes and code completions whose outputs
  quote their prompts: what speculative decoding's prompt lookup is for), made from the
  repository's own text by ``benchmarks/make_grounded_dataset.py`` (``pagedllm/data/grounded.jsonl``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Token ids below this are skipped by the random prompts (pad/eos/bos/unk sit there in most vocabularies).
MIN_RANDOM_TOKEN_ID = 10
# ShareGPT-like spread: sigma of log(length); ~1 gives p99/median of ~10, as chat logs show.
SHAREGPT_INPUT_SIGMA = 1.0
SHAREGPT_OUTPUT_SIGMA = 0.8
SHAREGPT_MAX_OVER_MEDIAN = 8
SHAREGPT_MIN_LEN = 4
# prefix-sharing workload: shared prompt, question and output lengths in tokens.
PREFIX_SHARING_SYSTEM_LEN = 1000
PREFIX_SHARING_QUESTION_LEN = (50, 300)
PREFIX_SHARING_OUTPUT_LEN = (64, 128)
MULTI_TURN_NUM_TURNS = 4


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request.

    Attributes:
        prompt: text, or token ids (sent to the engine as ``prompt_token_ids``).
        prompt_len: prompt tokens; for text prompts the file's count (``None`` when the file
            gives none; the engine's tokenizer has the last word).
        max_tokens: tokens to generate (>= 1); the benchmarks set ``ignore_eos``, so a request
            makes exactly this many.
        conversation_id: requests with the same id are turns of one conversation, sent in
            order, each after the previous one finished (``None``: independent).
    """

    prompt: str | list[int]
    prompt_len: int | None
    max_tokens: int
    conversation_id: int | None = None


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _check_vocab(vocab_size: int) -> None:
    """Raises ValueError unless the vocabulary has ids above ``MIN_RANDOM_TOKEN_ID`` to draw from."""
    if vocab_size <= MIN_RANDOM_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {MIN_RANDOM_TOKEN_ID}, got {vocab_size}")


def _clip_to_model_len(prompt_len: int, max_tokens: int, max_model_len: int | None) -> tuple[int, int]:
    """Shrink the output (then the prompt) so prompt + output <= max_model_len."""
    if max_model_len is None or prompt_len + max_tokens <= max_model_len:
        return prompt_len, max_tokens
    max_tokens = max(1, max_model_len - prompt_len)
    prompt_len = min(prompt_len, max_model_len - max_tokens)
    return prompt_len, max_tokens


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                    range_ratio: float = 0.0, seed: int = 0,
                    max_model_len: int | None = None) -> list[BenchRequest]:
    """Prompts of random token ids with uniformly spread lengths (vLLM's ``random`` dataset).

    Args:
        num_prompts: requests to make (>= 1).
        input_len, output_len: mean prompt / output length in tokens (>= 1).
        vocab_size: token ids are drawn uniformly from ``[MIN_RANDOM_TOKEN_ID, vocab_size)``.
        range_ratio: r in [0, 1): lengths uniform in ``[len * (1 - r), len * (1 + r)]``.
        seed: the generator's seed.
        max_model_len: if given, outputs (then prompts) are shortened to fit it.
    Raises:
        ValueError: for a non-positive count or length, r outside [0, 1), or a vocabulary too
            small to draw from.
    """
    _check_positive("num_prompts", num_prompts)
    _check_positive("input_len", input_len)
    _check_positive("output_len", output_len)
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    in_lo, in_hi = max(1, int(input_len * (1 - range_ratio))), max(1, int(input_len * (1 + range_ratio)))
    out_lo, out_hi = max(1, int(output_len * (1 - range_ratio))), max(1, int(output_len * (1 + range_ratio)))
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    requests = []
    for p_len, o_len in zip(in_lens.tolist(), out_lens.tolist()):
        p_len, o_len = _clip_to_model_len(p_len, o_len, max_model_len)
        ids = rng.integers(MIN_RANDOM_TOKEN_ID, vocab_size, size=p_len).tolist()
        requests.append(BenchRequest(prompt=ids, prompt_len=p_len, max_tokens=o_len))
    return requests


def sharegpt_like_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                           seed: int = 0, max_model_len: int | None = None) -> list[BenchRequest]:
    """Random-token prompts whose lengths follow a long-tailed (log-normal) spread like ShareGPT.

    Prompt and output lengths are independent log-normals with medians ``input_len`` and
    ``output_len`` (sigma ``SHAREGPT_INPUT_SIGMA`` / ``SHAREGPT_OUTPUT_SIGMA``), rounded and
    clipped to ``[SHAREGPT_MIN_LEN, SHAREGPT_MAX_OVER_MEDIAN x median]``.

    Raises:
        ValueError: as :func:`random_requests`.
    """
    _check_positive("num_prompts", num_prompts)
    _check_positive("input_len", input_len)
    _check_positive("output_len", output_len)
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)

    def draw(median: int, sigma: float) -> np.ndarray:
        x = np.rint(rng.lognormal(np.log(median), sigma, size=num_prompts)).astype(np.int64)
        return np.clip(x, min(SHAREGPT_MIN_LEN, median), SHAREGPT_MAX_OVER_MEDIAN * median)

    in_lens, out_lens = draw(input_len, SHAREGPT_INPUT_SIGMA), draw(output_len, SHAREGPT_OUTPUT_SIGMA)
    requests = []
    for p_len, o_len in zip(in_lens.tolist(), out_lens.tolist()):
        p_len, o_len = _clip_to_model_len(p_len, o_len, max_model_len)
        ids = rng.integers(MIN_RANDOM_TOKEN_ID, vocab_size, size=p_len).tolist()
        requests.append(BenchRequest(prompt=ids, prompt_len=p_len, max_tokens=o_len))
    return requests


def prefix_sharing_requests(num_prompts: int, vocab_size: int, seed: int = 0,
                            system_len: int = PREFIX_SHARING_SYSTEM_LEN,
                            question_len: tuple[int, int] = PREFIX_SHARING_QUESTION_LEN,
                            output_len: tuple[int, int] = PREFIX_SHARING_OUTPUT_LEN,
                            max_model_len: int | None = None) -> list[BenchRequest]:
    """Requests sharing one random prompt prefix, each with its own random question.

    Args:
        num_prompts: requests (>= 1).
        vocab_size: token ids are drawn uniformly from ``[MIN_RANDOM_TOKEN_ID, vocab_size)``.
        seed: the generator's seed.
        system_len: tokens of the shared prefix (>= 1).
        question_len, output_len: inclusive ``(low, high)`` ranges, drawn uniformly per request.
        max_model_len: if given, outputs (then prompts, from the question's end) are shortened to fit.
    Raises:
        ValueError: for a non-positive count or length, an empty range, or a vocabulary too small.
    """
    _check_positive("num_prompts", num_prompts)
    _check_positive("system_len", system_len)
    for name, (lo, hi) in (("question_len", question_len), ("output_len", output_len)):
        _check_positive(name, lo)
        if hi < lo:
            raise ValueError(f"{name} range must have low <= high, got {(lo, hi)}")
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    system = rng.integers(MIN_RANDOM_TOKEN_ID, vocab_size, size=system_len).tolist()
    q_lens = rng.integers(question_len[0], question_len[1] + 1, size=num_prompts).tolist()
    o_lens = rng.integers(output_len[0], output_len[1] + 1, size=num_prompts).tolist()
    requests = []
    for q_len, o_len in zip(q_lens, o_lens):
        ids = system + rng.integers(MIN_RANDOM_TOKEN_ID, vocab_size, size=q_len).tolist()
        p_len, o_len = _clip_to_model_len(len(ids), o_len, max_model_len)
        requests.append(BenchRequest(prompt=ids[:p_len], prompt_len=p_len, max_tokens=o_len))
    return requests


def multi_turn_requests(num_users: int, input_len: int, output_len: int, vocab_size: int,
                        num_turns: int = MULTI_TURN_NUM_TURNS, seed: int = 0,
                        max_model_len: int | None = None) -> list[BenchRequest]:
    """Conversations of ``num_turns`` turns; each turn's prompt is the conversation so far.

    Turn ``k``'s prompt = user message 0, reply 0, ..., user message k (random tokens); user
    messages are uniform in ``[input_len / 2, 3 * input_len / 2]`` tokens, replies (and each
    turn's ``max_tokens``) in ``[output_len / 2, 3 * output_len / 2]``. The reply in a later
    prompt is synthetic (the earlier turn's ``max_tokens`` random tokens), so the dataset is fixed
    whatever the server answers; the earlier prompt is a prefix of the later one.

    Returns:
        ``num_users * num_turns`` requests, user by user, turns in order; ``conversation_id`` =
        the user's index. Conversations that would exceed ``max_model_len`` stop early.
    Raises:
        ValueError: for a non-positive count or length, or a vocabulary too small.
    """
    _check_positive("num_users", num_users)
    _check_positive("num_turns", num_turns)
    _check_positive("input_len", input_len)
    _check_positive("output_len", output_len)
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)

    def length(mean: int) -> int:
        return int(rng.integers(max(1, mean // 2), max(1, mean * 3 // 2) + 1))

    def tokens(n: int) -> list[int]:
        return rng.integers(MIN_RANDOM_TOKEN_ID, vocab_size, size=n).tolist()

    requests = []
    for user in range(num_users):
        history: list[int] = []
        for _turn in range(num_turns):
            prompt = history + tokens(length(input_len))
            max_tokens = length(output_len)
            if max_model_len is not None and len(prompt) + max_tokens > max_model_len:
                break
            requests.append(BenchRequest(prompt=prompt, prompt_len=len(prompt), max_tokens=max_tokens,
                                         conversation_id=user))
            history = prompt + tokens(max_tokens)
    return requests


def load_jsonl_requests(path: str, num_prompts: int | None = None) -> list[BenchRequest]:
    """Read ``{"prompt": str | [int, ...], "max_tokens": int, "prompt_len"?: int}`` lines.

    Blank lines are skipped.

    Args:
        path: the JSONL file.
        num_prompts: keep the first this many (None = all).
    Raises:
        ValueError: naming ``path:line`` for a line that is not JSON, not an object, lacks
            ``prompt`` or ``max_tokens``, or has a wrong type or a value < 1; also when the file
            is missing, empty, or holds fewer than ``num_prompts`` requests.
    """
    if not os.path.isfile(path):
        raise ValueError(f"dataset file {path!r} does not exist")
    if num_prompts is not None:
        _check_positive("num_prompts", num_prompts)
    requests: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e})") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            for key in ("prompt", "max_tokens"):
                if key not in obj:
                    raise ValueError(f"{where}: missing field {key!r}")
            prompt = obj["prompt"]
            if isinstance(prompt, list):
                if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                         for t in prompt):
                    raise ValueError(f"{where}: prompt must be a non-empty string or list of token ids >= 0")
            elif not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{where}: prompt must be a non-empty string or list of token ids, "
                                 f"got {type(prompt).__name__}")
            max_tokens = obj["max_tokens"]
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise ValueError(f"{where}: max_tokens must be an int >= 1, got {max_tokens!r}")
            prompt_len = obj.get("prompt_len", len(prompt) if isinstance(prompt, list) else None)
            if prompt_len is not None and (not isinstance(prompt_len, int) or isinstance(prompt_len, bool)
                                           or prompt_len < 1):
                raise ValueError(f"{where}: prompt_len must be an int >= 1, got {prompt_len!r}")
            requests.append(BenchRequest(prompt=prompt, prompt_len=prompt_len, max_tokens=max_tokens))
            if num_prompts is not None and len(requests) == num_prompts:
                break
    if not requests:
        raise ValueError(f"dataset file {path!r} holds no requests")
    if num_prompts is not None and len(requests) < num_prompts:
        raise ValueError(f"dataset file {path!r} holds {len(requests)} requests, fewer than "
                         f"num_prompts={num_prompts}")
    return requests


def resample_lengths(requests: list[BenchRequest], num: int, seed: int = 0) -> list[tuple[int, int]]:
    """Draw ``num`` (prompt_len, max_tokens) pairs, with replacement, from ``requests``' rows.

    Whole rows are drawn, so the joint spread of the workload is kept.

    Raises:
        ValueError: if ``num < 1``, ``requests`` is empty, or a row has no ``prompt_len``.
    """
    _check_positive("num", num)
    if not requests:
        raise ValueError("cannot resample from an empty workload")
    missing = [i for i, r in enumerate(requests) if r.prompt_len is None]
    if missing:
        raise ValueError(f"{len(missing)} workload rows have no prompt_len (first: row {missing[0]})")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(requests), size=num)
    return [(int(requests[i].prompt_len), int(requests[i].max_tokens)) for i in idx.tolist()]


DATASET_CHOICES = ("random", "sharegpt-like", "prefix-sharing", "multi-turn")
# JSONL workloads shipped inside the package, by ``--dataset`` name.
NAMED_DATASET_FILES = {name: str(Path(__file__).resolve().parent.parent / "data" / f"{file}.jsonl")
                       for name, file in (("workload", "workload"), ("grounded", "grounded"))}


def dataset_file(dataset: str) -> str:
    """The JSONL file ``--dataset`` names: a shipped workload's path (``NAMED_DATASET_FILES``), else
    ``dataset`` itself as a path."""
    return NAMED_DATASET_FILES.get(dataset, dataset)


def check_dataset(dataset: str, num_prompts: int | None = None) -> None:
    """Fail fast (before a model loads) on a ``--dataset`` that names no generator and no readable
    JSONL file; a file is parsed whole, so a malformed line fails here too.

    Raises:
        ValueError: naming the dataset and the choices, or the loader's ``path:line`` error.
    """
    if dataset in DATASET_CHOICES:
        return
    path = dataset_file(dataset)
    if not os.path.isfile(path):
        raise ValueError(f"--dataset {dataset!r} is neither one of {DATASET_CHOICES + tuple(NAMED_DATASET_FILES)} "
                         "nor an existing JSONL file")
    load_jsonl_requests(path, num_prompts)


def build_requests(dataset: str, num_prompts: int | None, input_len: int, output_len: int,
                   range_ratio: float, seed: int, vocab_size: int | None,
                   max_model_len: int | None = None) -> list[BenchRequest]:
    """``--dataset`` dispatch: ``random``, ``sharegpt-like``, ``prefix-sharing``, ``multi-turn``,
    a shipped workload name or a JSONL path.

    Args:
        num_prompts: None = all rows of a file, or 64 generated requests (``multi-turn``: 64
            requests = 16 users x 4 turns; ``num_prompts`` counts requests, rounded up to users).
        vocab_size: needed for the generated datasets.
    Raises:
        ValueError: as the loaders; also for a generated dataset without ``vocab_size``.
    """
    if dataset in DATASET_CHOICES:
        if vocab_size is None:
            raise ValueError(f"--dataset {dataset} needs a tokenizer (for the vocabulary size)")
        n = 64 if num_prompts is None else num_prompts
        if dataset == "random":
            return random_requests(n, input_len, output_len, vocab_size, range_ratio, seed, max_model_len)
        if dataset == "prefix-sharing":
            return prefix_sharing_requests(n, vocab_size, seed, max_model_len=max_model_len)
        if dataset == "multi-turn":
            num_users = -(-n // MULTI_TURN_NUM_TURNS)
            return multi_turn_requests(num_users, input_len, output_len, vocab_size, seed=seed,
                                       max_model_len=max_model_len)
        return sharegpt_like_requests(n, input_len, output_len, vocab_size, seed, max_model_len)
    return load_jsonl_requests(dataset_file(dataset), num_prompts)
