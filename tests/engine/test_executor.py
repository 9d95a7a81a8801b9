"""The engine-worker boundary: every step's ``SchedulerOutput`` and ``ModelRunnerOutput`` survive a
pickle round trip with the outputs unchanged; executor selection; callables stay in-process."""

from __future__ import annotations

import pickle

import pytest

from pagedllm import SamplingParams
from pagedllm.config import ParallelConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.executor import Executor, UniProcExecutor


class PicklingExecutor(UniProcExecutor):
    """``UniProcExecutor`` whose messages go through pickle both ways, as they would to a worker
    process; counts the messages and the bytes sent."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_messages = 0
        self.kinds: set[str] = set()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        sent = pickle.loads(pickle.dumps(scheduler_output))
        self.num_messages += 1
        if sent.scheduled_new_reqs:
            self.kinds.add("new")
        if sent.scheduled_cached_reqs:
            self.kinds.add("cached")
        if any(c.resumed_from_preemption for c in sent.scheduled_cached_reqs):
            self.kinds.add("resumed")
        if any(n.forked_from for n in sent.scheduled_new_reqs):
            self.kinds.add("fork")
        if sent.blocks_to_copy:
            self.kinds.add("cow")
        if any(c.replaced_block_ids for c in sent.scheduled_cached_reqs):
            self.kinds.add("replaced")
        return pickle.loads(pickle.dumps(super().execute_model(sent)))


class OutOfProcessExecutor(PicklingExecutor):
    """Declares its workers out of process (as a multi-process executor will)."""

    uses_in_process_worker = False


def _run(engine: LLMEngine, prompts, params) -> dict:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    finished = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = [
                    (o.index, o.token_ids, o.text, o.finish_reason, o.stop_reason, o.cumulative_logprob,
                     None if o.logprobs is None else [{t: lp.logprob for t, lp in d.items()} for d in o.logprobs])
                    for o in out.outputs]
    assert not engine.has_unfinished_requests()
    return finished


def _engine(folder, executor_class=None, **kwargs) -> LLMEngine:
    args = EngineArgs(model=folder, dtype="float32", max_model_len=128, seed=0, block_size=8, **kwargs)
    return LLMEngine(args, executor_class=executor_class)


PROMPTS = [[5, 9, 13, 200, 17, 3, 3, 40] * 4, [7, 8, 9], list(range(30, 67)), [11, 12, 13, 14, 15, 16]]


@pytest.mark.parametrize("engine_kwargs", [
    dict(kv_cache_memory_bytes=16 << 20),                                   # plain
    dict(kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=16),         # chunked prefill
    # A tiny pool: preemption (of one table: the hybrid KV cache's half-size pages need more of them).
    dict(num_gpu_blocks_override=16, max_num_seqs=5, disable_hybrid_kv_cache_manager=True),
], ids=["plain", "chunked", "preemption"])
def test_pickled_messages_give_identical_outputs(make_tiny_checkpoint, engine_kwargs):
    folder = make_tiny_checkpoint("gemma3")
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, seed=7, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, seed=3, n=2, max_tokens=30, ignore_eos=True,
                             repetition_penalty=1.2, presence_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
    reference = _engine(folder, **engine_kwargs)
    want = _run(reference, PROMPTS, params)
    # A stop string taken from the reference's greedy text cuts the same request short.
    text = want["r3"][0][2]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    params[3] = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    want = _run(reference, PROMPTS, params)
    assert want["r3"][0][3] == "stop" and want["r3"][0][4] == stop

    pickling = _engine(folder, PicklingExecutor, **engine_kwargs)
    got = _run(pickling, PROMPTS, params)
    assert got == want
    assert pickling.executor.num_messages > 0 and {"new", "cached"} <= pickling.executor.kinds
    # r2 (n=2, a 37-token prompt: a partial last block) forks and copies its shared last block.
    assert {"fork", "cow", "replaced"} <= pickling.executor.kinds
    if "num_gpu_blocks_override" in engine_kwargs:
        assert pickling.scheduler.num_preemptions_total > 0
        assert "resumed" in pickling.executor.kinds
    # Every request left the worker with its blocks: nothing is held after the run.
    pickling.step()
    assert pickling.executor.driver_worker.model_runner.requests.requests == {}


def test_logits_processors_stay_in_process(make_tiny_checkpoint):
    folder = make_tiny_checkpoint("llama")
    engine = _engine(folder, PicklingExecutor, kv_cache_memory_bytes=16 << 20)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = _run(engine, [[4, 4, 5]], [greedy])["r0"][0][1]
    banned = plain[0]   # the greedy choice at the first step

    def ban(output_ids, logits):
        logits[banned] = float("-inf")
        return logits

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logits_processors=[ban])
    out = _run(engine, [[4, 4, 5]], [params])["r0"][0][1]
    assert banned not in out and out != plain   # the processor ran where the worker sampled

    remote = _engine(folder, OutOfProcessExecutor, kv_cache_memory_bytes=16 << 20)
    with pytest.raises(ValueError, match="logits_processors"):
        remote.add_request("x", [1, 2, 3], params)
    assert not remote.has_unfinished_requests()


def test_executor_selection():
    assert Executor.get_class(ParallelConfig()) is UniProcExecutor
    assert Executor.get_class(ParallelConfig(distributed_executor_backend="uni")) is UniProcExecutor
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        ParallelConfig(distributed_executor_backend="dask")
    with pytest.raises(ValueError, match="data_parallel_size must be an int >= 1"):
        ParallelConfig(data_parallel_size=0)


_CLOSED_STDOUT_SCRIPT = """
import os, sys
from pagedllm import LLM, SamplingParams

if __name__ == "__main__":
    os.close(1)   # a daemon's closed stdout: the workers must still start
    llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=2, max_model_len=128,
              kv_cache_memory_bytes=4 << 20, cpu_threads_per_rank=1)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    sys.stderr.write("tokens %s\\n" % list(out[0].outputs[0].token_ids))
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_rank_workers_start_with_stdout_closed(make_tiny_checkpoint, tmp_path):
    """Workers come from a fork server and take the engine's current stdout / stderr (that their
    log lines follow a redirected stderr is test_parallel's capfd check): with stdout closed they
    start all the same and give one process's greedy tokens."""
    import subprocess
    import sys

    folder = make_tiny_checkpoint("llama")
    script = tmp_path / "closed_stdout.py"
    script.write_text(_CLOSED_STDOUT_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), folder], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from parallel_utils import run_requests, tiny_engine

    single = tiny_engine(folder)
    try:
        want = list(run_requests(single, [([5, 6, 7], SamplingParams(temperature=0, max_tokens=4,
                                                                     ignore_eos=True))])["r0"][0])
    finally:
        single.shutdown()
    assert f"tokens {want}" in proc.stderr, proc.stderr[-3000:]
