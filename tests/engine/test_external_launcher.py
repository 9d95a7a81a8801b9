"""``distributed_executor_backend="external_launcher"`` (vLLM's torchrun mode): processes started by
torchrun, each one rank running its own engine on the same inputs. On tiny random float32
checkpoints every rank's greedy tokens equal the single-process engine's (TP 2, PP 2); with DP 2
(also DP 2 x TP 2 and DP 2 x PP 2 over four processes) each rank generates its own share and the
union equals the single engine's; sampled tokens agree on both TP ranks; a missing torchrun variable
or a wrong WORLD_SIZE is a ValueError naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import LauncherEnv, ParallelConfig
from pagedllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from pagedllm.envs import TORCHRUN_ENV_VARS

DRIVER = os.path.join(os.path.dirname(__file__), "torchrun_driver.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN_ENV = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _torchrun(tmp_path, folder: str, tp: int, pp: int, dp: int, nproc: int = 2,
              extra: tuple[str, ...] = (), timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    for name in TORCHRUN_ENV_VARS:
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", DRIVER, folder, str(tmp_path), str(tp), str(pp), str(dp),
                           "0.0", *extra], env=env,   # 0.0: greedy (the driver adds a sampled pass itself)
                           capture_output=True, text=True, timeout=timeout)


def _rank_results(tmp_path, nproc: int = 2) -> list[dict]:
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


def _single_process_tokens(folder: str) -> dict[str, list[int]]:
    """The driver's prompts and settings in one process (greedy)."""
    sys.path.insert(0, os.path.dirname(DRIVER))
    from torchrun_driver import PROMPTS

    llm = LLM(model=folder, dtype="float32", max_model_len=128, block_size=8, kv_cache_memory_bytes=4 << 20, seed=1)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
        return {str(i): list(o.outputs[0].token_ids) for i, o in enumerate(outputs)}
    finally:
        llm.llm_engine.shutdown()


def _single_process_constrained(folder: str) -> list[list[int]]:
    """The driver's JSON-constrained requests in one process (greedy), the bitmask filled before
    the forward (the old order)."""
    sys.path.insert(0, os.path.dirname(DRIVER))
    from torchrun_driver import PROMPTS, constrained_params

    llm = LLM(model=folder, dtype="float32", max_model_len=128, block_size=8, kv_cache_memory_bytes=4 << 20, seed=1,
              structured_outputs_config={"overlap_bitmask_fill": False})
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], constrained_params(0.0, 10),
                               use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def llama(make_tiny_checkpoint) -> str:
    return make_tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def reference(llama) -> dict[str, list[int]]:
    return _single_process_tokens(llama)


# -- configuration: no processes -------------------------------------------------------------------


def test_launcher_env_names_missing_variables():
    with pytest.raises(ValueError, match="missing: LOCAL_WORLD_SIZE, MASTER_PORT"):
        LauncherEnv.from_environ({k: v for k, v in TORCHRUN_ENV.items()
                                  if k not in ("LOCAL_WORLD_SIZE", "MASTER_PORT")})
    with pytest.raises(ValueError, match=r"\$RANK must be an integer, got 'x'"):
        LauncherEnv.from_environ(dict(TORCHRUN_ENV, RANK="x"))
    env = LauncherEnv.from_environ(TORCHRUN_ENV)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.master_port) == (1, 1, 4, 4, 29500)


def test_parallel_config_world_size_and_data_parallel_rank():
    launcher = LauncherEnv(rank=3, local_rank=3, world_size=4, local_world_size=4, master_addr="h", master_port=1)
    config = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2,
                            distributed_executor_backend="external_launcher", launcher=launcher)
    assert (config.world_size, config.world_size_across_dp, config.data_parallel_rank) == (2, 4, 1)
    assert config.ranks_on_this_machine == 4
    with pytest.raises(ValueError, match=r"WORLD_SIZE=4, but data_parallel_size x pipeline_parallel_size x "
                                         r"tensor_parallel_size = 2 x 2 x 2 = 8"):
        ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2,
                       distributed_executor_backend="external_launcher", launcher=launcher)
    with pytest.raises(ValueError, match="needs torchrun's environment"):
        ParallelConfig(distributed_executor_backend="external_launcher")


def test_engine_args_read_torchrun_env_and_threads(monkeypatch):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("PAGEDLLM_CPU_THREADS_PER_RANK", raising=False)
    args = EngineArgs(tensor_parallel_size=2, pipeline_parallel_size=2,
                      distributed_executor_backend="external_launcher")
    parallel = args.create_engine_config().parallel_config
    assert parallel.launcher.rank == 1 and parallel.data_parallel_rank == 0
    # 4 ranks on this machine share its cores, never less than one thread each.
    assert parallel.cpu_threads_per_rank == max(1, (os.cpu_count() or 1) // 4)


def test_missing_torchrun_env_is_refused(monkeypatch, llama):
    for name in TORCHRUN_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="missing: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, "
                                         "MASTER_PORT"):
        LLM(model=llama, distributed_executor_backend="external_launcher", tensor_parallel_size=2)


