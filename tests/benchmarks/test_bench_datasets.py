"""Benchmark workloads: seeded determinism, length spreads, JSONL parsing and its errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pagedllm.benchmarks.datasets import (MIN_RANDOM_TOKEN_ID, SHAREGPT_MAX_OVER_MEDIAN, BenchRequest,
                                          build_requests, check_dataset, dataset_file, load_jsonl_requests,
                                          random_requests, resample_lengths, sharegpt_like_requests)


def test_random_is_seeded_and_spread_within_range():
    a = random_requests(200, input_len=100, output_len=40, vocab_size=1000, range_ratio=0.5, seed=3)
    b = random_requests(200, input_len=100, output_len=40, vocab_size=1000, range_ratio=0.5, seed=3)
    c = random_requests(200, input_len=100, output_len=40, vocab_size=1000, range_ratio=0.5, seed=4)
    assert a == b
    assert a != c
    p = [r.prompt_len for r in a]
    o = [r.max_tokens for r in a]
    assert min(p) >= 50 and max(p) <= 150 and min(o) >= 20 and max(o) <= 60
    assert len(set(p)) > 30 and len(set(o)) > 20  # actually spread, not constant
    assert abs(np.mean(p) - 100) < 6 and abs(np.mean(o) - 40) < 3
    for r in a:
        assert len(r.prompt) == r.prompt_len
        assert all(MIN_RANDOM_TOKEN_ID <= t < 1000 for t in r.prompt)


def test_random_without_spread_is_exact():
    reqs = random_requests(5, input_len=7, output_len=3, vocab_size=50, range_ratio=0.0, seed=0)
    assert [(r.prompt_len, r.max_tokens) for r in reqs] == [(7, 3)] * 5


def test_random_respects_max_model_len():
    reqs = random_requests(50, input_len=60, output_len=60, vocab_size=100, range_ratio=0.5, seed=1,
                           max_model_len=100)
    assert all(r.prompt_len + r.max_tokens <= 100 and r.max_tokens >= 1 for r in reqs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_prompts=0), "num_prompts"), (dict(input_len=0), "input_len"),
    (dict(range_ratio=1.0), "range_ratio"), (dict(vocab_size=5), "vocab_size")])
def test_random_rejects_bad_arguments(kwargs, match):
    base = dict(num_prompts=2, input_len=4, output_len=4, vocab_size=100, range_ratio=0.0)
    with pytest.raises(ValueError, match=match):
        random_requests(**{**base, **kwargs})


def test_sharegpt_like_is_seeded_and_long_tailed():
    a = sharegpt_like_requests(2000, input_len=100, output_len=50, vocab_size=500, seed=0)
    assert a == sharegpt_like_requests(2000, input_len=100, output_len=50, vocab_size=500, seed=0)
    p = np.array([r.prompt_len for r in a])
    o = np.array([r.max_tokens for r in a])
    assert 85 <= np.median(p) <= 115 and 42 <= np.median(o) <= 58
    assert p.mean() > np.median(p) * 1.3  # right tail: mean well above median
    assert np.percentile(p, 99) > 5 * np.median(p)
    assert p.max() <= SHAREGPT_MAX_OVER_MEDIAN * 100 and p.min() >= 4
    assert o.max() <= SHAREGPT_MAX_OVER_MEDIAN * 50


def _write(tmp_path, lines):
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_jsonl_parses_text_ids_and_blank_lines(tmp_path):
    path = _write(tmp_path, [json.dumps({"prompt": "hi there", "max_tokens": 3, "prompt_len": 4}), "",
                             json.dumps({"prompt": [5, 6, 7], "max_tokens": 2}),
                             json.dumps({"prompt": "no len", "max_tokens": 1})])
    reqs = load_jsonl_requests(path)
    assert reqs == [BenchRequest("hi there", 4, 3), BenchRequest([5, 6, 7], 3, 2), BenchRequest("no len", None, 1)]
    assert load_jsonl_requests(path, num_prompts=2) == reqs[:2]
    with pytest.raises(ValueError, match="holds 3 requests, fewer than num_prompts=5"):
        load_jsonl_requests(path, num_prompts=5)


@pytest.mark.parametrize("line, match", [
    ("{not json", r":2: not JSON"),
    ('["a"]', r":2: expected a JSON object"),
    ('{"max_tokens": 3}', r":2: missing field 'prompt'"),
    ('{"prompt": "x"}', r":2: missing field 'max_tokens'"),
    ('{"prompt": "x", "max_tokens": 0}', r":2: max_tokens must be an int >= 1, got 0"),
    ('{"prompt": "x", "max_tokens": "3"}', r":2: max_tokens must be an int"),
    ('{"prompt": "", "max_tokens": 3}', r":2: prompt must be a non-empty string"),
    ('{"prompt": [1, -2], "max_tokens": 3}', r":2: prompt must be a non-empty string or list of token ids"),
    ('{"prompt": 5, "max_tokens": 3}', r":2: prompt must be"),
    ('{"prompt": "x", "max_tokens": 3, "prompt_len": -1}', r":2: prompt_len must be an int >= 1"),
])
def test_jsonl_bad_lines_name_the_line(tmp_path, line, match):
    path = _write(tmp_path, ['{"prompt": "ok", "max_tokens": 1}', line])
    with pytest.raises(ValueError, match=match):
        load_jsonl_requests(path)


def test_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_jsonl_requests(str(tmp_path / "nope.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="holds no requests"):
        load_jsonl_requests(str(empty))


def test_shipped_workload_loads():
    """``--dataset workload`` is package data inside pagedllm/, not a file outside the repository."""
    import pagedllm
    path = dataset_file("workload")
    assert path.startswith(os.path.dirname(pagedllm.__file__) + os.sep) and os.path.isfile(path)
    reqs = load_jsonl_requests(path)
    assert len(reqs) == 64
    assert all(isinstance(r.prompt, str) and r.prompt_len >= 1 and r.max_tokens >= 1 for r in reqs)
    assert sum(r.prompt_len for r in reqs) == 9619 and sum(r.max_tokens for r in reqs) == 5830
    assert build_requests("workload", 5, 8, 4, 0.0, 0, vocab_size=None) == reqs[:5]


def test_check_dataset_fails_before_any_model(tmp_path):
    for name in ("random", "sharegpt-like", "workload"):
        check_dataset(name)
    with pytest.raises(ValueError, match=r"--dataset 'nope\.jsonl' is neither one of .*'workload'.* nor an existing"):
        check_dataset("nope.jsonl")
    bad = _write(tmp_path, ['{"prompt": "x"}'])
    with pytest.raises(ValueError, match="missing field 'max_tokens'"):
        check_dataset(bad)
    with pytest.raises(ValueError, match="holds 64 requests, fewer than num_prompts=65"):
        check_dataset("workload", 65)


def test_resample_is_seeded_and_draws_whole_rows():
    rows = [BenchRequest("a", 10, 1), BenchRequest("b", 20, 2), BenchRequest("c", 30, 3)]
    a = resample_lengths(rows, 100, seed=5)
    assert a == resample_lengths(rows, 100, seed=5)
    assert a != resample_lengths(rows, 100, seed=6)
    assert set(a) == {(10, 1), (20, 2), (30, 3)}  # joint pairs kept
    with pytest.raises(ValueError, match="no prompt_len"):
        resample_lengths([BenchRequest("x", None, 1)], 3)


def test_build_requests_dispatch(tmp_path):
    assert len(build_requests("random", 3, 8, 4, 0.0, 0, vocab_size=100)) == 3
    assert len(build_requests("sharegpt-like", None, 8, 4, 0.0, 0, vocab_size=100)) == 64
    with pytest.raises(ValueError, match="needs a tokenizer"):
        build_requests("random", 3, 8, 4, 0.0, 0, vocab_size=None)
    path = _write(tmp_path, ['{"prompt": "ok", "max_tokens": 1}'])
    assert build_requests(path, None, 8, 4, 0.0, 0, vocab_size=None) == [BenchRequest("ok", None, 1)]


def test_prefix_sharing_dataset_is_seeded_and_shares_one_prefix():
    from pagedllm.benchmarks.datasets import PREFIX_SHARING_SYSTEM_LEN, build_requests, prefix_sharing_requests

    reqs = prefix_sharing_requests(64, vocab_size=5000, seed=3)
    assert reqs == prefix_sharing_requests(64, vocab_size=5000, seed=3)
    assert reqs != prefix_sharing_requests(64, vocab_size=5000, seed=4)
    assert len(reqs) == 64 and PREFIX_SHARING_SYSTEM_LEN == 1000
    system = reqs[0].prompt[:1000]
    for r in reqs:
        assert r.prompt[:1000] == system and 50 <= len(r.prompt) - 1000 <= 300
        assert r.prompt_len == len(r.prompt) and 64 <= r.max_tokens <= 128
        assert all(10 <= t < 5000 for t in r.prompt)
    assert len({tuple(r.prompt[1000:]) for r in reqs}) == 64  # distinct questions
    assert build_requests("prefix-sharing", None, 128, 64, 0.5, 3, 5000) == reqs
    clipped = prefix_sharing_requests(4, vocab_size=5000, seed=0, max_model_len=1100)
    assert all(r.prompt_len + r.max_tokens <= 1100 for r in clipped)


def test_multi_turn_dataset_prompts_grow_by_the_conversation():
    from pagedllm.benchmarks.datasets import build_requests, multi_turn_requests

    reqs = multi_turn_requests(3, input_len=20, output_len=10, vocab_size=500, seed=1)
    assert reqs == multi_turn_requests(3, input_len=20, output_len=10, vocab_size=500, seed=1)
    assert len(reqs) == 12 and [r.conversation_id for r in reqs] == [0] * 4 + [1] * 4 + [2] * 4
    for user in range(3):
        turns = reqs[4 * user:4 * user + 4]
        for prev, cur in zip(turns, turns[1:]):
            # the next prompt = this prompt + a reply of max_tokens tokens + a 10..30-token message
            assert cur.prompt[:len(prev.prompt)] == prev.prompt
            assert 10 <= len(cur.prompt) - len(prev.prompt) - prev.max_tokens <= 30
            assert 5 <= prev.max_tokens <= 15
    assert len(build_requests("multi-turn", 10, 20, 10, 0.5, 1, 500)) == 12  # rounded up to 3 users
    short = multi_turn_requests(2, input_len=20, output_len=10, vocab_size=500, seed=1, max_model_len=60)
    assert all(r.prompt_len + r.max_tokens <= 60 for r in short)
