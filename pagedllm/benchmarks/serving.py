"""Online serving benchmark against any OpenAI-compatible ``/v1/completions`` server (ours,
vLLM's, llama.cpp's), after vLLM's ``benchmark_serving``.

Requests are sent with arrival gaps from a gamma process (``burstiness`` 1 = Poisson) at
``request_rate`` requests/s (``inf``: all at once), at most ``max_concurrency`` in flight, each a
streaming completion (greedy, ``ignore_eos``). Every streamed chunk with text is timestamped
(``time.perf_counter``); TTFT, TPOT, ITL and goodput follow ``metrics``. The output token count is
the server's ``usage.completion_tokens`` when it sends one (``stream_options.include_usage``),
else the number of text chunks.

Requests sharing a ``conversation_id`` (the ``multi-turn`` dataset) are one simulated user's
turns: the arrival process starts the conversation, and each turn is sent when the previous one
has finished. The prefix-cache hit rate is the share of prompt tokens the server reports as
cached (``usage.prompt_tokens_details.cached_tokens``; pagedllm sends it with
``--enable-prompt-tokens-details``), None when the server does not report it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Sequence

import numpy as np
from tqdm.auto import tqdm

from pagedllm.benchmarks.datasets import BenchRequest
from pagedllm.benchmarks.metrics import RequestRecord

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 6 * 3600.0


def completions_url(base_url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> ``.../v1/completions``."""
    base = base_url.rstrip("/")
    return base + "/completions" if base.endswith("/v1") else base + "/v1/completions"


def models_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base + "/models" if base.endswith("/v1") else base + "/v1/models"


def arrival_gaps(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds to wait before each request (the first waits 0).

    Gaps are gamma-distributed with mean ``1 / request_rate`` and shape ``burstiness``
    (1 = exponential, i.e. Poisson arrivals); ``inf`` gives all zeros.

    Raises:
        ValueError: for a non-positive rate or burstiness.
    """
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate) or num_requests == 0:
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    gaps[0] = 0.0
    return gaps.tolist()


async def fetch_model_name(client, base_url: str) -> str:
    """The first model id listed by ``GET /v1/models``.

    Raises:
        ValueError: if the server lists none.
    """
    resp = await client.get(models_url(base_url))
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{models_url(base_url)} lists no models; pass --model")
    return data[0]["id"]


async def send_completion(client, url: str, model: str, req: BenchRequest, ignore_eos: bool = True) -> RequestRecord:
    """Send one streaming completion and timestamp its chunks.

    Never raises for a failed request: the record has ``success=False`` and the error.
    """
    payload = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
               "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        payload["ignore_eos"] = True
    start = time.perf_counter()
    times: list[float] = []
    usage = None
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                return RequestRecord(req.prompt_len or 0, 0, start, None, None, success=False,
                                     error=f"HTTP {resp.status_code}: {body[:300]}")
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    times.append(now)
    except Exception as e:  # network errors, bad JSON: the request failed, the benchmark goes on
        return RequestRecord(req.prompt_len or 0, len(times), start, times[0] if times else None,
                             times[-1] if times else None, token_times=times, success=False,
                             error=f"{type(e).__name__}: {e}")
    n_out = int(usage["completion_tokens"]) if usage and usage.get("completion_tokens") is not None else len(times)
    n_prompt = int(usage["prompt_tokens"]) if usage and usage.get("prompt_tokens") is not None else (req.prompt_len or 0)
    details = (usage or {}).get("prompt_tokens_details") or {}
    n_cached = details.get("cached_tokens")
    n_cached = int(n_cached) if n_cached is not None else None
    if not times:
        return RequestRecord(n_prompt, n_out, start, None, None, success=False, error="no tokens streamed",
                             num_cached_tokens=n_cached)
    return RequestRecord(n_prompt, n_out, start, times[0], times[-1], token_times=times, num_cached_tokens=n_cached)


def prefix_cache_hit_rate(records: Sequence[RequestRecord]) -> float | None:
    """Cached / prompt tokens over the successful requests; None unless every one reported it."""
    ok = [r for r in records if r.success]
    if not ok or any(r.num_cached_tokens is None for r in ok):
        return None
    prompt = sum(r.prompt_len for r in ok)
    return sum(r.num_cached_tokens for r in ok) / prompt if prompt else None


def conversation_groups(requests: Sequence[BenchRequest]) -> list[list[int]]:
    """Request indices grouped into units sent one after the other: each conversation's turns in
    order (by first appearance), every independent request alone."""
    groups: list[list[int]] = []
    where: dict[int, int] = {}
    for i, req in enumerate(requests):
        cid = req.conversation_id
        if cid is None:
            groups.append([i])
        elif cid in where:
            groups[where[cid]].append(i)
        else:
            where[cid] = len(groups)
            groups.append([i])
    return groups


async def run_requests(base_url: str, model: str | None, requests: Sequence[BenchRequest],
                       request_rate: float = math.inf, max_concurrency: int | None = None,
                       burstiness: float = 1.0, seed: int = 0, ignore_eos: bool = True, client=None,
                       timeout_s: float = DEFAULT_TIMEOUT_S,
                       progress: bool = False,
                       lora_names: Sequence[str] | None = None) -> tuple[list[RequestRecord], float, str]:
    """Send the workload; returns (records in request order, duration in s, model name).

    Args:
        lora_names: [LoRA] served adapter names: request ``i`` names ``lora_names[i % N]`` as its
            ``model`` (None: every request names ``model``).
        client: an ``httpx.AsyncClient`` (tests pass one with a mock transport); None = a new one.
        progress: a progress bar of finished requests (tqdm, on stderr).
    Raises:
        ValueError: bad rate / burstiness / concurrency, or no model name to be had.
    """
    import httpx

    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    groups = conversation_groups(requests)
    gaps = arrival_gaps(len(groups), request_rate, burstiness, seed)
    own_client = client is None
    if own_client:
        client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s),
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
    try:
        if model is None:
            model = await fetch_model_name(client, base_url)
        url = completions_url(base_url)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)

        index = {id(r): i for i, r in enumerate(requests)}

        async def one(req: BenchRequest) -> RequestRecord:
            name = lora_names[index[id(req)] % len(lora_names)] if lora_names else model
            try:
                if sem is None:
                    return await send_completion(client, url, name, req, ignore_eos)
                async with sem:
                    return await send_completion(client, url, name, req, ignore_eos)
            finally:
                bar.update(1)

        slots: list[RequestRecord | None] = [None] * len(requests)

        async def turns(group: list[int]) -> None:
            for i in group:
                slots[i] = await one(requests[i])

        t0 = time.perf_counter()
        tasks = []
        for gap, group in zip(gaps, groups):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(turns(group)))
        await asyncio.gather(*tasks)
        records = list(slots)
        duration = time.perf_counter() - t0
        bar.close()
    finally:
        if own_client:
            await client.aclose()
    failed = [r for r in records if not r.success]
    if failed:
        logger.warning("%d of %d requests failed; first error: %s", len(failed), len(records), failed[0].error)
    return records, duration, model


def run_serving(base_url: str, model: str | None, requests: Sequence[BenchRequest], **kwargs):
    """Synchronous wrapper of :func:`run_requests`."""
    return asyncio.run(run_requests(base_url, model, requests, **kwargs))
