"""The real default model (Gemma 3 270M GGUF): greedy tokens equal transformers' on the same file
(transformers' outputs recorded in tests/golden/default_model.json by the script beside it).

Each test builds its own engine (a few seconds from the conversion cache) and frees it when it
ends, so no two copies of the model are alive at once."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.loaders import resolve_model
from pagedllm.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

MAX_NEW = 32


@pytest.fixture(scope="module")
def greedy_ref(default_model_reference):
    """[{prompt, prompt_token_ids, token_ids}]: transformers' float32 greedy run, EOS ignored."""
    return default_model_reference["greedy_float32"]


def test_tokenization_matches_transformers(greedy_ref):
    tok = Tokenizer.from_pretrained(resolve_model(None).folder)
    for ref in greedy_ref:
        assert tok.encode(ref["prompt"]) == ref["prompt_token_ids"]


def test_greedy_matches_transformers_float32(greedy_ref):
    llm = LLM(None, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([r["prompt"] for r in greedy_ref], params, use_tqdm=False)
    for out, ref in zip(outs, greedy_ref):
        assert out.prompt_token_ids == ref["prompt_token_ids"]
        assert len(ref["token_ids"]) == MAX_NEW
        assert out.outputs[0].token_ids == ref["token_ids"]
        assert out.outputs[0].cumulative_logprob is None  # not asked for (SamplingParams.logprobs)
    m = llm.llm_engine.kv_cache_manager
    assert m.num_free_blocks == m.num_blocks


def test_greedy_with_chunked_prefill_and_preemption(greedy_ref):
    """16-token prefill chunks and a pool of 128 tokens per layer (preemption) give transformers' tokens."""
    # The hybrid KV cache groups the 18 layers into 6 groups of 3 (1 full, 5 window-512); a page
    # holds 16 tokens of one group, so 8 pages per group plus the null block = 128 tokens a layer.
    llm = LLM(None, dtype="float32", max_model_len=128, num_gpu_blocks_override=6 * 8 + 1,
              max_num_batched_tokens=16, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    # Each prompt needs 3-4 blocks of 16 a group at the end; five at once need about 16 a group.
    outs = llm.generate([r["prompt"] for r in greedy_ref], params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    for out, ref in zip(outs, greedy_ref):
        assert out.outputs[0].token_ids == ref["token_ids"]
    m = llm.llm_engine.kv_cache_manager
    assert m.num_free_blocks == m.num_blocks


def test_bfloat16_matches_transformers_by_top5_rule(default_model_reference):
    """bf16 (vLLM's rule): equal until the first mismatch, where each side's token is in the
    other's top 5 (transformers' side: the model cast to bfloat16, recorded)."""
    refs = default_model_reference["greedy_bfloat16"]
    llm = LLM(None, dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    outs = llm.generate([r["prompt"] for r in refs], params, use_tqdm=False)
    for ref, out in zip(refs, outs):
        ours = out.outputs[0].token_ids
        assert len(ours) == len(ref["token_ids"]) == 24
        for step, (a, b) in enumerate(zip(ours, ref["token_ids"])):
            if a != b:
                our_top5 = list(out.outputs[0].logprobs[step].keys())
                assert a in ref["top5"][step] and b in our_top5, (ref["prompt"], step, a, b)
                break


def test_bfloat16_greedy_does_not_depend_on_the_batch():
    """Batch-invariant bf16 (README): 12 workload prompts' greedy bf16 tokens are the same, 12/12,
    run concurrently (one generate call) and one at a time, both in 32-token prefill chunks without
    prefix caching, and through an engine with prefix caching and whole-prompt prefills, cold and
    then with every prompt's full blocks cached (a prompt's rest then runs as a chunk over cached
    context). oneDNN's kernels change their rounding with
    the batch (issue 29: 7/12 and 10/12 on AMX); the bf16 GEMMs (AVX-512, AMX, AVX2) and the
    paged-attention kernel do not (tests/layers/, tests/attention/test_attention_batch_invariance.py).
    On AVX2 the one-at-a-time tokens come from the bf16-logit greedy head, the concurrent ones mostly
    from the full head: the same tokens, ties included."""
    import gc
    import json

    from pagedllm.benchmarks.datasets import dataset_file
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.layers.bf16_gemm import AMX_KERNEL, AVX2_KERNEL, BF16_KERNEL, bf16_kernel_for
    from pagedllm.layers.int8_gemm import int8_avx2_unavailable

    args = EngineArgs()   # the engine's path ($PAGEDLLM_CPU_ISA, $PAGEDLLM_CPU_BF16_GEMM included)
    kernel, why = bf16_kernel_for(args.cpu_isa, kernel=args.cpu_bf16_gemm)
    if kernel not in (BF16_KERNEL, AMX_KERNEL, AVX2_KERNEL):
        pytest.skip(f"bf16 linear layers run oneDNN here: {why}")
    with open(dataset_file("workload"), encoding="utf-8") as f:
        # The first 12 workload prompts, cut to 300 characters (~60-70 tokens: 2-3 32-token chunks).
        prompts = [json.loads(line)["prompt"][:300] for line in f][:12]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    common = dict(dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=64 << 20)

    def tokens(llm, batch):
        return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]

    llm = LLM(None, enable_prefix_caching=False, max_num_batched_tokens=32, **common)
    together = tokens(llm, prompts)
    alone = [tokens(llm, [p])[0] for p in prompts]
    head = llm.llm_engine.executor.driver_worker.model_runner.greedy_head
    if kernel == AVX2_KERNEL and int8_avx2_unavailable(args.cpu_isa) is None:
        # The bf16-logit greedy head (sample/greedy_head.py) took the steps of up to 3 rows, each of
        # the 12 x 8 tokens one at a time among them: "alone" is its tokens, "together" the full head's.
        assert head is not None and head.logits_kernel is not None
        assert head.num_rows >= 12 * 8 and head.num_fallback_rows <= head.num_rows // 10
    del llm
    gc.collect()
    llm = LLM(None, enable_prefix_caching=True, **common)
    whole = tokens(llm, prompts)
    assert llm.llm_engine.kv_cache_manager.prefix_cache_stats.hits == 0
    cached = tokens(llm, prompts)
    assert llm.llm_engine.kv_cache_manager.prefix_cache_stats.hits > 0
    assert [t == together[i] for i, t in enumerate(alone)] == [True] * 12
    assert whole == together
    assert cached == together


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "adaptive": False},
    {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.0, "adaptive": False}])
def test_greedy_with_speculative_decoding_matches_transformers_float32(greedy_ref, spec):
    """Speculative decoding (drafts always verified) keeps transformers' float32 greedy tokens."""
    llm = LLM(None, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20, seed=0,
              speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([r["prompt"] for r in greedy_ref], params, use_tqdm=False)
    for out, ref in zip(outs, greedy_ref):
        assert out.outputs[0].token_ids == ref["token_ids"]
    assert llm.llm_engine.spec_decoder.stats.num_draft_tokens > 0
    m = llm.llm_engine.kv_cache_manager
    assert m.num_free_blocks == m.num_blocks
