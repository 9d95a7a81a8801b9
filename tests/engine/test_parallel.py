"""Tensor and pipeline parallelism over gloo on the CPU: the multi-process engine gives the
single-process engine's tokens (greedy and seeded sampling), logprobs within 1e-4, and
transformers' greedy tokens, on tiny random checkpoints; a killed worker is a clear error, not a
hang; bad sizes are refused before any weight loads; no worker process outlives its engine."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import threading
import time

import pytest

from pagedllm import SamplingParams
from pagedllm.config import ParallelConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.executor import Executor, MultiprocExecutor
from pagedllm.executor.multiproc import threads_per_rank

from parallel_utils import PROMPTS, assert_same_outputs, run_requests, tiny_engine

# Every test here but the default model's starts rank processes: one at a time (conftest.py).
pytestmark = pytest.mark.multiprocess

MAX_TOKENS = 12


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
            SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)]


@pytest.fixture(scope="module")
def llama_one_kv_head(tmp_path_factory, tiny_tokenizer_dir) -> str:
    """A tiny Llama with 4 query heads and ONE KV head: at tensor_parallel_size=2 both ranks hold
    a replica of it (as with the default Gemma 3 270M)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    vocab = len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    torch.manual_seed(4321)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                         initializer_range=0.3, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                         tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny_llama_1kv")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    for f in os.listdir(tiny_tokenizer_dir):
        shutil.copy(os.path.join(tiny_tokenizer_dir, f), path)
    return str(path)


def _run(engine: LLMEngine) -> dict:
    return run_requests(engine, zip(PROMPTS, _params()))


_REFERENCE: dict[str, dict] = {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch,tp,pp", [
    ("llama_1kv", 2, 1),    # query heads split, the one KV head replicated
    ("gemma3", 2, 1),       # KV heads split; tied vocab-parallel head
    ("llama_1kv", 1, 2),    # untied head on the last stage
    ("gemma3", 1, 2),       # tied embedding on the first and the last stage
    ("gemma3", 2, 2),       # 4 ranks (1 thread each on 2 cores)
    ("qwen2", 2, 1),        # q/k/v biases split with their rows
], ids=["llama-tp2", "gemma3-tp2", "llama-pp2", "gemma3-pp2", "gemma3-tp2-pp2", "qwen2-tp2"])
def test_parallel_engine_equals_single_process(make_tiny_checkpoint, llama_one_kv_head, hf_greedy, arch, tp, pp,
                                               caplog, capfd):
    folder = llama_one_kv_head if arch == "llama_1kv" else make_tiny_checkpoint(arch)
    if arch not in _REFERENCE:
        single = tiny_engine(folder)
        _REFERENCE[arch] = _run(single)
        single.shutdown()
        # The single-process engine itself equals transformers (greedy, float32).
        assert [_REFERENCE[arch][f"r{i}"][0] for i in (0, 1)] == hf_greedy(folder, PROMPTS[:2], MAX_TOKENS)
    caplog.set_level(logging.INFO, logger="pagedllm")   # the server's default level
    capfd.readouterr()
    engine = tiny_engine(folder, tensor_parallel_size=tp, pipeline_parallel_size=pp, cpu_threads_per_rank=1)
    processes = list(engine.executor.processes)
    try:
        assert isinstance(engine.executor, MultiprocExecutor) and len(processes) == tp * pp
        # The start-up lines come from the driver rank's process (into the same stderr), once.
        log, driver = capfd.readouterr().err, engine.executor.driver_rank
        if arch == "gemma3":   # hybrid KV cache: a full group and a window-8 group of 2 layers
            # per 128-token request 128/8 full blocks + cdiv(8 - 1 + 1, 8) + 1 window blocks; the pool less
            # the null block and one step's prefill chunk (max_num_batched_tokens / 8) of the window group
            chunk_blocks = engine.scheduler_config.max_num_batched_tokens // 8
            concurrency = (engine.num_blocks - 1 - chunk_blocks) / (16 + 2)
        else:   # one table: blocks x 8 tokens / 128 tokens
            concurrency = engine.num_blocks * 8 / 128
        assert re.search(rf"rank{driver} INFO pagedllm\.worker\.worker: KV cache: {engine.num_blocks} blocks x 8 "
                         rf"tokens .*maximum concurrency for 128-token requests: {concurrency:.2f}x", log), log
        assert re.search(rf"rank{driver} INFO pagedllm\.worker\.worker: Kernel plan:\n(  .*\n)*  attention backend ",
                         log), log
        assert re.search(rf"rank{driver} INFO pagedllm\.worker\.worker: Model weights: ", log), log
        assert not re.search(rf"rank(?!{driver} )\d+ INFO", log), log
        assert_same_outputs(_run(engine), _REFERENCE[arch])
        # Callables cannot cross to the worker processes.
        with pytest.raises(ValueError, match="logits_processors"):
            engine.add_request("lp", [1, 2, 3], SamplingParams(logits_processors=[lambda ids, logits: logits]))
        engine.executor.check_health()
    finally:
        engine.shutdown()
    assert not any(p.is_alive() for p in processes)


