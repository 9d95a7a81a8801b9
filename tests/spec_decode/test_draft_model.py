"""Model-based drafts (``spec_decode/draft_model.py``): "self_int8" and "draft_model" leave every
output token equal to the same engine without speculation (greedy and seeded sampling), with
prefix caching, preemption (recompute and swap) and n=2; the draft pool shares the target's block
ids, so the tables stay consistent and every block is freed. Bad configs fail before any weight
loads."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from pagedllm import LLM, SamplingParams

K = 4
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], list(range(30, 49)),
           [5, 9, 13, 200, 17, 3, 3, 40, 41, 5, 9, 13], [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 77, 78],
           list(range(100, 131))]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=11, max_tokens=40, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=5, top_p=0.9, top_k=50, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)]


@pytest.fixture(scope="module")
def target(make_tiny_checkpoint) -> str:
    return make_tiny_checkpoint("llama")


def _save_llama(path: str, tokenizer_dir: str, num_layers: int, seed: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         initializer_range=0.3, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                         tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for f in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, f), path)
    return path


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory, tiny_tokenizer_dir) -> str:
    """A different llama (1 layer, other widths and kv heads, tied head) with the target's tokenizer."""
    return _save_llama(str(tmp_path_factory.mktemp("draft_small")), tiny_tokenizer_dir, 1, 7)


