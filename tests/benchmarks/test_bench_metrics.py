"""Benchmark metrics on hand-made numbers: percentiles, TTFT/TPOT/ITL, goodput, ratios, tables."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagedllm.benchmarks.hf_baseline import records_from_batch, static_batches
from pagedllm.benchmarks.metrics import (RESULT_KEYS, RequestRecord, format_table, goodput, parse_goodput,
                                         percentile, ratios, summarize, tpot)
from pagedllm.benchmarks.serving import arrival_gaps, completions_url


def test_percentile_interpolates_like_numpy():
    xs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="in \\[0, 100\\]"):
        percentile([1.0], 101)


def test_ttft_tpot_itl_from_timestamps():
    r = RequestRecord(prompt_len=10, output_len=5, start=100.0, first_token_time=100.5, last_token_time=101.3,
                      token_times=[100.5, 100.7, 100.9, 101.0, 101.3])
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx(0.2)            # (101.3 - 100.5) / 4
    assert r.e2e_latency == pytest.approx(1.3)
    assert r.itls == pytest.approx([0.2, 0.2, 0.1, 0.3])
    assert tpot(0.0, 1.0, 1) is None               # one token: no TPOT
    assert RequestRecord(1, 1, 0.0, 0.25, 0.25).tpot is None


def _records():
    # TTFT 0.1 / 0.2 / 0.4 s; TPOT 0.01 / 0.05 / 0.02 s.
    return [RequestRecord(4, 11, 0.0, 0.1, 0.2), RequestRecord(6, 3, 1.0, 1.2, 1.3),
            RequestRecord(10, 6, 2.0, 2.4, 2.5)]


def test_goodput_counts_requests_meeting_both_slos():
    recs = _records()
    assert goodput(recs, 2.0) == 1.5                                   # no SLO: all 3
    assert goodput(recs, 2.0, ttft_slo_s=0.25) == 1.0                  # 0.1, 0.2
    assert goodput(recs, 2.0, tpot_slo_s=0.03) == 1.0                  # 0.01, 0.02
    assert goodput(recs, 2.0, ttft_slo_s=0.25, tpot_slo_s=0.03) == 0.5  # only the first
    failed = RequestRecord(1, 0, 0.0, None, None, success=False)
    assert goodput(recs + [failed], 3.0) == 1.0
    with pytest.raises(ValueError, match="duration_s"):
        goodput(recs, 0.0)


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "TPOT:50"]) == {"ttft": 0.5, "tpot": 0.05}
    assert parse_goodput(None) == {}
    for bad in (["e2e:5"], ["ttft"], ["ttft:x"], ["tpot:0"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


def test_summarize_hand_computed():
    recs = _records() + [RequestRecord(100, 0, 0.0, None, None, success=False, error="boom")]
    s = summarize(recs, duration_s=4.0, itl=True, goodput_slos={"ttft": 0.25})
    assert s["num_requests"] == 3 and s["num_failed"] == 1
    assert s["num_prompt_tokens"] == 20 and s["num_output_tokens"] == 20
    assert s["requests_per_s"] == 0.75 and s["output_tokens_per_s"] == 5.0 and s["total_tokens_per_s"] == 10.0
    assert s["mean_ttft_s"] == pytest.approx(0.7 / 3)
    assert s["p50_ttft_s"] == pytest.approx(0.2)
    assert s["p99_ttft_s"] == pytest.approx(0.2 + 0.2 * 0.98)
    assert s["mean_tpot_s"] == pytest.approx((0.01 + 0.05 + 0.02) / 3)
    assert s["p99_tpot_s"] == pytest.approx(0.02 + 0.03 * 0.98)
    assert s["mean_itl_s"] is None                                     # no token_times recorded
    assert s["goodput_requests_per_s"] == 0.5
    with pytest.raises(ValueError):
        summarize(recs, 0.0)


def test_ratios_and_table():
    ours = {k: 2.0 for k in RESULT_KEYS}
    base = {k: 4.0 for k in RESULT_KEYS}
    base["num_preemptions"] = 0
    base["prefix_cache_hit_rate"] = None
    r = ratios(ours, base)
    assert set(r) == set(RESULT_KEYS)
    assert r["requests_per_s"] == 0.5 and r["num_preemptions"] is None and r["prefix_cache_hit_rate"] is None
    table = format_table("t", {**ours, "prefix_cache_hit_rate": None}, RESULT_KEYS, base, "hf")
    assert "0.50x" in table and "n/a" in table
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[2:]}
    assert rows["mean_ttft_ms"] == ["2000.0", "4000.0", "0.50x"]     # seconds in the results, ms in the table
    assert rows["requests_per_s"] == ["2.000", "4.000", "0.50x"]
    assert not any(name.endswith("_s") and not name.endswith("per_s") for name in rows)


def test_table_row_names_give_their_units():
    """Latencies are shown in ms under ``*_ms`` names; the run's duration stays in seconds as ``duration_s``."""
    result = {"duration_s": 12.5, "mean_ttft_s": 0.25, "p99_tpot_s": 0.0125, "mean_itl_s": 0.002,
              "mean_e2e_latency_s": 3.0, "output_tokens_per_s": 55.0}
    table = format_table("t", result, tuple(result))
    rows = dict(line.split() for line in table.splitlines()[1:])
    assert rows == {"duration_s": "12.5", "mean_ttft_ms": "250.0", "p99_tpot_ms": "12.5", "mean_itl_ms": "2.0",
                    "mean_e2e_latency_ms": "3000.0", "output_tokens_per_s": "55.0"}


def test_static_batches_and_per_request_accounting():
    assert [list(b) for b in static_batches(5, 2)] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError):
        static_batches(3, 0)
    # A batch of two: it runs 4 steps (the max); the 2-token member's own last token is step 2.
    recs = records_from_batch(10.0, [11.0, 11.5, 12.0, 12.5], prompt_lens=[3, 5], max_tokens=[2, 4])
    assert [r.output_len for r in recs] == [2, 4]
    assert [r.ttft for r in recs] == [1.0, 1.0]
    assert recs[0].tpot == pytest.approx(0.5) and recs[0].last_token_time == 11.5
    assert recs[1].tpot == pytest.approx(0.5) and recs[1].e2e_latency == 2.5
    with pytest.raises(RuntimeError, match="made 1 tokens"):
        records_from_batch(0.0, [1.0], [3], [2])


def test_arrival_gaps():
    assert arrival_gaps(4, math.inf) == [0.0] * 4
    g = arrival_gaps(20000, 10.0, seed=1)
    assert g == arrival_gaps(20000, 10.0, seed=1) and g[0] == 0.0
    assert np.mean(g[1:]) == pytest.approx(0.1, rel=0.03)            # Poisson: mean gap 1 / rate
    assert np.std(g[1:]) == pytest.approx(0.1, rel=0.05)             # exponential: std == mean
    bursty = arrival_gaps(20000, 10.0, burstiness=0.25, seed=1)
    assert np.std(bursty[1:]) > 1.5 * np.std(g[1:])
    with pytest.raises(ValueError, match="request_rate"):
        arrival_gaps(3, 0.0)


def test_completions_url():
    assert completions_url("http://h:8000") == "http://h:8000/v1/completions"
    assert completions_url("http://h:8000/v1/") == "http://h:8000/v1/completions"