_HYBRID_REFERENCE: dict[str, dict] = {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,pp,partition", [
    (1, 2, "1,3"),   # stage 0: one sliding layer (no full-attention layer), stage 1: 2 + 1
    (2, 1, None),    # every rank holds every layer: same groups
], ids=["pp2", "tp2"])
def test_hybrid_kv_cache_split_over_ranks(make_tiny_checkpoint, hf_greedy, tp, pp, partition):
    """Tiny Gemma 3 (sliding, full, sliding, full; window 8 = two 4-token blocks) with the hybrid KV
    cache over two ranks: greedy float32 tokens and logprobs (1e-4) equal one process's (also
    hybrid), whose tokens equal transformers', with prompts several windows long, chunked prefill across window edges and a
    prefix-cache hit; the engine's tables pass ``check_integrity`` and every block comes back."""
    from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager

    # Untied LM head: tied, the tiny Gemma 3's greedy output is the last token repeated whatever
    # the K/V hold.
    folder = make_tiny_checkpoint("gemma3", tie_word_embeddings=False)
    long = [(11 * j) % 250 + 3 for j in range(44)]
    prompts = [long, [(7 * j) % 240 + 5 for j in range(30)], long[:40] + [5, 6, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)

    def engine(**kwargs) -> LLMEngine:
        return LLMEngine(EngineArgs(model=folder, dtype="float32", max_model_len=96, seed=0, block_size=4,
                                    kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=10,
                                    enable_chunked_prefill=True, exact_greedy_head="off", **kwargs))

    if not _HYBRID_REFERENCE:
        single = engine()
        assert isinstance(single.kv_cache_manager, HybridKVCacheManager)
        _HYBRID_REFERENCE.update(run_requests(single, [(p, params) for p in prompts]))
        single.shutdown()
        expected = hf_greedy(folder, prompts, MAX_TOKENS)
        # The outputs depend on the context: not one repeated token, different for every prompt.
        assert all(len(set(t)) > 1 for t in expected) and len({tuple(t) for t in expected}) == 3, expected
        assert [_HYBRID_REFERENCE[f"r{i}"][0] for i in range(3)] == expected
    split = engine(tensor_parallel_size=tp, pipeline_parallel_size=pp, pp_layer_partition=partition,
                   cpu_threads_per_rank=1)
    try:
        kv = split.kv_cache_manager
        assert isinstance(kv, HybridKVCacheManager) and kv.windows == (None, 8)
        assert_same_outputs(run_requests(split, [(p, params) for p in prompts]), _HYBRID_REFERENCE)
        assert kv.prefix_cache_stats.hits > 0
        kv.check_integrity(split.scheduler.requests)
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        split.shutdown()


def _run_many(engine: LLMEngine) -> dict:
    """Eight requests (greedy with logprobs, greedy, seeded sampling), prompts of 9..30 tokens."""
    requests = []
    for i in range(8):
        prompt = [(7 * i + 3 * j) % 200 + 3 for j in range(9 + 3 * i)]
        params = (SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2) if i % 3 == 0 else
                  SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True) if i % 3 == 1 else
                  SamplingParams(temperature=1.0, top_k=20, seed=100 + i, max_tokens=10, ignore_eos=True, logprobs=1))
        requests.append((prompt, params))
    return run_requests(engine, requests)