def _without_last_layer(target: str, path: str) -> str:
    """Save ``target`` without its last decoder layer (and its ``layer_types`` entry, if any) and
    its tokenizer files into ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    model.model.layers = model.model.layers[:-1]
    model.config.num_hidden_layers = len(model.model.layers)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:-1]
    model.save_pretrained(path)
    for f in os.listdir(target):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            shutil.copy(os.path.join(target, f), path)
    return path


@pytest.fixture(scope="module")
def truncated_draft(tmp_path_factory, target) -> str:
    """The target without its last decoder layer (2 of 3 layers): a smaller draft that agrees
    with the target sometimes."""
    return _without_last_layer(target, str(tmp_path_factory.mktemp("draft_truncated")))


@pytest.fixture(scope="module")
def other_tokenizer_draft(tmp_path_factory, tiny_tokenizer_dir) -> str:
    """The same small llama, but its tokenizer swaps the ids of two tokens."""
    path = _save_llama(str(tmp_path_factory.mktemp("draft_other_tok")), tiny_tokenizer_dir, 1, 7)
    with open(os.path.join(path, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[50:52]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    return path


def _run(model: str, prompts=PROMPTS, params=PARAMS, spec=None, dtype="float32", **kw):
    kw.setdefault("kv_cache_memory_bytes", 1 << 22)
    kw.setdefault("block_size", 8)
    llm = LLM(model, dtype=dtype, max_model_len=128, seed=0, speculative_config=spec, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    kv.check_integrity(engine.scheduler.requests)
    assert kv.num_free_blocks == kv.num_blocks
    tokens = [[c.token_ids for c in o.outputs] for o in outs]
    return tokens, engine


@pytest.fixture(scope="module")
def baseline(target):
    return _run(target)[0]


def _spec(method: str, **extra) -> dict:
    return {"method": method, "num_speculative_tokens": K, "adaptive": False, **extra}


def _assert_drafted(engine, min_rate: float = 0.0):
    stats = engine.spec_decoder.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens > 0
    assert stats.acceptance_rate >= min_rate, stats
    return stats


def test_self_int8_equals_no_speculation(target, baseline):
    tokens, engine = _run(target, spec=_spec("self_int8"))
    assert tokens == baseline
    stats = _assert_drafted(engine)
    # The greedy rows' drafts are the int8 copy's argmaxes: they agree with the target often.
    assert stats.num_accepted_tokens_per_pos[0] > 0
    print("self_int8:", stats)
    assert engine.speculative_config.method == "self_int8"


def test_draft_model_equals_no_speculation(target, small_draft, truncated_draft, baseline):
    # An unrelated random draft (its drafts are almost never accepted) and a truncated copy.
    tokens, engine = _run(target, spec=_spec("draft_model", model=small_draft))
    assert tokens == baseline
    assert engine.spec_decoder.stats.num_draft_tokens > 0
    tokens, engine = _run(target, spec=_spec("draft_model", model=truncated_draft))
    assert tokens == baseline
    print("truncated draft:", _assert_drafted(engine))


@pytest.fixture(scope="module")
def hybrid_target(make_tiny_checkpoint) -> str:
    """Tiny Gemma 3: sliding, full, sliding, full (window 8: two blocks of 4)."""
    return make_tiny_checkpoint("gemma3")


@pytest.fixture(scope="module")
def hybrid_draft(tmp_path_factory, hybrid_target) -> str:
    """The Gemma 3 target without its last layer (sliding, full, sliding): a hybrid draft that
    agrees with the target often."""
    return _without_last_layer(hybrid_target, str(tmp_path_factory.mktemp("draft_gemma3")))


def test_draft_models_keep_the_hybrid_kv_cache(hybrid_target, hybrid_draft, small_draft, caplog, monkeypatch):
    """The hybrid KV cache with a draft model: the draft's pool is indexed by the full group's
    table, so a full-attention draft (llama), a hybrid one (truncated Gemma 3) and "self_int8"
    (the target itself) all keep it; greedy and seeded tokens equal no speculation, with prompts
    several windows long, rejected drafts cut back, prefix-cache hits and a small pool that
    preempts (recompute)."""
    from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
    from pagedllm.core.kv_cache_spec import NULL_BLOCK_ID
    from pagedllm.spec_decode.draft_model import DraftModel

    tables = []   # the draft's tables: the full group's, never a sliding group's null block
    propose = DraftModel.propose
    monkeypatch.setattr(DraftModel, "propose", lambda self, items: (
        tables.extend(list(it.block_table) for it in items), propose(self, items))[1])
    long = [(11 * j) % 250 + 3 for j in range(44)]
    prompts = [long, [(7 * j) % 240 + 5 for j in range(30)], long[:40] + [5, 6, 7], PROMPTS[0], PROMPTS[1],
               PROMPTS[4]]
    params = [PARAMS[0], PARAMS[1], PARAMS[2], PARAMS[4], PARAMS[3], PARAMS[0]]
    for blocks in (41, 200):   # a pool that preempts (recompute), one where the shared prefix stays cached
        kw = dict(block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=blocks)
        want, engine = _run(hybrid_target, prompts, params, **kw)
        assert isinstance(engine.kv_cache_manager, HybridKVCacheManager)
        for spec in (_spec("draft_model", model=small_draft), _spec("draft_model", model=hybrid_draft),
                     _spec("self_int8")):
            with caplog.at_level("INFO", logger="pagedllm.engine.llm_engine"):
                caplog.clear()
                tokens, engine = _run(hybrid_target, prompts, params, spec=spec, **kw)
            assert isinstance(engine.kv_cache_manager, HybridKVCacheManager), spec
            assert "Hybrid KV cache manager off" not in caplog.text
            assert tokens == want, (blocks, spec)
            if blocks == 41:
                assert engine.scheduler.num_preemptions_total > 0, spec
            else:
                assert engine.kv_cache_manager.prefix_cache_stats.hits > 0, spec
            stats = engine.spec_decoder.stats
            assert stats.num_draft_tokens > 0, spec
            assert max(map(len, tables)) > 4 and not any(NULL_BLOCK_ID in t for t in tables), spec
            tables.clear()
            if spec.get("model") == small_draft:   # an unrelated draft: rejected drafts are cut back
                assert stats.num_accepted_tokens < stats.num_draft_tokens, (spec, stats)
            else:   # close drafts: accepted
                assert stats.num_accepted_tokens > 0, (spec, stats)


def test_draft_model_on_an_all_sliding_model_falls_back(make_tiny_checkpoint, small_draft, caplog):
    """Mistral (every layer windowed: one sliding group) has no full table for the draft's pool."""
    mistral = make_tiny_checkpoint("mistral")
    want, _ = _run(mistral, PROMPTS[:2], PARAMS[:2], block_size=4)
    with caplog.at_level("INFO", logger="pagedllm.engine.llm_engine"):
        tokens, engine = _run(mistral, PROMPTS[:2], PARAMS[:2], spec=_spec("draft_model", model=small_draft),
                              block_size=4)
    assert engine.kv_cache_groups.fallback_reason is not None
    assert "a draft model reads the full-attention group's block table, and every layer of this model has a " \
           "sliding window" in caplog.text
    assert tokens == want


def test_target_as_its_own_draft_accepts_every_greedy_draft(target):
    """With the target's own weights as the draft (float32), a greedy draft is the target's argmax
    at each position; every draft is accepted only if the draft's K/V bookkeeping (valid prefix,
    lookahead blocks, trims) is right."""
    greedy = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(PROMPTS)
    base, _ = _run(target, params=greedy)
    tokens, engine = _run(target, params=greedy, spec=_spec("draft_model", model=target))
    assert tokens == base
    stats = _assert_drafted(engine)
    assert stats.num_accepted_tokens == stats.num_draft_tokens, stats


