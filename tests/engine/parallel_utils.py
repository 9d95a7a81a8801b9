"""Helpers shared by the parallel-engine tests (``test_parallel.py``, ``test_ray_executor.py``):
a small float32 engine on a tiny checkpoint, running requests to completion, and comparing two
runs' tokens and logprobs."""

from __future__ import annotations

from typing import Iterable

from pagedllm import SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine

# Three prompts: a repeated 24-token one, a short one and a 40-token one.
PROMPTS = [[5, 9, 13, 200, 17, 3, 3, 40] * 3, [7, 8, 9], list(range(30, 70))]


def tiny_engine(folder: str, **kwargs) -> LLMEngine:
    """An ``LLMEngine`` on ``folder``: float32 (so that split matmuls and all-reduce match one
    process to rounding), 8-token blocks, a 4 MiB KV cache, seed 0; kwargs go to ``EngineArgs``."""
    return LLMEngine(EngineArgs(model=folder, dtype="float32", max_model_len=128, seed=0, block_size=8,
                                kv_cache_memory_bytes=4 << 20, **kwargs))


def run_requests(engine: LLMEngine, requests: Iterable[tuple[list[int], SamplingParams]]) -> dict:
    """Add the (prompt token ids, params) requests as ``r0``, ``r1``, ... and step until all finish.

    Returns:
        request id -> (token ids, None or per token ``{token id: logprob}``).
    """
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                out[o.request_id] = (c.token_ids, None if c.logprobs is None else
                                     [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
    return out


def assert_same_outputs(got: dict, want: dict) -> None:
    """The same requests, the same tokens (greedy and seeded sampling), the same top-logprob
    tokens, and logprobs within 1e-4."""
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid][0] == want[rid][0], rid
        if want[rid][1] is not None:
            for g, w in zip(got[rid][1], want[rid][1]):
                assert g.keys() == w.keys()
                for tok in w:
                    assert abs(g[tok] - w[tok]) < 1e-4, (rid, tok, g[tok], w[tok])