@pytest.mark.timeout(300)
def test_pipeline_keeps_two_batches_in_flight_with_the_same_tokens(make_tiny_checkpoint, monkeypatch):
    """PP=2: the engine writes a second step before the first's output is read (stage 0 runs
    batch k+1 while stage 1 runs batch k); tokens (greedy, seeded) and logprobs equal one process.
    Threads per rank come from $PAGEDLLM_CPU_THREADS_PER_RANK, read once by ``EngineArgs``."""
    folder = make_tiny_checkpoint("gemma3")
    # A 32-token budget splits the 8 prompts over several batches, so there is work for two.
    single = tiny_engine(folder, max_num_batched_tokens=32)
    want = _run_many(single)
    single.shutdown()
    monkeypatch.setenv("PAGEDLLM_CPU_THREADS_PER_RANK", "1")
    engine = tiny_engine(folder, pipeline_parallel_size=2, max_num_batched_tokens=32)
    processes = list(engine.executor.processes)
    try:
        assert engine.parallel_config.cpu_threads_per_rank == 1
        assert engine.batch_queue_size == engine.executor.max_concurrent_batches == 2
        engine.executor.collective_rpc("get_step_times", (True,))
        assert_same_outputs(_run_many(engine), want)
        assert engine.executor.max_num_batches_in_flight == 2
        # Every rank ran every step with 1 thread; stage 0 sent and stage 1 received each step.
        times = engine.executor.collective_rpc("get_step_times")
        assert [t["num_threads"] for t in times] == [1, 1] and times[0]["num_steps"] == times[1]["num_steps"] > 0
        assert times[0]["send"] > 0 and times[1]["recv"] > 0 and times[0]["recv"] == times[1]["send"] == 0
        assert engine.scheduler.num_in_flight == 0 and not engine._batch_queue
        kv = engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        engine.shutdown()
    assert not any(p.is_alive() for p in processes)


