"""Automatic prefix caching end to end: greedy outputs with caching on equal caching off, token
for token, and the model runs exactly the prompt tokens the cache did not hold.

Tiny random checkpoints (``conftest.make_tiny_checkpoint``) for every case; the default model
(float32, ``slow``) for the shared-system-prompt and multi-turn cases. ``block_size`` is 16 (the
default) unless a test says otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams

BS = 16


def make_llm(path: str, enable: bool, **kwargs) -> LLM:
    kw = dict(max_model_len=256, kv_cache_memory_bytes=16 << 20, seed=0, block_size=BS)
    kw.update(kwargs)
    return LLM(path, dtype="float32", enable_prefix_caching=enable, **kw)


class PromptTokenCounter:
    """Wraps the scheduler: per request id, the prompt tokens scheduled to the model."""

    def __init__(self, llm: LLM) -> None:
        self.counts: dict[str, int] = {}
        sched = llm.llm_engine.scheduler
        real = sched.schedule

        def schedule():
            out = real()
            for req_id, num in out.num_scheduled_tokens.items():
                request = sched.requests[req_id]
                start = request.num_computed_tokens - num  # schedule() advanced it
                end = min(start + num, request.num_prompt_tokens)
                if end > start:
                    self.counts[req_id] = self.counts.get(req_id, 0) + end - start
            # Registered blocks are never written: check the pool after every schedule.
            llm.llm_engine.kv_cache_manager.check_integrity(sched.requests)
            return out

        sched.schedule = schedule

    def take(self, outputs) -> list[int]:
        """Counts of these outputs' requests, in order; forgets them."""
        return [self.counts.pop(o.request_id, 0) for o in outputs]


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def ids(rng, n: int) -> list[int]:
    return rng.integers(10, 300, size=n).tolist()


@pytest.fixture(scope="module")
def pair(make_tiny_checkpoint):
    """(caching on, caching off) engines on the tiny Llama, plus a prompt-token counter."""
    path = make_tiny_checkpoint("llama")
    on, off = make_llm(path, True), make_llm(path, False)
    return on, off, PromptTokenCounter(on)


def run_both(pair, prompts, params=None, **kw):
    on, off, counter = pair
    params = params or greedy()
    out_on = on.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    out_off = off.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert token_ids(out_on) == token_ids(out_off)
    ran = counter.take(out_on)
    assert [o.num_cached_tokens for o in out_on] == [len(p) - r for p, r in zip(prompts, ran)]
    assert all(o.num_cached_tokens == 0 for o in out_off)
    return out_on, ran


def fresh(pair):
    on, off, _ = pair
    assert on.reset_prefix_cache()
    assert on.llm_engine.kv_cache_manager.block_pool.num_cached_blocks == 0


def test_default_is_on_and_flag_turns_it_off(make_tiny_checkpoint):
    from pagedllm.engine.arg_utils import EngineArgs
    assert EngineArgs().enable_prefix_caching is True
    llm = make_llm(make_tiny_checkpoint("llama"), False)
    assert not llm.llm_engine.kv_cache_manager.enable_caching


def test_shared_system_prompt_batch(pair):
    fresh(pair)
    rng = np.random.default_rng(0)
    system = ids(rng, 5 * BS + 3)  # 83 tokens: 5 full blocks shared
    # The first request prefills alone (its own generate call), then a batch arrives.
    first = system + ids(rng, 7)
    _, ran = run_both(pair, [first])
    assert ran == [len(first)]
    batch = [system + ids(rng, n) for n in (4, 20, 33)]
    _, ran = run_both(pair, batch)
    assert ran == [len(p) - 5 * BS for p in batch]