def test_prefix_caching_hits(target, truncated_draft):
    shared = list(range(60, 84))   # three full blocks shared by every prompt
    prompts = [shared + [5, 6, 7], shared + [9, 9], shared + [1, 2, 3, 4, 5, 6, 7, 8, 9], shared]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)] * 2
    base, _ = _run(target, prompts, params, enable_prefix_caching=True)
    for spec in (_spec("self_int8"), _spec("draft_model", model=truncated_draft)):
        # One at a time, so later prompts hit the first one's cached blocks.
        tokens, engine = _run(target, prompts, params, spec=spec, enable_prefix_caching=True, max_num_seqs=1)
        assert tokens == base
        assert engine.kv_cache_manager.prefix_cache_stats.hits > 0
        _assert_drafted(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_small_pool_preempts(target, baseline, mode):
    extra = {"swap_space": 0.01} if mode == "swap" else {}
    tokens, engine = _run(target, spec=_spec("self_int8"), num_gpu_blocks_override=18, kv_cache_memory_bytes=None,
                          preemption_mode=mode, **extra)
    assert tokens == baseline
    assert engine.scheduler.num_preemptions_total > 0
    _assert_drafted(engine)


def test_n2_and_seeded(target, truncated_draft):
    params = [SamplingParams(temperature=0.8, seed=21, n=2, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, n=2, max_tokens=24, ignore_eos=True)]
    prompts = PROMPTS[:2]
    base, _ = _run(target, prompts, params)
    for spec in (_spec("self_int8"), _spec("draft_model", model=truncated_draft)):
        tokens, engine = _run(target, prompts, params, spec=spec)
        assert tokens == base
        _assert_drafted(engine)


def test_adaptive_drafting_runs(target, baseline):
    tokens, engine = _run(target, spec={"method": "self_int8", "num_speculative_tokens": K})
    assert tokens == baseline


def test_self_int8_bfloat16(target):
    """bf16 target, bf16 + int8 draft: the outputs are valid and the pool is consistent (batched
    verification and one-token decoding may round differently in bf16, so equality with the
    baseline is not asserted)."""
    tokens, engine = _run(target, spec=_spec("self_int8"), dtype="bfloat16")
    assert [len(t[0]) for t in tokens] == [p.max_tokens for p in PARAMS]
    _assert_drafted(engine)


def test_draft_with_other_tokenizer_fails_before_loading(target, other_tokenizer_draft):
    with pytest.raises(ValueError, match=r"speculative_config: draft model .*token id \d+ is"):
        LLM(target, dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 22,
            speculative_config=_spec("draft_model", model=other_tokenizer_draft))


@pytest.mark.parametrize("spec, extra, match", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, {}, "needs 'model'"),
    ({"method": "self_int8", "num_speculative_tokens": 2, "model": "x"}, {}, "'model' applies to method 'draft_model'"),
    ({"method": "self_int8"}, {}, "num_speculative_tokens is required"),
    ({"method": "self_int8", "num_speculative_tokens": 2}, {"tensor_parallel_size": 2}, "tensor_parallel_size=1"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent/draft"}, {},
     "speculative_config: draft model '/nonexistent/draft'"),
    ({"method": "self_int8", "num_speculative_tokens": 2}, {"quantization": "int8"}, "already runs quantization"),
])
def test_bad_configs(target, spec, extra, match):
    with pytest.raises(ValueError, match=match):
        LLM(target, dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 22, speculative_config=spec,
            **extra)


def test_multiproc_executor(target, baseline):
    """The draft runs in the worker process too (``load_draft_model`` through ``collective_rpc``)."""
    tokens, engine = _run(target, spec=_spec("self_int8"), distributed_executor_backend="mp")
    try:
        assert tokens == baseline
        _assert_drafted(engine)
    finally:
        engine.executor.shutdown()


def test_scheduler_lookahead_blocks_are_trimmed():
    """Without a model: a sampling step gets ``k`` lookahead slots (more blocks), the worker's
    drafts reach the next step, and the table is back to ``cdiv(num_computed, block_size)``."""
    from pagedllm.config import SchedulerConfig, SpeculativeConfig
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.request import Request
    from pagedllm.core.sched_output import ModelRunnerOutput
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.spec_decode.controller import SpecDecodeController

    kv = KVCacheManager(block_size=4, num_blocks=16)
    spec = SpecDecodeController(SpeculativeConfig(method="self_int8", num_speculative_tokens=3, adaptive=False), None)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv,
                      spec_decoder=spec)
    req = Request("a", list(range(100, 108)), SamplingParams(max_tokens=20, ignore_eos=True), max_tokens=20)
    sched.add_request(req)
    out = sched.schedule()
    assert out.num_lookahead_tokens == {"a": 3}
    assert len(kv.get_block_table("a")) == 3          # cdiv(8 + 3, 4)
    sched.update_from_output(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[7], sampled_logprobs=[0.0],
                                                    draft_token_ids={"a": [8, 9, 10]}))
    assert len(kv.get_block_table("a")) == 2          # cdiv(8, 4): the lookahead block went back
    kv.check_integrity(sched.requests)
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [8, 9, 10]}
    assert out.num_scheduled_tokens == {"a": 4}
    sched.update_from_output(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[11], sampled_logprobs=[0.0],
                                                    num_accepted_tokens={"a": 1}))
    assert req.output_token_ids == [7, 8, 11]
    assert len(kv.get_block_table("a")) == 3          # cdiv(10, 4)
    kv.check_integrity(sched.requests)