def test_async_engine_refuses_external_launcher(monkeypatch):
    from pagedllm.engine.async_engine import AsyncLLM

    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="external_launcher' is for offline inference"):
        AsyncLLM.from_engine_args(AsyncEngineArgs(distributed_executor_backend="external_launcher"))


def test_grammar_wait_blocks_until_compiled():
    """With external_launcher the engine admits a structured-output request only once its grammar
    compiled, so every rank's scheduler admits it at the same step."""
    import threading
    from concurrent.futures import Future

    from pagedllm.structured_output.request import StructuredOutputRequest

    class Backend:
        def new_matcher(self, grammar):
            return ("matcher", grammar)

    compiled, backend = Future(), Future()
    backend.set_result(Backend())
    request = StructuredOutputRequest(compiled, backend)
    assert not request.is_ready()
    threading.Timer(0.2, compiled.set_result, ["grammar"]).start()
    request.wait()
    assert request.is_ready() and request.matcher == ("matcher", "grammar")


# -- torchrun: two processes ----------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_every_rank_equals_single_process(tmp_path, llama, reference, tp, pp):
    run = _torchrun(tmp_path, llama, tp, pp, 1)
    assert run.returncode == 0, run.stderr[-4000:]
    results = _rank_results(tmp_path)
    constrained = _single_process_constrained(llama)
    for rank, result in enumerate(results):
        assert (result["dp_rank"], result["dp_size"], result["world_rank"]) == (0, 1, rank)
        assert result["tokens"] == reference
        assert result["constrained"] == constrained   # the bitmask beside the forward, on every rank
        assert result["forced"] == [42, 42, 42]   # a logits processor, applied by the engine's driver
    assert results[0]["num_blocks"] == results[1]["num_blocks"]
    assert results[0]["num_params"] > 0 and results[1]["num_params"] > 0
    # The same requests sampled at temperature 0.8 in the same run: both ranks agree, not greedy.
    first, second = (r["sampled"] for r in results)
    assert first["tokens"] == second["tokens"] and len(first["tokens"]) == 4
    assert first["constrained"] == second["constrained"] and len(first["constrained"]) == 2
    assert first["forced"] == second["forced"] == [42, 42, 42]
    assert all(len(t) == 10 for t in first["tokens"].values())
    assert first["tokens"] != reference


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_data_parallel_shares_union_equals_single_process(tmp_path, llama, reference):
    run = _torchrun(tmp_path, llama, 1, 1, 2)
    assert run.returncode == 0, run.stderr[-4000:]
    results = _rank_results(tmp_path)
    assert [(r["dp_rank"], r["dp_size"]) for r in results] == [(0, 2), (1, 2)]
    assert sorted(results[0]["tokens"]) == ["0", "2"] and sorted(results[1]["tokens"]) == ["1", "3"]
    assert {**results[0]["tokens"], **results[1]["tokens"]} == reference


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["dp2-tp2", "dp2-pp2"])
def test_data_parallel_engines_of_two_ranks(tmp_path, llama, reference, tp, pp):
    """Four processes, DP 2 x (TP 2 or PP 2): ranks 0-1 are engine 0, ranks 2-3 engine 1 (each with
    its own groups and driver); an engine's two ranks agree, and the two shares make the reference."""
    run = _torchrun(tmp_path, llama, tp, pp, 2, nproc=4)
    assert run.returncode == 0, run.stderr[-4000:]
    results = _rank_results(tmp_path, nproc=4)
    assert [(r["dp_rank"], r["world_rank"]) for r in results] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert results[0]["tokens"] == results[1]["tokens"] and results[2]["tokens"] == results[3]["tokens"]
    assert sorted(results[0]["tokens"]) == ["0", "2"] and sorted(results[2]["tokens"]) == ["1", "3"]
    assert {**results[0]["tokens"], **results[2]["tokens"]} == reference
    assert all(r["forced"] == [42, 42, 42] for r in results)


def test_wrong_world_size_is_refused(monkeypatch, llama):
    """torchrun started 2 processes for a world of 4: LLM refuses before joining any group (the
    message a torchrun process prints; in-process, with torchrun's environment set)."""
    for name, value in {**TORCHRUN_ENV, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0",
                        "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"torchrun's WORLD_SIZE=2, but data_parallel_size x pipeline_parallel_size "
                                         r"x tensor_parallel_size = 1 x 2 x 2 = 4"):
        LLM(model=llama, distributed_executor_backend="external_launcher", tensor_parallel_size=2,
            pipeline_parallel_size=2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_model_tp2_over_torchrun_equals_transformers(tmp_path, default_model_reference):
    """Gemma 3 270M, float32, TP 2 over two torchrun processes: both ranks give transformers'
    recorded greedy tokens exactly (5 prompts x 32 tokens), as the mp executor does."""
    refs = default_model_reference["greedy_float32"]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([r["prompt_token_ids"] for r in refs]))
    run = _torchrun(tmp_path, "default", 2, 1, 1, extra=(str(prompts), str(len(refs[0]["token_ids"]))), timeout=800)
    assert run.returncode == 0, run.stderr[-4000:]
    for result in _rank_results(tmp_path):
        assert [result["tokens"][str(i)] for i in range(len(refs))] == [r["token_ids"] for r in refs]