def test_multi_turn_chat_grows_turn_by_turn(pair):
    fresh(pair)
    rng = np.random.default_rng(1)
    conversation = ids(rng, 30)
    prev_len = None
    for turn in range(4):
        out, ran = run_both(pair, [conversation], greedy(6))
        if prev_len is None:
            assert ran == [len(conversation)]
        else:
            # Everything of the previous turn's full blocks (prompt and reply) is cached.
            cached = (prev_len // BS) * BS
            assert ran == [len(conversation) - cached]
        prev_len = len(conversation) + 6 - 1  # the last sampled token's K/V is never computed
        conversation = conversation + out[0].outputs[0].token_ids + ids(rng, 9)


def test_prompts_sharing_exactly_whole_blocks(pair):
    fresh(pair)
    rng = np.random.default_rng(2)
    prefix = ids(rng, 3 * BS)
    _, ran = run_both(pair, [prefix + ids(rng, 5)])
    assert ran == [3 * BS + 5]
    # The same 3 blocks, then different tokens; and the prefix alone (fully cached: its last
    # block is recomputed so the last token's logits exist).
    prompts = [prefix + ids(rng, 1), prefix + ids(rng, BS), prefix]
    _, ran = run_both(pair, prompts)
    assert ran == [1, BS, BS]


def test_prompts_differing_only_in_the_last_token_of_a_block(pair):
    fresh(pair)
    rng = np.random.default_rng(3)
    base = ids(rng, 2 * BS + 6)
    _, ran = run_both(pair, [base])
    assert ran == [len(base)]
    other = list(base)
    other[2 * BS - 1] = 301 if base[2 * BS - 1] != 301 else 302  # last token of block 1
    _, ran = run_both(pair, [other])
    assert ran == [len(other) - BS]  # block 0 hits, block 1 differs


def test_same_batch_twice_is_fully_cached_the_second_time(pair):
    fresh(pair)
    rng = np.random.default_rng(4)
    batch = [ids(rng, n) for n in (17, 32, 40, 64)]
    _, ran = run_both(pair, batch)
    assert ran == [len(p) for p in batch]
    _, ran = run_both(pair, batch)
    # Each prompt keeps (len - 1) // BS blocks; the rest (at least its last token) reruns.
    assert ran == [len(p) - ((len(p) - 1) // BS) * BS for p in batch] == [1, 16, 8, 16]


def test_requests_arriving_while_the_prefix_is_prefilled_in_chunks(make_tiny_checkpoint):
    path = make_tiny_checkpoint("llama")
    rng = np.random.default_rng(5)
    system = ids(rng, 6 * BS)
    prompts = [system + ids(rng, 10), system + ids(rng, 3), system + ids(rng, 21)]
    results = {}
    for enable in (True, False):
        llm = make_llm(path, enable, max_num_batched_tokens=2 * BS)
        counter = PromptTokenCounter(llm)
        engine = llm.llm_engine
        engine.add_request("a", {"prompt_token_ids": prompts[0]}, greedy())
        engine.step()  # a: tokens 0..31 (blocks 0, 1 registered after the step)
        engine.add_request("b", {"prompt_token_ids": prompts[1]}, greedy())
        engine.step()  # a: 32..63; b is waiting (no budget left)
        engine.add_request("c", {"prompt_token_ids": prompts[2]}, greedy())
        outs = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o
        results[enable] = ([outs[r].outputs[0].token_ids for r in "abc"], [counter.counts[r] for r in "abc"],
                           [outs[r].num_cached_tokens for r in "abc"])
    assert results[True][0] == results[False][0]
    assert results[False][1] == [len(p) for p in prompts]
    ran, cached = results[True][1], results[True][2]
    assert ran[0] == len(prompts[0]) and cached[0] == 0
    # b and c were admitted while a was still being prefilled, and found a's finished blocks.
    assert cached[1] > 0 and cached[2] > 0
    assert [r + c for r, c in zip(ran, cached)] == [len(p) for p in prompts]
    assert all(c % BS == 0 for c in cached)


@pytest.mark.parametrize("arch", ["gemma3", "mistral", "qwen3"])
def test_sliding_window_and_other_archs_share_hits(make_tiny_checkpoint, arch):
    """Gemma 3 (sliding window 8 < block 16, alternating layers: the hybrid KV cache's window
    group) and Mistral (window 12): a hit gives the same tokens and logprobs as a miss. Untied
    LM heads (tied, the tiny Gemma 3 repeats the last token whatever the K/V hold)."""
    path = make_tiny_checkpoint(arch, tie_word_embeddings=False)
    on, off = make_llm(path, True), make_llm(path, False)
    counter = PromptTokenCounter(on)
    rng = np.random.default_rng(6)
    system = ids(rng, 3 * BS + 2)
    prompts = [system + ids(rng, n) for n in (3, 11)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    for batch in ([prompts[0]], prompts, prompts):
        out_on = on.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        out_off = off.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        assert token_ids(out_on) == token_ids(out_off)
        for a, b in zip(out_on, out_off):
            want = [lp[t].logprob for t, lp in zip(b.outputs[0].token_ids, b.outputs[0].logprobs)]
            got = [lp[t].logprob for t, lp in zip(a.outputs[0].token_ids, a.outputs[0].logprobs)]
            assert got == pytest.approx(want, abs=1e-4)
        counter.take(out_on)
    assert [o.num_cached_tokens for o in out_on] == [3 * BS, 3 * BS]
    # The outputs depend on the context: not one repeated token, different for the two prompts.
    tokens = token_ids(out_on)
    assert all(len(set(t)) > 1 for t in tokens) and tokens[0] != tokens[1], tokens


def test_prompt_logprobs_requests_skip_the_cache(pair):
    fresh(pair)
    on, off, counter = pair
    rng = np.random.default_rng(7)
    prompt = ids(rng, 2 * BS + 4)
    on.generate([{"prompt_token_ids": prompt}], greedy(2), use_tqdm=False)
    counter.take([])
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    out_on = on.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    out_off = off.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert counter.take(out_on) == [len(prompt)] and out_on[0].num_cached_tokens == 0
    assert len(out_on[0].prompt_logprobs) == len(prompt)
    for a, b in zip(out_on[0].prompt_logprobs[1:], out_off[0].prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].logprob == pytest.approx(b[k].logprob, abs=1e-5)


def test_preempted_request_finds_its_own_blocks(make_tiny_checkpoint):
    """A pool too small for the batch forces recompute preemptions; outputs still match."""
    path = make_tiny_checkpoint("llama")
    rng = np.random.default_rng(8)
    system = ids(rng, 2 * BS)
    prompts = [system + ids(rng, n) for n in (5, 9, 14, 30)]
    outs = {}
    for enable in (True, False):
        llm = make_llm(path, enable, num_gpu_blocks_override=16, max_model_len=128)
        outs[enable] = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(40),
                                              use_tqdm=False))
        if enable:
            assert llm.llm_engine.scheduler.num_preemptions_total > 0
            llm.llm_engine.kv_cache_manager.check_integrity()
    assert outs[True] == outs[False]


def test_reset_prefix_cache(pair):
    on, _, counter = pair
    rng = np.random.default_rng(9)
    prompt = ids(rng, 3 * BS)
    on.generate([{"prompt_token_ids": prompt}], greedy(2), use_tqdm=False)
    assert on.llm_engine.kv_cache_manager.block_pool.num_cached_blocks >= 2
    assert on.reset_prefix_cache() is True
    assert on.llm_engine.kv_cache_manager.block_pool.num_cached_blocks == 0
    out = on.generate([{"prompt_token_ids": prompt}], greedy(2), use_tqdm=False)
    assert counter.take(out) == [len(prompt)]
    # Refused while a request holds blocks.
    engine = on.llm_engine
    engine.add_request("busy", {"prompt_token_ids": prompt}, greedy(4))
    engine.step()
    assert on.reset_prefix_cache() is False
    assert engine.kv_cache_manager.block_pool.num_cached_blocks > 0
    engine.abort_request("busy")
    counter.counts.clear()


def test_prefix_cache_counters(pair):
    fresh(pair)
    on, _, counter = pair
    stats = on.llm_engine.kv_cache_manager.prefix_cache_stats
    q0, h0 = stats.queries, stats.hits
    rng = np.random.default_rng(10)
    prompt = ids(rng, 2 * BS + 1)
    on.generate([{"prompt_token_ids": prompt}] * 1, greedy(2), use_tqdm=False)
    on.generate([{"prompt_token_ids": prompt}] * 1, greedy(2), use_tqdm=False)
    counter.counts.clear()
    assert stats.queries - q0 == 2 * len(prompt)
    assert stats.hits - h0 == 2 * BS


@pytest.mark.slow
def test_default_model_shared_system_prompt_and_multi_turn(free_memory):
    """Gemma 3 270M in float32: a shared system prompt and a growing chat, on equals off.

    The caching-off engine runs first and is freed before the caching-on one starts, so the test
    holds one copy of the model at a time (the suite's peak memory)."""
    kw = dict(max_model_len=512, kv_cache_memory_bytes=256 << 20)

    def run(llm: LLM, counter: PromptTokenCounter | None):
        tok = llm.get_tokenizer()
        system = tok.encode("You are a helpful assistant who answers questions about the paged KV cache, "
                            "continuous batching and the scheduling of large language model inference. " * 3)
        questions = ["What is a block table?", "Why share blocks between requests?",
                     "How does preemption by recomputation work?"]
        prompts = [system + tok.encode(" Question: " + q + " Answer:") for q in questions]
        batches, ran = [], []
        for batch in ([prompts[0]], prompts):
            batches.append(llm.generate([{"prompt_token_ids": p} for p in batch], greedy(12), use_tqdm=False))
            ran.append(counter.take(batches[-1]) if counter else None)
        turns, conversation = [], prompts[0]
        for _ in range(3):
            out = llm.generate([{"prompt_token_ids": conversation}], greedy(8), use_tqdm=False)
            turns.append((len(conversation), out, counter.take(out) if counter else None))
            conversation = conversation + out[0].outputs[0].token_ids + tok.encode(" Tell me more.")
        return system, prompts, batches, ran, turns

    off = make_llm(None, False, **kw)
    _, _, off_batches, _, off_turns = run(off, None)
    del off
    free_memory()
    on = make_llm(None, True, **kw)
    system, prompts, on_batches, ran, on_turns = run(on, PromptTokenCounter(on))
    assert [token_ids(b) for b in on_batches] == [token_ids(b) for b in off_batches]
    assert [token_ids(t[1]) for t in on_turns] == [token_ids(t[1]) for t in off_turns]
    shared = (len(system) // BS) * BS
    out_on = on_batches[-1]
    assert all(o.num_cached_tokens >= shared for o in out_on)
    assert [r + o.num_cached_tokens for r, o in zip(ran[-1], out_on)] == [len(p) for p in prompts]
    for conversation_len, _, (turn_ran,) in on_turns:
        assert turn_ran <= conversation_len - shared
