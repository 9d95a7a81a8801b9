"""The Ray executor: a local Ray cluster started inside the test (``ray.init(num_cpus=2)`` in a
temporary folder), tensor_parallel_size=2 as two Ray actors in one placement group, gloo over the
actors' addresses; the tokens equal the single-process engine's (greedy and seeded sampling,
logprobs within 1e-4). Without Ray the backend names the ``[ray]`` extra."""

from __future__ import annotations

import shutil
import sys
import tempfile

import pytest

from pagedllm import SamplingParams
from pagedllm.config import KernelConfig, ParallelConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.executor import Executor

from parallel_utils import PROMPTS, assert_same_outputs, run_requests, tiny_engine

ray = pytest.importorskip("ray", reason="Ray is in the [ray] and [dev] extras; pip install -e '.[dev]'")

def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
            SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=10, ignore_eos=True)]


def _run(engine: LLMEngine) -> dict:
    return run_requests(engine, zip(PROMPTS, _params()))


@pytest.fixture(scope="module")
def local_ray_cluster():
    # One cluster for the module's tests (starting one costs ~10 s). A short folder: Ray's unix
    # sockets live under it (at most ~107 bytes of path).
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(num_cpus=2, _temp_dir=temp_dir, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.multiprocess   # a Ray cluster and two actors: ~30 s and 1.7 GiB summed RSS (docs/distributed.md)
@pytest.mark.timeout(300)
def test_tp2_through_ray_equals_single_process(make_tiny_checkpoint, local_ray_cluster):
    from pagedllm.executor.ray_executor import RayDistributedExecutor

    folder = make_tiny_checkpoint("llama")   # 4 query heads, 2 KV heads: one each per rank
    single = tiny_engine(folder)
    want = _run(single)
    single.shutdown()
    engine = tiny_engine(folder, tensor_parallel_size=2, distributed_executor_backend="ray", cpu_threads_per_rank=1)
    try:
        assert isinstance(engine.executor, RayDistributedExecutor) and len(engine.executor.actors) == 2
        table = ray.util.placement_group_table(engine.executor.placement_group)
        assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 2
        assert_same_outputs(_run(engine), want)
        engine.executor.check_health()
        # A killed actor is a clear error naming the rank, then every call is refused.
        ray.kill(engine.executor.actors[1])
        engine.add_request("late", [1, 2, 3], SamplingParams(max_tokens=4))
        with pytest.raises(RuntimeError, match="worker rank 1 .*died"):
            engine.step()
        with pytest.raises(RuntimeError, match="stopped after a failure"):
            engine.executor.check_health()
    finally:
        engine.shutdown()
    assert ray.util.placement_group_table()  # the group is removed, not leaked
    assert all(t["state"] == "REMOVED" for t in ray.util.placement_group_table().values())


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_grammar_steps_through_ray_as_the_old_order(make_tiny_checkpoint, local_ray_cluster):
    """Constrained steps through Ray actors: the forward call, the bitmask filled meanwhile, the
    ``sample_tokens`` call; the tokens equal the old order's (fill first) through Ray."""
    from pagedllm.sampling_params import StructuredOutputsParams

    folder = make_tiny_checkpoint("llama")
    grammar = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    params = [SamplingParams(temperature=0.9, seed=5, max_tokens=12, structured_outputs=grammar),
              SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=grammar),
              SamplingParams(temperature=0.9, seed=11, max_tokens=10, ignore_eos=True)]
    outputs = []
    for overlap in (False, True):
        engine = tiny_engine(folder, tensor_parallel_size=2, distributed_executor_backend="ray", cpu_threads_per_rank=1,
                             structured_outputs_config={"overlap_bitmask_fill": overlap})
        try:
            outputs.append(run_requests(engine, zip(PROMPTS, params)))
        finally:
            engine.shutdown()
    assert outputs[1] == outputs[0]


def test_ray_backend_selection_and_strategy():
    from pagedllm.executor.ray_executor import RayDistributedExecutor

    assert Executor.get_class(ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray")) \
        is RayDistributedExecutor
    assert ParallelConfig(ray_placement_strategy="SPREAD").ray_placement_strategy == "SPREAD"
    with pytest.raises(ValueError, match="ray_placement_strategy must be one of"):
        ParallelConfig(ray_placement_strategy="STRICT_SPREAD_OUT")


def test_without_ray_the_error_names_the_extra(monkeypatch):
    from pagedllm.executor.ray_executor import RayDistributedExecutor

    monkeypatch.setitem(sys.modules, "ray", None)   # import ray -> ImportError
    with pytest.raises(ImportError, match=r"pagedllm\[ray\]"):
        RayDistributedExecutor(None, None, None, ParallelConfig(tensor_parallel_size=2), KernelConfig())