@pytest.mark.timeout(120)
def test_killed_worker_is_a_clear_error_not_a_hang(llama_one_kv_head):
    engine = tiny_engine(llama_one_kv_head, tensor_parallel_size=2, cpu_threads_per_rank=1)
    processes = list(engine.executor.processes)
    try:
        engine.add_request("r0", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(processes[1].pid, signal.SIGKILL)
        processes[1].join(timeout=10)
        errors: list[BaseException] = []

        def step():
            try:
                engine.step()
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                errors.append(e)

        t0 = time.monotonic()
        thread = threading.Thread(target=step, daemon=True)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the step hung after a worker died"
        assert time.monotonic() - t0 < 60
        assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
        assert "rank 1" in str(errors[0])
        with pytest.raises(RuntimeError, match="rank 1"):   # and it stays an error
            engine.step()
        with pytest.raises(RuntimeError):
            engine.executor.check_health()
    finally:
        engine.shutdown()
    for p in processes:
        p.join(timeout=10)
    assert not any(p.is_alive() for p in processes)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)   # a zombie has exited
    except FileNotFoundError:
        return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_signal_to_the_engine_process_ends_every_rank(llama_one_kv_head, tmp_path, sig):
    import subprocess
    import sys

    script = tmp_path / "engine.py"
    # The script installs Python's SIGINT handler itself: a test run started in the background by
    # a non-interactive shell inherits SIGINT ignored, which a user's foreground engine does not.
    script.write_text(f"""
import signal
import time
signal.signal(signal.SIGINT, signal.default_int_handler)
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
if __name__ == "__main__":
    engine = LLMEngine(EngineArgs(model={llama_one_kv_head!r}, dtype="float32", max_model_len=128, tensor_parallel_size=2,
                                  cpu_threads_per_rank=1, kv_cache_memory_bytes=4 << 20))
    print(" ".join(str(p.pid) for p in engine.executor.processes), flush=True)
    time.sleep(300)
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_gone(p) for p in pids), "a worker outlived its engine"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_more_ranks_than_cpus_run_with_one_thread_each_and_a_warning(caplog):
    # vLLM runs tensor_parallel_size=4 on a 2-CPU machine (its skip_loading_weights example does):
    # so do we, one thread per rank, and say that the ranks share the cores.
    with caplog.at_level(logging.WARNING, logger="pagedllm.executor.multiproc"):
        assert threads_per_rank(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2), cpu_count=2) == 1
    assert "4 ranks (tensor_parallel_size x pipeline_parallel_size) on 2 CPU(s): one thread each, 2 ranks share " \
           "each core" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedllm.executor.multiproc"):
        assert threads_per_rank(ParallelConfig(tensor_parallel_size=3), cpu_count=2) == 1
        assert threads_per_rank(ParallelConfig(tensor_parallel_size=2), cpu_count=2) == 1
        assert threads_per_rank(ParallelConfig(tensor_parallel_size=2), cpu_count=16) == 8
    assert caplog.text.count("share each core") == 1   # 3 ranks on 2 CPUs only


def test_bad_sizes_are_refused_before_any_weight_loads(make_tiny_checkpoint):
    path = make_tiny_checkpoint("llama")   # 4 heads, 2 KV heads, intermediate 128, 3 layers
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the model's 4 attention heads"):
        LLM(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 exceeds the model's 3 layers"):
        LLM(path, pipeline_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1, got 0"):
        LLM(path, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an int >= 1, got -1"):
        LLM(path, pipeline_parallel_size=-1)
    with pytest.raises(ValueError, match="pp_layer_partition"):
        LLM(path, pipeline_parallel_size=2, pp_layer_partition="1,1")
    with pytest.raises(ValueError, match="distributed_executor_backend='uni' runs one worker"):
        LLM(path, tensor_parallel_size=2, distributed_executor_backend="uni")
    assert threads_per_rank(ParallelConfig(tensor_parallel_size=2), cpu_count=2) == 1
    assert threads_per_rank(ParallelConfig(tensor_parallel_size=2, cpu_threads_per_rank=3), cpu_count=2) == 3


def test_stage_layers_and_executor_selection():
    cfg = ParallelConfig(pipeline_parallel_size=4)
    assert [cfg.stage_layers(18, r) for r in range(4)] == [(0, 5), (5, 10), (10, 14), (14, 18)]
    cfg = ParallelConfig(pipeline_parallel_size=2, pp_layer_partition=(10, 8))
    assert [cfg.stage_layers(18, r) for r in range(2)] == [(0, 10), (10, 18)]
    assert Executor.get_class(ParallelConfig(tensor_parallel_size=2)) is MultiprocExecutor
    assert Executor.get_class(ParallelConfig(distributed_executor_backend="mp")) is MultiprocExecutor


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_default_model_split_two_ways_equals_transformers(default_model_reference, tp, pp, capsys):
    """Gemma 3 270M (4 query heads, 1 KV head replicated at TP=2; 18 layers split 9 + 9 at PP=2),
    float32, one multi-rank engine (run alone: two ranks hold ~2.5 GB more than one process):
    - transformers' recorded greedy tokens, exactly, for the 5 prompts x 32 tokens;
    - the 16-prompt report (16 tokens each): count the prompts equal to transformers; where a
      reduction-order near-tie flips a token, at the first difference each side's token is in
      the other's top 5 (vLLM's rule; transformers' top 5 recorded)."""
    refs = default_model_reference["greedy_float32"]
    refs16 = default_model_reference["greedy_float32_16"]
    llm = LLM(None, dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20, seed=0,
              tensor_parallel_size=tp, pipeline_parallel_size=pp)
    processes = list(llm.llm_engine.executor.processes)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=len(refs[0]["token_ids"]), ignore_eos=True)
        params16 = SamplingParams(temperature=0.0, max_tokens=len(refs16[0]["token_ids"]), ignore_eos=True,
                                  logprobs=5)
        outs = llm.generate([r["prompt"] for r in refs] + [r["prompt"] for r in refs16],
                            [params] * len(refs) + [params16] * len(refs16), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs[:len(refs)]] == [r["token_ids"] for r in refs]
        num_equal, flips = 0, []
        for ref, out in zip(refs16, outs[len(refs):]):
            ours = out.outputs[0].token_ids
            assert out.prompt_token_ids == ref["prompt_token_ids"] and len(ours) == len(ref["token_ids"])
            if ours == ref["token_ids"]:
                num_equal += 1
                continue
            step = next(i for i, (a, b) in enumerate(zip(ours, ref["token_ids"])) if a != b)
            lps = out.outputs[0].logprobs[step]
            our_top5 = sorted(lps, key=lambda t: lps[t].logprob, reverse=True)[:5]
            flips.append((ref["prompt"], step, ours[step], ref["token_ids"][step]))
            assert ours[step] in ref["top5"][step] and ref["token_ids"][step] in our_top5, flips[-1]
        with capsys.disabled():
            print(f"\nTP={tp} PP={pp}: {num_equal}/{len(refs16)} prompts equal to transformers; "
                  f"first differences (prompt, step, ours, transformers'): {flips}")
    finally:
        llm.llm_engine.shutdown()
    assert not any(p.is_alive() for p in processes)


