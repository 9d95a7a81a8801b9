"""Slots under traffic: one slot and a host cache of two for three adapters (LRU eviction and
reloads from disk), adapters loaded and removed while requests run, and tensor parallelism (two
ranks: A / B sharded as their base layers); every request gets PEFT's tokens."""

import pytest
from lora_utils import GREEDY, PROMPTS, lora_engine_args

from pagedllm import LoRARequest
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine


def _traffic(engine, loras, steps_between=1, on_step=None):
    """Add every (prompt, adapter) pair, ``steps_between`` steps apart, then step to the end;
    ``on_step(i)`` runs before step ``i``. Returns request id -> token ids."""
    pairs = [(p, lo) for lo in loras for p in PROMPTS]
    out, i = {}, 0
    for k, (prompt, lora) in enumerate(pairs):
        engine.add_request(f"r{k}", prompt, GREEDY, lora_request=lora)
        for _ in range(steps_between):
            if on_step:
                on_step(i)
            out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            i += 1
    while engine.has_unfinished_requests():
        if on_step:
            on_step(i)
        out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        i += 1
    return out, pairs


def _expected(pairs, llama_lora, loras):
    refs = {lo: ref for lo, ref in zip(loras, llama_lora["refs"])}
    return {f"r{k}": (refs[lo] if lo is not None else llama_lora["base_ref"])[PROMPTS.index(p)]
            for k, (p, lo) in enumerate(pairs)}


def test_one_slot_three_adapters_loaded_and_removed_under_traffic(llama_lora, caplog):
    caplog.set_level("INFO", logger="pagedllm.lora")
    engine = LLMEngine(EngineArgs(**lora_engine_args(llama_lora["base"], max_loras=1, max_cpu_loras=2)))
    loras = [LoRARequest(f"a{i}", i + 1, a) for i, a in enumerate(llama_lora["adapters"])]
    assert engine.add_lora(loras[0]) is True and engine.add_lora(loras[0]) is False
    manager = engine.executor.driver_worker.lora_manager
    seen_slots = set()

    def on_step(i):
        seen_slots.add(tuple(manager.slots))
        if i == 5:
            assert engine.remove_lora(2)     # removed while its requests wait or run: reloaded from disk

    got, pairs = _traffic(engine, [*loras, None], on_step=on_step)
    assert got == _expected(pairs, llama_lora, loras)
    assert {s[0] for s in seen_slots} >= {1, 2, 3}    # every adapter took the one slot in turn
    assert len(manager.list_loras()) <= 2               # the host cache stays within max_cpu_loras
    assert "LoRA adapter 'a0' (id 1, r=8, 21 modules) loaded from" in caplog.text


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_tensor_parallel_two_ranks_equal_peft(llama_lora):
    engine = LLMEngine(EngineArgs(**lora_engine_args(llama_lora["base"], max_loras=2, tensor_parallel_size=2,
                                                     cpu_threads_per_rank=1)))
    try:
        loras = [LoRARequest(f"a{i}", i + 1, a) for i, a in enumerate(llama_lora["adapters"][:2])]
        got, pairs = _traffic(engine, [*loras, None], steps_between=0)
        assert got == _expected(pairs, llama_lora, loras)
    finally:
        engine.shutdown()
