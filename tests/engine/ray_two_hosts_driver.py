"""The engine process of ``test_ray_two_hosts.py``, run inside the head's network namespace:
tensor_parallel_size=2 through the Ray executor with ``ray_placement_strategy="SPREAD"`` on the
cluster named by ``RAY_ADDRESS``. Prints one JSON line: the tokens and logprobs of each request,
and each rank's Ray node (id and IP address, as the actor sees them).

    python tests/engine/ray_two_hosts_driver.py MODEL_FOLDER
"""

from __future__ import annotations

import json
import sys

from pagedllm import SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine

# Shared with the test, which runs the same requests at tensor_parallel_size=1 in its own process.
PROMPTS = [[5, 9, 13, 200, 17, 3, 3, 40] * 3, [7, 8, 9], list(range(30, 70))]
MAX_TOKENS = 10


def sampling_params() -> SamplingParams:
    """Greedy, ``MAX_TOKENS`` tokens, the top-3 logprobs of each."""
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)


def engine_args(folder: str, **kwargs) -> EngineArgs:
    """float32, so that TP=2's split matmuls and all-reduce match TP=1 to rounding."""
    return EngineArgs(model=folder, dtype="float32", max_model_len=128, seed=0, block_size=8,
                      kv_cache_memory_bytes=4 << 20, **kwargs)


def run(engine: LLMEngine) -> dict[str, list]:
    """request id -> [token ids, [{token id: logprob}] per token] (token ids as strings, for JSON)."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, sampling_params())
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                out[o.request_id] = [list(c.token_ids),
                                     [{str(t): lp.logprob for t, lp in d.items()} for d in c.logprobs]]
    return out


def main(folder: str) -> None:
    import ray

    engine = LLMEngine(engine_args(folder, tensor_parallel_size=2, distributed_executor_backend="ray",
                                   ray_placement_strategy="SPREAD", cpu_threads_per_rank=1))
    try:
        executor = engine.executor
        # Where each rank's actor runs, as Ray places it and as the actor itself reports.
        table = ray.util.placement_group_table(executor.placement_group)
        ips = [ip for ip, _ in ray.get([a.get_node_ip_and_free_port.remote() for a in executor.actors],
                                       timeout=60)]
        node_ids = [a.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                    for a in executor.actors]
        result = {"strategy": table["strategy"], "rank_node_ips": ips,
                  "rank_node_ids": ray.get(node_ids, timeout=60),
                  "cluster_nodes": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]),
                  "outputs": run(engine)}
    finally:
        engine.shutdown()
        ray.shutdown()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
