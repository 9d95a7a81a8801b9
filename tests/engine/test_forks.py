"""n > 1 / best_of through copy-on-write forks, end to end on a tiny random checkpoint: each
seeded sample equals a separate request with seed s + i, the prompt runs once, the prompt's
blocks are stored once, best_of ranks by cumulative logprob, aborts free every block."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

BS = 16
PROMPT = list(range(40, 77))   # 37 tokens: 2 full blocks + a partial one of 5


class StepProbe:
    """Wraps the scheduler: prompt tokens scheduled per request, the peak of used blocks, and the
    pool's integrity after every schedule()."""

    def __init__(self, llm: LLM) -> None:
        self.prompt_tokens: dict[str, int] = {}
        self.peak_blocks = 0
        engine = llm.llm_engine
        sched, kv = engine.scheduler, engine.kv_cache_manager
        real = sched.schedule

        def schedule():
            out = real()
            for req_id, num in out.num_scheduled_tokens.items():
                request = sched.requests[req_id]
                start = request.num_computed_tokens - num
                end = min(start + num, request.num_prompt_tokens)
                if end > start:
                    self.prompt_tokens[req_id] = self.prompt_tokens.get(req_id, 0) + end - start
            self.peak_blocks = max(self.peak_blocks, kv.num_blocks - kv.num_free_blocks)
            kv.check_integrity(sched.requests)
            return out

        sched.schedule = schedule

    def reset(self) -> None:
        self.prompt_tokens.clear()
        self.peak_blocks = 0


@pytest.fixture(scope="module")
def llm(make_tiny_checkpoint):
    engine = LLM(make_tiny_checkpoint("llama"), dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20, seed=0,
                 block_size=BS, enable_prefix_caching=False)
    return engine, StepProbe(engine)


def sampled(seed, n=1, **kw):
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True, **kw)


def assert_pool_empty(engine: LLM) -> None:
    kv = engine.llm_engine.kv_cache_manager
    kv.check_integrity(engine.llm_engine.scheduler.requests)
    assert kv.num_free_blocks == kv.num_blocks


def test_n4_seeded_equals_four_requests_prompt_once_stored_once(llm):
    engine, probe = llm
    separate = [engine.generate({"prompt_token_ids": PROMPT}, sampled(100 + i), use_tqdm=False)[0]
                for i in range(4)]
    probe.reset()
    (out,) = engine.generate({"prompt_token_ids": PROMPT}, sampled(100, n=4), use_tqdm=False)
    assert [o.token_ids for o in out.outputs] == [s.outputs[0].token_ids for s in separate]
    assert [o.text for o in out.outputs] == [s.outputs[0].text for s in separate]
    # The model ran the 37 prompt tokens once (sample 0); the forks ran none.
    assert probe.prompt_tokens == {f"0_{out.request_id}": len(PROMPT)}
    # Peak: the 2 full prompt blocks once + 4 private last blocks (5 + 8 tokens fit one block);
    # four independent requests would hold 4 x 3 = 12.
    assert probe.peak_blocks == 2 + 4
    assert_pool_empty(engine)


def test_greedy_n3_with_chunked_prefill_and_penalties(make_tiny_checkpoint):
    engine = LLM(make_tiny_checkpoint("llama"), dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20, seed=0,
                 block_size=BS, max_num_batched_tokens=16)
    probe = StepProbe(engine)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3)
    (one,) = engine.generate({"prompt_token_ids": PROMPT}, SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3), use_tqdm=False)
    engine.reset_prefix_cache()
    probe.reset()
    (out,) = engine.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    assert [o.token_ids for o in out.outputs] == [one.outputs[0].token_ids] * 3
    assert sum(probe.prompt_tokens.values()) == len(PROMPT)
    assert_pool_empty(engine)


def test_best_of_ranks_by_cumulative_logprob(llm):
    engine, _ = llm
    separate = [engine.generate({"prompt_token_ids": PROMPT}, sampled(7 + i, logprobs=0), use_tqdm=False)[0].outputs[0]
                for i in range(4)]
    (out,) = engine.generate({"prompt_token_ids": PROMPT}, sampled(7, n=2, best_of=4), use_tqdm=False)
    best = sorted(separate, key=lambda o: o.cumulative_logprob, reverse=True)[:2]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in best]
    assert [o.cumulative_logprob for o in out.outputs] == pytest.approx([o.cumulative_logprob for o in best], abs=1e-5)
    assert_pool_empty(engine)


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_abort_mid_fork_frees_every_block(llm, steps):
    engine, _ = llm
    core = engine.llm_engine
    core.add_request("abort-me", {"prompt_token_ids": PROMPT}, sampled(1, n=4))
    for _ in range(steps):
        core.step()
    outs = core.abort_request("abort-me")
    assert outs and outs[0].finished
    assert not core.has_unfinished_requests()
    assert_pool_empty(engine)
    core.step()   # the worker drops them too
    assert core.executor.driver_worker.model_runner.requests.requests == {}
