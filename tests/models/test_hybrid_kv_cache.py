"""Hybrid KV cache end to end: tiny Gemma 3 / Gemma 2 / Mistral checkpoints with windows of two
blocks (block_size 4), prompts several windows long. Greedy float32 output with the hybrid
manager equals transformers' and the single-table engine's (``disable_hybrid_kv_cache_manager``),
also with chunked prefill across window edges, prefix-cache hits starting inside and outside the
window, n > 1 forks, recompute preemption and swap preemption (the hybrid manager kept: the
sliding group goes to the host with its window only); the fallback (the flag) is taken and
changes nothing in the output.

Every comparison is of tokens and of the sampled tokens' logprobs (within 1e-4, float32). The
checkpoints have untied LM heads: tied, the tiny Gemmas' greedy output is the last token repeated
whatever the context (or the K/V cache) holds, and no parity test could fail. Each test first
checks, on transformers' output, that the continuations depend on the context: not one repeated
token, different per prompt, and changed by a token past the last token's window (and, with full
attention layers, by one at the very start)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_spec import NULL_BLOCK_ID

MAX_NEW = 12
LOGPROB_ATOL = 1e-4   # float32: sum-order noise alone is ~1e-6


@pytest.fixture(scope="module")
def gemma2_checkpoint(save_tiny_checkpoint, tiny_tokenizer_dir):
    import transformers as tf
    vocab = len(tf.AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    torch.manual_seed(7)
    cfg = tf.Gemma2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=512,
                          initializer_range=0.3, query_pre_attn_scalar=16, bos_token_id=2, eos_token_id=1,
                          pad_token_id=0, tie_word_embeddings=False)
    return save_tiny_checkpoint(tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), "hybrid_gemma2")


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    long = torch.randint(3, vocab, (44,), generator=g).tolist()
    other = torch.randint(3, vocab, (30,), generator=g).tolist()
    # Shared prefixes for prefix-cache hits: 40 tokens of ``long`` (a hit far past the window)
    # and 6 (a hit inside the first window).
    return [long, other, long[:40] + [5, 6, 7], long[:6] + other[:20]]


def _hf_reference(path: str, prompts) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens and their logprobs (raw logits' log-softmax), each prompt alone."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, logprobs = [], []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                               eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            out = y.sequences[0, len(ids):]
            lps = torch.stack(y.logits)[:, 0].log_softmax(-1)                  # [MAX_NEW, vocab]
            tokens.append(out.tolist())
            logprobs.append(lps.gather(1, out[:, None])[:, 0].tolist())
    return tokens, logprobs


def _check_context_dependent(path: str, prompts, tokens: list[list[int]]) -> None:
    """Precondition: the greedy continuations (``tokens``, transformers' for ``prompts``) depend on
    the context, so wrong or missing K/V changes what the tests compare. Not one token repeated and
    different for every prompt; changing one token of ``prompts[0]`` (44 tokens) more than a window
    (8 or 12) before its last, and with full attention layers its first token, moves the logprobs
    of the same continuation by over 100 x LOGPROB_ATOL, and at least one such change changes the
    greedy continuation itself."""
    import json
    import os

    from transformers import AutoModelForCausalLM
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert all(len(set(t)) > 1 for t in tokens), f"greedy output is one repeated token: {tokens}"
    assert len({tuple(t) for t in tokens}) == len(tokens), f"prompts share a continuation: {tokens}"
    window = cfg["sliding_window"]
    long, vocab = prompts[0], cfg["vocab_size"]
    positions = [len(long) - 1 - window - 4]
    if "full_attention" in cfg.get("layer_types", []):
        positions.append(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:   # [MAX_NEW]: tokens[0]'s, after ``prompt``
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + tokens[0]])).logits[0, len(prompt) - 1:-1]
        return logits.log_softmax(-1).gather(1, torch.tensor(tokens[0])[:, None])[:, 0]

    base, changed = logprobs(long), []
    for pos in positions:
        p = list(long)
        p[pos] = 3 + (p[pos] - 3 + 17) % (vocab - 3)
        shift = float((logprobs(p) - base).abs().max())
        assert shift > 100 * LOGPROB_ATOL, f"prompt token {pos} of {len(long)} moves logprobs by only {shift}"
        changed.append(p)
    assert any(t != tokens[0] for t in _hf_reference(path, changed)[0]), \
        f"changing prompt token {positions} of {len(long)} (window {window}) changes no greedy token"


def _run(path: str, prompts, n: int = 1, **kwargs):
    llm = LLM(path, dtype="float32", max_model_len=96, seed=0, block_size=4, exact_greedy_head="off",
              **{"kv_cache_memory_bytes": 4 << 20, **kwargs})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, n=n, logprobs=0)
    kv = llm.llm_engine.scheduler.kv_cache_manager
    free, tables = kv.free, []
    kv.free = lambda r: (tables.append(kv.get_block_table(r.request_id)), free(r))   # tables as they end
    outs = []
    for p in prompts:   # one at a time, so later prompts hit the prefix cache of earlier ones
        outs.append(_samples(llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]))
    engine = llm.llm_engine
    engine.scheduler.kv_cache_manager.check_integrity(engine.scheduler.requests)
    engine.final_tables = tables
    return outs, engine


def _samples(output) -> list[tuple[list[int], list[float]]]:
    """A RequestOutput's samples: (token ids, each sampled token's logprob)."""
    return [(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]) for c in output.outputs]


def _assert_same(got: list[tuple[list[int], list[float]]], want_tokens, want_logprobs) -> None:
    """Samples equal to a reference: the same tokens, logprobs within LOGPROB_ATOL."""
    assert [t for t, _ in got] == want_tokens
    for (_, lps), want in zip(got, want_logprobs):
        assert lps == pytest.approx(want, abs=LOGPROB_ATOL)


def _vocab(path: str) -> int:
    import json
    import os
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["vocab_size"]


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "mistral"])
def test_hybrid_equals_transformers_and_single_table(arch, make_tiny_checkpoint, gemma2_checkpoint):
    path = gemma2_checkpoint if arch == "gemma2" else make_tiny_checkpoint(arch, tie_word_embeddings=False)
    prompts = _prompts(_vocab(path))
    expected, expected_lps = _hf_reference(path, prompts)
    _check_context_dependent(path, prompts, expected)
    # Chunks of 10 tokens: prefill chunks end inside windows and across their edges.
    got, engine = _run(path, prompts, max_num_batched_tokens=10, enable_chunked_prefill=True)
    kv = engine.scheduler.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager)
    _assert_same([o[0] for o in got], expected, expected_lps)
    # The sliding groups gave back their blocks before the window: the 44 + 12 token request ended
    # holding the null block for its first logical blocks (window 8 / 12 = 2 / 3 blocks kept).
    windows = kv.windows
    first = engine.final_tables[0]
    for g, w in enumerate(windows):
        ids = first[g::len(windows)]
        assert len(ids) == 14
        expected_nulls = 0 if w is None else (54 - w + 1) // 4   # the last step computed position 54
        assert ids.count(0) == expected_nulls and 0 not in ids[expected_nulls:]
    # The third and fourth prompts hit the cache (40 and 4 tokens: past and inside the window).
    assert kv.prefix_cache_stats.hits == 40 + 4
    single, engine = _run(path, prompts, max_num_batched_tokens=10, enable_chunked_prefill=True,
                          disable_hybrid_kv_cache_manager=True)
    assert type(engine.scheduler.kv_cache_manager) is KVCacheManager
    _assert_same([o[0] for o in single], [t for (t, _), in got], [lp for (_, lp), in got])


def test_forks_and_preemption_on_a_small_pool(make_tiny_checkpoint):
    path = make_tiny_checkpoint("gemma3", tie_word_embeddings=False)
    prompts = _prompts(_vocab(path))[:2]   # 44 and 30 tokens: the 30-token one forks a half-full block
    expected, expected_lps = _hf_reference(path, prompts)
    _check_context_dependent(path, prompts, expected)

    def run(params: SamplingParams, **kwargs):
        llm = LLM(path, dtype="float32", max_model_len=96, seed=0, block_size=4, exact_greedy_head="off",
                  max_num_batched_tokens=16, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts] * 2, params, use_tqdm=False)
        sched = llm.llm_engine.scheduler
        sched.kv_cache_manager.check_integrity(sched.requests)
        assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks
        return [_samples(o) for o in outs], sched

    # n = 2 samples fork the prompt's tables (copy-on-write per group), all at once on a pool too
    # small for both requests' full tables: recompute preemption. Greedy: both samples equal
    # transformers'.
    small = dict(num_gpu_blocks_override=40)
    greedy, sched = run(SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, n=2, logprobs=0),
                        **small)
    assert isinstance(sched.kv_cache_manager, HybridKVCacheManager)
    assert sched.num_preemptions_total > 0
    for i, samples in enumerate(greedy):
        _assert_same(samples, [expected[i % 2]] * 2, [expected_lps[i % 2]] * 2)
    # Greedy samples write the same K/V, so a fork that skipped a copy-on-write would go unseen:
    # seeded samples (seed + i) diverge from their first token and must equal the single-table
    # engine's, which copies whole-table blocks.
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=MAX_NEW, ignore_eos=True, n=2, logprobs=0)
    sampled, sched = run(params, **small)
    assert isinstance(sched.kv_cache_manager, HybridKVCacheManager) and sched.num_preemptions_total > 0
    # The 30-token prompt's samples share its half-full last block (positions 28..31) and write
    # different tokens into it.
    assert all(sampled[i][0][0][:2] != sampled[i][1][0][:2] for i in (1, 3)), sampled
    single, sched = run(params, kv_cache_memory_bytes=4 << 20, disable_hybrid_kv_cache_manager=True)
    assert type(sched.kv_cache_manager) is KVCacheManager
    for got, want in zip(sampled, single):
        _assert_same(got, [t for t, _ in want], [lp for _, lp in want])


def test_swap_preemption_keeps_the_hybrid_manager(make_tiny_checkpoint):
    path = make_tiny_checkpoint("gemma3", tie_word_embeddings=False)
    prompts = _prompts(_vocab(path))[:2] * 2
    expected, expected_lps = _hf_reference(path, prompts[:2])
    _check_context_dependent(path, prompts[:2], expected)
    # The sampled tokens' logprobs (logprobs=0) are compared too.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, n=2, logprobs=0)

    def run(**kwargs):
        llm = LLM(path, dtype="float32", max_model_len=96, seed=0, block_size=4, exact_greedy_head="off",
                  max_num_batched_tokens=16, **kwargs)
        engine = llm.llm_engine
        sched, executor, worker = engine.scheduler, engine.executor, engine.executor.driver_worker
        kv = sched.kv_cache_manager
        real_schedule, real_execute, real_swap_out, swapped = sched.schedule, executor.execute_model, kv.swap_out, []

        def schedule():   # the pools' integrity (device, host, per group) after every step
            out = real_schedule()
            kv.check_integrity(sched.requests)
            return out

        def execute_model(*args, **kw):
            # After the step's copies and forward, overwrite every free page no prefix-cache
            # entry names, device and host: a page swapped in without its copy reads garbage.
            out = real_execute(*args, **kw)
            for pool, caches in ((kv.block_pool, worker.kv_caches), (kv.cpu_block_pool, worker.host_kv_caches)):
                if pool is None:
                    continue
                junk = torch.tensor([b.block_id for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is None],
                                    dtype=torch.long)
                for k, v in caches:
                    k[junk] = 100.0
                    v[junk] = 100.0
            return out

        def swap_out(request):   # each swap-out: (copied pages, host table)
            pairs = real_swap_out(request)
            swapped.append((len(pairs), list(kv.cpu_block_tables[request.request_id])))
            return pairs

        sched.schedule, executor.execute_model, kv.swap_out = schedule, execute_model, swap_out
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        kv.check_integrity(sched.requests)
        assert kv.num_free_blocks == kv.num_blocks and not kv.cpu_block_tables
        return [_samples(o) for o in outs], sched, swapped

    want, sched, _ = run(kv_cache_memory_bytes=4 << 20)
    assert sched.num_preemptions_total == 0
    for i, samples in enumerate(want):   # n = 2 greedy samples, each equal to transformers'
        _assert_same(samples, [expected[i % 2]] * 2, [expected_lps[i % 2]] * 2)
    # 40 pages for four prompts of 44 and 30 tokens, n = 2: swap preemption, never recompute.
    got, sched, swapped = run(num_gpu_blocks_override=40, preemption_mode="swap", swap_space=0.01)
    kv = sched.kv_cache_manager
    assert type(kv) is HybridKVCacheManager and kv.num_kv_cache_groups == 2 and kv.num_cpu_blocks > 0
    assert sched.num_preemptions_by_mode["swap"] > 0 and sched.num_preemptions_by_mode["recompute"] == 0
    assert len(swapped) == sched.num_preemptions_by_mode["swap"]
    for samples, ref in zip(got, want):
        _assert_same(samples, [t for t, _ in ref], [lp for _, lp in ref])
    # The sliding group went to the host with its window only (null entries in the host tables
    # of requests past their first window), and a sample whose fork sibling was swapped out
    # first copied fewer pages than its real entries (the shared full ones were on the host).
    assert any(table.count(NULL_BLOCK_ID) > 0 for _, table in swapped)
    assert any(n < len(table) - table.count(NULL_BLOCK_ID) for n, table in swapped)