@pytest.mark.timeout(120)
def test_async_engine_fails_requests_when_a_worker_dies(llama_one_kv_head):
    """Through ``AsyncLLM`` (the server's engine): the request running when rank 1 dies gets an
    ``EngineStepError`` naming the rank (HTTP 500); the engine is then dead (``dead_reason`` names
    the rank, the server exits on it): a later request gets ``EngineDeadError`` (503), no hang."""
    import asyncio

    from pagedllm.engine.async_engine import AsyncLLM, EngineDeadError, EngineStepError
    from pagedllm.entrypoints.openai.errors import error_from_exception

    llm = AsyncLLM.from_engine_args(EngineArgs(model=llama_one_kv_head, dtype="float32", max_model_len=128, block_size=8,
                                               kv_cache_memory_bytes=4 << 20, tensor_parallel_size=2,
                                               cpu_threads_per_rank=1))
    processes = list(llm.engine.executor.processes)

    async def consume(rid: str, kill: bool):
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        async for _ in llm.generate(PROMPTS[0], params, rid):
            if kill:
                os.kill(processes[1].pid, signal.SIGKILL)
                kill = False

    try:
        assert llm.dead_reason is None
        with pytest.raises(EngineStepError, match="rank 1") as info:
            asyncio.run(asyncio.wait_for(consume("a", True), timeout=60))
        assert error_from_exception(info.value).status_code == 500
        assert "rank 1" in llm.dead_reason
        with pytest.raises(EngineDeadError, match="rank 1") as info:
            asyncio.run(asyncio.wait_for(consume("b", False), timeout=60))
        assert error_from_exception(info.value).status_code == 503
    finally:
        llm.shutdown()
    for p in processes:
        p.join(timeout=10)
    assert not any(p.is_alive() for p in processes)
