"""Hybrid KV cache end to end: tiny Gemma 3 / Gemma 2 / Mistral checkpoints with windows of two
blocks (block_size 4), prompts several windows long. Greedy float32 output with the hybrid
manager equals transformers' and the single-table engine's (``disable_hybrid_kv_cache_manager``),
also with chunked prefill across window edges, prefix-cache hits starting inside and outside the
window, n > 1 forks, recompute preemption and swap preemption (the hybrid manager kept: the
sliding group goes to the host with its window only); the fallback (the flag) is taken and
changes nothing in the output."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_spec import NULL_BLOCK_ID

MAX_NEW = 12


@pytest.fixture(scope="module")
def gemma2_checkpoint(save_tiny_checkpoint, tiny_tokenizer_dir):
    import transformers as tf
    vocab = len(tf.AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    torch.manual_seed(7)
    cfg = tf.Gemma2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=512,
                          initializer_range=0.3, query_pre_attn_scalar=16, bos_token_id=2, eos_token_id=1,
                          pad_token_id=0)
    return save_tiny_checkpoint(tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), "hybrid_gemma2")


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    long = torch.randint(3, vocab, (44,), generator=g).tolist()
    other = torch.randint(3, vocab, (30,), generator=g).tolist()
    # Shared prefixes for prefix-cache hits: 40 tokens of ``long`` (a hit far past the window)
    # and 6 (a hit inside the first window).
    return [long, other, long[:40] + [5, 6, 7], long[:6] + other[:20]]


def _hf_greedy(path: str, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def _run(path: str, prompts, n: int = 1, **kwargs):
    llm = LLM(path, dtype="float32", max_model_len=96, seed=0, block_size=4, exact_greedy_head="off",
              **{"kv_cache_memory_bytes": 4 << 20, **kwargs})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, n=n)
    kv = llm.llm_engine.scheduler.kv_cache_manager
    free, tables = kv.free, []
    kv.free = lambda r: (tables.append(kv.get_block_table(r.request_id)), free(r))   # tables as they end
    outs = []
    for p in prompts:   # one at a time, so later prompts hit the prefix cache of earlier ones
        outs.append([c.token_ids for c in llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs])
    engine = llm.llm_engine
    engine.scheduler.kv_cache_manager.check_integrity(engine.scheduler.requests)
    engine.final_tables = tables
    return outs, engine


def _vocab(path: str) -> int:
    import json
    import os
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["vocab_size"]


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "mistral"])
def test_hybrid_equals_transformers_and_single_table(arch, make_tiny_checkpoint, gemma2_checkpoint):
    path = gemma2_checkpoint if arch == "gemma2" else make_tiny_checkpoint(arch)
    prompts = _prompts(_vocab(path))
    expected = _hf_greedy(path, prompts)
    # Chunks of 10 tokens: prefill chunks end inside windows and across their edges.
    got, engine = _run(path, prompts, max_num_batched_tokens=10, enable_chunked_prefill=True)
    kv = engine.scheduler.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager)
    assert [o[0] for o in got] == expected
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
    assert single == got


def test_forks_and_preemption_on_a_small_pool(make_tiny_checkpoint):
    path = make_tiny_checkpoint("gemma3")
    prompts = _prompts(_vocab(path))
    expected = _hf_greedy(path, prompts[:2])
    # n = 2 greedy samples fork the prompt's tables (copy-on-write per group), all at once on a
    # pool too small for both requests' full tables: recompute preemption.
    llm = LLM(path, dtype="float32", max_model_len=96, seed=0, block_size=4, exact_greedy_head="off",
              num_gpu_blocks_override=40, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]] * 2, params, use_tqdm=False)
    for i, o in enumerate(outs):
        assert [c.token_ids for c in o.outputs] == [expected[i % 2]] * 2
    sched = llm.llm_engine.scheduler
    assert isinstance(sched.kv_cache_manager, HybridKVCacheManager)
    assert sched.num_preemptions_total > 0
    sched.kv_cache_manager.check_integrity(sched.requests)
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks


def test_swap_preemption_keeps_the_hybrid_manager(make_tiny_checkpoint):
    path = make_tiny_checkpoint("gemma3")
    prompts = _prompts(_vocab(path))[:2] * 2
    # The tiny model's greedy tokens barely depend on the context: the sampled tokens' logprobs
    # (logprobs=0) are compared too.
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
        tokens = [[c.token_ids for c in o.outputs] for o in outs]
        logprobs = [lp[t].logprob for o in outs for c in o.outputs for t, lp in zip(c.token_ids, c.logprobs)]
        return (tokens, logprobs), sched, swapped

    want, sched, _ = run(kv_cache_memory_bytes=4 << 20)
    assert sched.num_preemptions_total == 0
    # 40 pages for four prompts of 44 and 30 tokens, n = 2: swap preemption, never recompute.
    got, sched, swapped = run(num_gpu_blocks_override=40, preemption_mode="swap", swap_space=0.01)
    kv = sched.kv_cache_manager
    assert type(kv) is HybridKVCacheManager and kv.num_kv_cache_groups == 2 and kv.num_cpu_blocks > 0
    assert sched.num_preemptions_by_mode["swap"] > 0 and sched.num_preemptions_by_mode["recompute"] == 0
    assert len(swapped) == sched.num_preemptions_by_mode["swap"]
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-4)
    # The sliding group went to the host with its window only (null entries in the host tables
    # of requests past their first window), and a sample whose fork sibling was swapped out
    # first copied fewer pages than its real entries (the shared full ones were on the host).
    assert any(table.count(NULL_BLOCK_ID) > 0 for _, table in swapped)
    assert any(n < len(table) - table.count(NULL_BLOCK_ID) for n, table in swapped)
