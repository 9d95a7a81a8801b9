"""LoRA without a model: the adapter in the prefix-cache key (hand-computed hashes, hits), and
admission within ``max_loras`` adapters (a request for an adapter without a slot waits without
holding back requests for resident adapters); config and adapter-file errors name the field."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import ROOT_HASH
from pagedllm.core.request import Request
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.lora.adapter import read_peft_config
from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams

A, B = LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 2, "/adapters/b")


def make(max_loras=0, num_blocks=32):
    kv = KVCacheManager(block_size=4, num_blocks=num_blocks, enable_caching=True)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(cfg, kv, max_loras=max_loras), kv


def req(rid, prompt, lora=None, max_tokens=2):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens, lora_request=lora)


def step(sched, token=7):
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[token] * len(ids),
                                                    sampled_logprobs=[0.0] * len(ids)))
    return out


def _hand_hash(parent, tokens, extra):
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    if extra:
        h.update(b"\x00extra:" + repr(extra).encode("utf-8"))
    return h.digest()


def test_adapter_is_in_the_block_hash_and_only_the_same_adapter_hits():
    sched, kv = make()
    prompt = list(range(100, 109))   # 9 tokens: 2 full blocks
    a1 = req("a1", prompt, A)
    sched.add_request(a1)
    step(sched)
    h0 = _hand_hash(ROOT_HASH, prompt[:4], ("lora", 1, "/adapters/a"))
    assert a1.block_hashes[:2] == [h0, _hand_hash(h0, prompt[4:8], ("lora", 1, "/adapters/a"))]
    base = _hand_hash(ROOT_HASH, prompt[:4], None)
    assert base != h0
    for rid, lora, hit, first_hash in (("b1", B, 0, None), ("base", None, 0, base), ("a2", A, 8, h0)):
        r = req(rid, prompt, lora)
        sched.add_request(r)
        step(sched)
        assert r.num_cached_tokens == hit, rid
        if first_hash is not None:
            assert r.block_hashes[0] == first_hash


def test_admission_within_max_loras_skips_without_blocking():
    sched, _ = make(max_loras=1)
    for rid, lora in (("a1", A), ("b1", B), ("a2", A), ("n1", None)):
        sched.add_request(req(rid, [1, 2, 3], lora, max_tokens=3))
    out = sched.schedule()
    # b1 waits (adapter b has no slot while a runs); a2 and the base request go ahead of it.
    assert list(out.num_scheduled_tokens) == ["a1", "a2", "n1"]
    assert sched.running_lora_ids() == {1} and sched.waiting_lora_ids() == {2}
    ids = list(out.num_scheduled_tokens)
    sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[7] * 3,
                                                    sampled_logprobs=[0.0] * 3))
    for _ in range(3):   # a1 and a2 finish after 3 tokens
        step(sched)
    assert "b1" in sched.requests and sched.requests["b1"].status.name == "RUNNING"
    assert sched.running_lora_ids() == {2}


def test_config_and_adapter_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="max_loras"):
        LoRAConfig(enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/p")
    good = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    for change, field in (({"bias": "all"}, "bias"), ({"use_dora": True}, "use_dora"),
                          ({"target_modules": ["q_proj", "lm_head"]}, "target_modules"),
                          ({"r": 32}, "max_lora_rank"), ({"modules_to_save": ["lm_head"]}, "modules_to_save")):
        (tmp_path / "adapter_config.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(ValueError, match=field):
            read_peft_config(str(tmp_path), max_lora_rank=16)
    (tmp_path / "adapter_config.json").write_text(json.dumps({**good, "use_rslora": True}))
    cfg = read_peft_config(str(tmp_path), max_lora_rank=16)
    assert cfg.target_modules == ("q_proj", "v_proj") and cfg.scaling == pytest.approx(16 / 8 ** 0.5)


def test_lora_requests_info_gauge_shows_the_current_adapters():
    from prometheus_client import CollectorRegistry

    from pagedllm.core.sched_output import SchedulerStats
    from pagedllm.metrics.prometheus import PrometheusStatLogger
    from pagedllm.metrics.stats import IterationStats

    sched, _ = make(max_loras=1)
    for rid, lora in (("a1", A), ("b1", B), ("n1", None)):
        sched.add_request(req(rid, [1, 2, 3], lora))
    sched.schedule()
    stats = sched.make_stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters, stats.max_lora) == (["a"], ["b"], 1)
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", 64, 64, registry)

    def series():
        return [(s.labels["running_lora_adapters"], s.labels["waiting_lora_adapters"], s.labels["max_lora"])
                for metric in registry.collect() if metric.name == "pagedllm:lora_requests_info"
                for s in metric.samples]

    logger.record(stats, IterationStats())
    assert series() == [("a", "b", "1")]
    logger.record(SchedulerStats(running_lora_adapters=["a", "b"], max_lora=1), IterationStats())
    assert series() == [("a,b", "", "1")]   # one series: the previous one is removed
    logger.record(SchedulerStats(), IterationStats())   # LoRA off: nothing changes
    assert series() == [("a,b", "", "1")]
