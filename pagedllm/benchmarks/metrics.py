"""From per-request timestamps to the reported numbers: throughput, TTFT, TPOT, ITL, goodput.

Definitions (vLLM's ``benchmark_serving`` ones; all times in seconds):
- TTFT = first token time - arrival (send) time; queueing included.
- TPOT = (last token time - first token time) / (output tokens - 1); undefined (left out) for a
  one-token request.
- ITL = the gaps between consecutive token (chunk) arrivals of one request.
- goodput = requests meeting every given SLO / benchmark duration (requests/s).
- percentiles: linear interpolation between closest ranks (``numpy.percentile``'s default).

No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

# The flat keys every throughput result has (``--output-json``), in table order.
RESULT_KEYS = ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "mean_ttft_s", "p99_ttft_s",
               "mean_tpot_s", "p99_tpot_s", "kv_utilization", "num_preemptions", "prefix_cache_hit_rate")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by linear interpolation; ``None`` for no values.

    Raises:
        ValueError: if ``q`` is outside [0, 100].
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float | None:
    """Arithmetic mean, ``None`` for no values."""
    return sum(values) / len(values) if values else None


def tpot(first_token_time: float, last_token_time: float, num_output_tokens: int) -> float | None:
    """Time per output token after the first (s); ``None`` with fewer than 2 tokens."""
    if num_output_tokens < 2:
        return None
    return (last_token_time - first_token_time) / (num_output_tokens - 1)


@dataclass
class RequestRecord:
    """What one benchmark request did (times in seconds on one clock).

    Attributes:
        prompt_len: prompt tokens.
        output_len: useful output tokens (a static-batch baseline counts only the request's own).
        start: arrival (offline) or send (online) time.
        first_token_time: when its first output token arrived; None if none did.
        last_token_time: when its last output token arrived.
        token_times: arrival time of each token (or streamed chunk), for ITL; may be empty.
        success: False when the request failed (HTTP error, ...); left out of the latencies.
        error: what went wrong.
        num_cached_tokens: prompt tokens the server found in its prefix cache
            (``usage.prompt_tokens_details.cached_tokens``), None when not reported.
    """

    prompt_len: int
    output_len: int
    start: float
    first_token_time: float | None
    last_token_time: float | None
    token_times: list[float] = field(default_factory=list)
    success: bool = True
    error: str | None = None
    num_cached_tokens: int | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.start

    @property
    def tpot(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return tpot(self.first_token_time, self.last_token_time, self.output_len)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.last_token_time is None else self.last_token_time - self.start

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def goodput(records: Iterable[RequestRecord], duration_s: float, ttft_slo_s: float | None = None,
            tpot_slo_s: float | None = None) -> float:
    """Requests per second that succeeded and met every given SLO (DistServe's goodput).

    A request without a TPOT (one output token) meets any TPOT SLO.

    Raises:
        ValueError: if ``duration_s <= 0``.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    good = 0
    for r in records:
        if not r.success or r.ttft is None:
            continue
        if ttft_slo_s is not None and r.ttft > ttft_slo_s:
            continue
        t = r.tpot
        if tpot_slo_s is not None and t is not None and t > tpot_slo_s:
            continue
        good += 1
    return good / duration_s


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` (milliseconds) -> ``{"ttft": 0.5, "tpot": 0.05}`` (seconds).

    Raises:
        ValueError: for an unknown metric, a missing colon, or a non-positive number.
    """
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in ("ttft", "tpot"):
            raise ValueError(f"--goodput takes ttft:MS and/or tpot:MS, got {item!r}")
        try:
            ms = float(value)
        except ValueError as e:
            raise ValueError(f"--goodput {name} needs a number of milliseconds, got {value!r}") from e
        if ms <= 0:
            raise ValueError(f"--goodput {name} must be > 0 ms, got {ms}")
        slos[name] = ms / 1000.0
    return slos


def summarize(records: Sequence[RequestRecord], duration_s: float, *, itl: bool = False,
              goodput_slos: dict[str, float] | None = None) -> dict:
    """Throughput and latency numbers of a run, as a flat dict.

    Keys: ``num_requests``, ``num_failed``, ``num_prompt_tokens``, ``num_output_tokens``,
    ``duration_s``, ``requests_per_s``, ``output_tokens_per_s``, ``total_tokens_per_s``,
    ``mean_ttft_s``, ``p50_ttft_s``, ``p99_ttft_s``, ``mean_tpot_s``, ``p50_tpot_s``,
    ``p99_tpot_s``, ``mean_e2e_latency_s``; with ``itl``: ``mean_itl_s``, ``p50_itl_s``,
    ``p90_itl_s``, ``p99_itl_s``; with SLOs: ``goodput_requests_per_s`` and the SLOs used.
    Failed requests count in neither throughput nor latencies.

    Raises:
        ValueError: if ``duration_s <= 0``.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.success]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    e2e = [r.e2e_latency for r in ok if r.e2e_latency is not None]
    n_prompt = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_len for r in ok)
    out = {
        "num_requests": len(ok),
        "num_failed": len(records) - len(ok),
        "num_prompt_tokens": n_prompt,
        "num_output_tokens": n_out,
        "duration_s": duration_s,
        "requests_per_s": len(ok) / duration_s,
        "output_tokens_per_s": n_out / duration_s,
        "total_tokens_per_s": (n_prompt + n_out) / duration_s,
        "mean_ttft_s": mean(ttfts),
        "p50_ttft_s": percentile(ttfts, 50),
        "p99_ttft_s": percentile(ttfts, 99),
        "mean_tpot_s": mean(tpots),
        "p50_tpot_s": percentile(tpots, 50),
        "p99_tpot_s": percentile(tpots, 99),
        "mean_e2e_latency_s": mean(e2e),
    }
    if itl:
        itls = [x for r in ok for x in r.itls]
        out.update(mean_itl_s=mean(itls), p50_itl_s=percentile(itls, 50), p90_itl_s=percentile(itls, 90),
                   p99_itl_s=percentile(itls, 99))
    if goodput_slos:
        out["goodput_requests_per_s"] = goodput(ok, duration_s, goodput_slos.get("ttft"), goodput_slos.get("tpot"))
        out["goodput_slos_s"] = dict(goodput_slos)
    return out


def ratios(ours: dict, baseline: dict, keys: Iterable[str] = RESULT_KEYS) -> dict[str, float | None]:
    """``ours[k] / baseline[k]`` per key; ``None`` when either side is missing or the baseline is 0.

    For rates > 1 means we are faster; for latencies (``*_s``) < 1 means we are faster.
    """
    out: dict[str, float | None] = {}
    for k in keys:
        a, b = ours.get(k), baseline.get(k)
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b != 0
        out[k] = a / b if ok else None
    return out


# Latency keys (seconds in the results) that tables show in milliseconds, renamed ``*_ms``.
_MS_KEY_PARTS = ("ttft", "tpot", "itl", "e2e_latency")


def display_key(key: str) -> str:
    """A result key as a table row names it: latencies (``*_ttft_s``, ``*_tpot_s``, ``*_itl_s``,
    ``*_e2e_latency_s``) become ``*_ms``, since tables show them in milliseconds; other keys
    (``duration_s`` in seconds, rates, counts) keep their name and unit."""
    if key.endswith("_s") and not key.endswith("per_s") and any(p in key for p in _MS_KEY_PARTS):
        return key[:-2] + "_ms"
    return key


def _fmt(key: str, value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and display_key(key) != key:
        return f"{value * 1000:.1f}"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def format_table(title: str, result: dict, keys: Sequence[str], baseline: dict | None = None,
                 baseline_name: str = "baseline") -> str:
    """A plain-text table of ``keys`` with baseline and ratio columns. Each row is named by
    :func:`display_key`, so its name gives its unit (latencies ``*_ms`` in ms, ``*_s`` in s)."""
    rows = [(display_key(k), _fmt(k, result.get(k))) for k in keys]
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"==== {title} ===="]
    if baseline is None:
        lines += [f"{name:<{width}}{v:>14}" for name, v in rows]
    else:
        rat = ratios(result, baseline, keys)
        lines.append(f"{'metric':<{width}}{'pagedllm':>14}{baseline_name:>18}{'ratio':>10}")
        for k, (name, v) in zip(keys, rows):
            r = rat.get(k)
            lines.append(f"{name:<{width}}{v:>14}{_fmt(k, baseline.get(k)):>18}"
                         f"{'n/a' if r is None else f'{r:.2f}x':>10}")
    return "\n".join(lines)


def spec_decode_summary(before, after, num_output_tokens: int, num_decode_steps: int) -> dict:
    """[speculative decoding] The run's acceptance figures from two ``SpecDecodingStats``
    snapshots (the scheduler's running totals; None without speculative decoding: empty dict).

    Returns:
        ``spec_acceptance_rate`` (accepted / draft tokens), ``spec_mean_acceptance_length``
        (tokens per verification step with drafts, the bonus token included, vLLM's figure),
        ``spec_draft_tokens`` and ``tokens_per_target_forward`` (output tokens / steps that
        decoded: what speculation buys per forward).
    """
    if after is None:
        return {}
    drafts = after.num_drafts - (before.num_drafts if before else 0)
    tokens = after.num_draft_tokens - (before.num_draft_tokens if before else 0)
    accepted = after.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
    return {"spec_acceptance_rate": accepted / tokens if tokens else None,
            "spec_mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "spec_draft_tokens": tokens,
            "tokens_per_target_forward": num_output_tokens / num_decode_steps if num_decode_steps else None}
