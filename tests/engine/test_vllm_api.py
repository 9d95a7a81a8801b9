"""vLLM's Python surface (issue 28, item 3): a vLLM script runs with ``vllm`` -> ``pagedllm`` in
its imports. Tiny random Llama checkpoints; every check asserts values, not only that a call works."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

import pagedllm
from pagedllm import LLM, SamplingParams

ENGINE_KW = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(make_tiny_checkpoint):
    return LLM(make_tiny_checkpoint("llama"), **ENGINE_KW, seed=0)


# -- 1. names and import paths --------------------------------------------------------------

def test_vllm_names_import_from_the_package_and_vllms_module_paths():
    from pagedllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.engine.async_llm_engine import AsyncLLMEngine
    from pagedllm.engine.beam_search import BeamSearchParams as BeamFromEngine
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.llm import LLM as LLMFromEntrypoints
    from pagedllm.sampling_params import BeamSearchParams
    from pagedllm.utils import FlexibleArgumentParser
    from pagedllm.utils.argparse_utils import FlexibleArgumentParser as FAP
    from pagedllm.config import VllmConfig
    from pagedllm.v1.engine.async_llm import AsyncLLM as V1AsyncLLM
    from pagedllm.v1.sample.logits_processor import VllmConfig as V1VllmConfig

    assert pagedllm.EngineArgs is EngineArgs and pagedllm.AsyncEngineArgs is AsyncEngineArgs
    assert issubclass(AsyncEngineArgs, EngineArgs)
    assert pagedllm.LLMEngine is LLMEngine and pagedllm.LLM is LLMFromEntrypoints
    assert pagedllm.AsyncLLMEngine is AsyncLLM is AsyncLLMEngine is V1AsyncLLM is pagedllm.AsyncLLM
    assert pagedllm.BeamSearchParams is BeamSearchParams is BeamFromEngine
    assert FlexibleArgumentParser is FAP
    assert VllmConfig is V1VllmConfig   # vLLM's logits-processor example imports it from vllm.config
    from pagedllm.config import ProfilerConfig
    from pagedllm.logger import init_logger
    from pagedllm.profiler import ProfilerConfig as P2
    assert ProfilerConfig is P2 and init_logger("pagedllm.x").name == "pagedllm.x"
    for name in pagedllm.__all__:
        assert getattr(pagedllm, name) is not None
    with pytest.raises(AttributeError, match="no_such_name"):
        pagedllm.no_such_name


def test_import_pagedllm_stays_torch_free():
    code = ("import sys, pagedllm; from pagedllm import SamplingParams, BeamSearchParams; "
            "from pagedllm.utils import FlexibleArgumentParser; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- 2. add_cli_args / from_cli_args / FlexibleArgumentParser -------------------------------

def test_flexible_argument_parser_reads_underscores_as_dashes():
    from pagedllm.utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--enable-thing", action="store_true")
    parser.add_argument("rest", nargs="*")
    ns = parser.parse_args(["--max_model_len=64", "--enable_thing", "a_b", "--", "--c_d"])
    assert ns.max_model_len == 64 and ns.enable_thing is True
    assert ns.rest == ["a_b", "--c_d"]          # values and arguments after "--" untouched
    assert parser.parse_args(["--max_model_len", "7"]).max_model_len == 7


def test_add_cli_args_has_the_serve_flags_and_returns_the_parser():
    from pagedllm.engine.arg_utils import AsyncEngineArgs, EngineArgs, add_engine_cli_args
    from pagedllm.utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    assert EngineArgs.add_cli_args(parser) is parser
    serve_like = FlexibleArgumentParser()
    add_engine_cli_args(serve_like)
    flags = lambda p: {s for a in p._actions for s in a.option_strings} - {"-h", "--help"}  # noqa: E731
    assert flags(parser) == flags(serve_like)          # one definition of every flag
    args = parser.parse_args(["--model", "m", "--max_model_len", "64", "-tp", "1", "--no-enable-prefix-caching",
                              "--max-num-seqs", "3", "--seed", "7"])
    engine_args = EngineArgs.from_cli_args(args)
    assert type(engine_args) is EngineArgs
    assert (engine_args.model, engine_args.max_model_len, engine_args.max_num_seqs, engine_args.seed,
            engine_args.enable_prefix_caching) == ("m", 64, 3, 7, False)
    # Defaults parsed from no flags equal the dataclass's defaults (so LLM(**vars(args)) = LLM()).
    defaults = vars(EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args([]))
    for name, value in defaults.items():
        assert getattr(EngineArgs(), name) == value, name
    async_parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    async_args = AsyncEngineArgs.from_cli_args(async_parser.parse_args(["--enable_log_requests", "--seed", "3"]))
    assert type(async_args) is AsyncEngineArgs and async_args.enable_log_requests and async_args.seed == 3


def test_vllm_example_script_forms_build_the_same_engine(make_tiny_checkpoint, llm):
    from pagedllm import EngineArgs, LLMEngine
    from pagedllm.utils import FlexibleArgumentParser

    path = make_tiny_checkpoint("llama")
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--max-tokens", type=int, default=8)      # a script's own flag
    args = parser.parse_args(["--model", path, "--dtype", "float32", "--max_model_len", "128",
                              "--kv-cache-memory-bytes", "16MiB", "--max-tokens", "5"])
    max_tokens = vars(args).pop("max_tokens")
    expected = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                    ignore_eos=True), use_tqdm=False)
    want = expected[0].outputs[0].token_ids
    assert len(want) == 5

    from_vars = LLM(**vars(args))
    assert from_vars.llm_engine.max_model_len == 128
    got = from_vars.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                             use_tqdm=False)
    assert got[0].outputs[0].token_ids == want
    from_vars.llm_engine.shutdown()

    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.kv_cache_memory_bytes == 16 << 20
    engine = LLMEngine.from_engine_args(engine_args)
    engine.add_request("r", "The quick brown fox", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final.outputs[0].token_ids == want
    engine.shutdown()

    from_dict = LLM(**dataclasses.asdict(engine_args))
    got = from_dict.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                             use_tqdm=False)
    assert got[0].outputs[0].token_ids == want
    from_dict.llm_engine.shutdown()


# -- 3. get_default_sampling_params: the model's generation_config.json ---------------------

def _checkpoint_with_generation_config(make_tiny_checkpoint, tmp_path, generation_config: dict | None) -> str:
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(make_tiny_checkpoint("llama"), folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return str(folder)


def test_default_sampling_params_come_from_generation_config(make_tiny_checkpoint, tmp_path):
    from pagedllm.loaders.generation_config import diff_sampling_params

    folder = _checkpoint_with_generation_config(make_tiny_checkpoint, tmp_path, {
        "bos_token_id": 2, "eos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
        "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 6, "min_length": 3})
    assert diff_sampling_params(folder) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                            "repetition_penalty": 1.1, "max_tokens": 6}
    assert diff_sampling_params(folder, "vllm") == {}
    assert diff_sampling_params(folder, "auto", {"temperature": 0.0, "top_k": None}) == {
        "temperature": 0.0, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 6}
    with pytest.raises(ValueError, match="generation_config"):
        diff_sampling_params(folder, "not-a-folder")

    llm = LLM(folder, **ENGINE_KW)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty,
            params.max_tokens) == (0.6, 0.9, 20, 0.05, 1.1, 6)
    assert params is not llm.get_default_sampling_params()          # a fresh object each call
    outs = llm.generate(["The quick brown fox", "blocks"], use_tqdm=False)   # no params: the defaults
    assert all(o.outputs[0].finish_reason in ("length", "stop") for o in outs)
    assert all(len(o.outputs[0].token_ids) <= 6 for o in outs)
    assert any(len(o.outputs[0].token_ids) == 6 for o in outs)
    llm.llm_engine.shutdown()

    ignored = LLM(folder, **ENGINE_KW, generation_config="vllm")
    assert ignored.get_default_sampling_params() == SamplingParams()
    ignored.llm_engine.shutdown()
    with pytest.raises(ValueError, match="generation_config"):
        LLM(folder, **ENGINE_KW, generation_config="nowhere/at/all")


def test_default_sampling_params_without_generation_config(make_tiny_checkpoint, tmp_path, llm):
    # save_pretrained writes only token ids: no sampling key, so plain SamplingParams().
    assert llm.get_default_sampling_params() == SamplingParams()
    folder = _checkpoint_with_generation_config(make_tiny_checkpoint, tmp_path, None)
    bare = LLM(folder, **ENGINE_KW)
    assert bare.get_default_sampling_params() == SamplingParams()
    out = bare.generate("The quick brown fox", use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= SamplingParams().max_tokens
    bare.llm_engine.shutdown()


# -- 7. reset_prefix_cache(reset_running_requests=...) --------------------------------------

def test_reset_prefix_cache_with_running_requests(make_tiny_checkpoint):
    from pagedllm import EngineArgs, LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(make_tiny_checkpoint("llama"), block_size=4, **ENGINE_KW))
    tok = engine.tokenizer
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. A paged KV cache")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(request_id, reset_after=None):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        steps, final = 0, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final = out
            steps += 1
            if steps == reset_after:
                assert engine.reset_prefix_cache() is False            # a running request holds blocks
                assert engine.kv_cache_manager.block_pool.cached_block_hash_to_block
                assert engine.reset_prefix_cache(reset_running_requests=True) is True
                assert not engine.kv_cache_manager.block_pool.cached_block_hash_to_block
                request = engine.scheduler.get_request(request_id)
                assert request.num_computed_tokens == 0 and request in engine.scheduler.waiting
                assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
        return final

    plain = run("plain")
    assert engine.reset_prefix_cache() is True          # idle engine: cleared, as before
    reset = run("reset", reset_after=4)
    assert reset.outputs[0].token_ids == plain.outputs[0].token_ids   # recomputed, same tokens
    assert reset.num_cached_tokens == 0
    assert engine.scheduler.num_preemptions_total == 1
    again = run("again")                                 # the reset request's blocks are cached again
    assert again.num_cached_tokens == (len(prompt) // 4) * 4 and again.outputs[0].token_ids == plain.outputs[0].token_ids
    assert engine.reset_prefix_cache(reset_running_requests=True) is True
    assert run("fresh").num_cached_tokens == 0
    engine.shutdown()


def test_llm_reset_prefix_cache_keyword(llm):
    llm.generate("The quick brown fox", GREEDY, use_tqdm=False)
    assert llm.reset_prefix_cache(reset_running_requests=False) is True
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    assert not llm.llm_engine.kv_cache_manager.block_pool.cached_block_hash_to_block


# -- 8. the engine seed seeds random / numpy / torch's global RNGs at engine start -----------

def test_engine_seed_seeds_the_global_rngs(make_tiny_checkpoint):
    import random

    import numpy as np
    import torch

    from pagedllm.utils.torch_utils import set_random_seed

    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    expected = draws()
    for _ in range(2):
        random.seed(123)           # disturb them
        np.random.seed(123)
        torch.manual_seed(123)
        llm = LLM(make_tiny_checkpoint("llama"), **ENGINE_KW, seed=5)
        assert draws() == expected
        llm.llm_engine.shutdown()
    set_random_seed(None)           # None: left alone
    with pytest.raises(ValueError, match="seed"):
        set_random_seed("5")
    with pytest.raises(ValueError, match="seed must be an int"):
        LLM(make_tiny_checkpoint("llama"), **ENGINE_KW, seed=1.5)


# -- 9. cleanup_dist_env_and_memory ---------------------------------------------------------

def test_cleanup_dist_env_and_memory_destroys_the_group_and_is_safe_without_one(tmp_path):
    import gc
    import weakref

    import torch.distributed as dist

    from pagedllm.distributed import cleanup_dist_env_and_memory
    from pagedllm.distributed.parallel_state import cleanup_dist_env_and_memory as from_parallel_state

    assert cleanup_dist_env_and_memory is from_parallel_state
    assert not dist.is_initialized()
    cleanup_dist_env_and_memory()                     # none: nothing to do, no error
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    assert dist.is_initialized()

    class Cycle:
        pass

    c = Cycle()
    c.self = c                                        # only the collector frees a cycle
    ref = weakref.ref(c)
    del c
    gc.disable()
    try:
        cleanup_dist_env_and_memory(shutdown_ray=True)
    finally:
        gc.enable()
    assert not dist.is_initialized()
    assert ref() is None
    cleanup_dist_env_and_memory()                     # twice: still fine


# -- 4. LLM.chat(..., tools=[...]) ----------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_chat_hands_tools_to_the_template(llm):
    import json

    from pagedllm.entrypoints.chat_utils import render_chat_prompt

    messages = [{"role": "user", "content": "Weather in Paris?"}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with_tools = llm.chat(messages, params, use_tqdm=False, chat_template="gemma-tools", tools=[WEATHER_TOOL])[0]
    without = llm.chat(messages, params, use_tqdm=False, chat_template="gemma-tools")[0]
    assert json.dumps(WEATHER_TOOL["function"]) in with_tools.prompt
    assert "You can call these functions" in with_tools.prompt and "get_weather" not in without.prompt
    # The same rendering and tokens as the server's (chat_utils), and the prompt the engine ran.
    from pagedllm.entrypoints.chat_utils import load_chat_template
    rendered = render_chat_prompt(llm.get_tokenizer(), messages, load_chat_template("gemma-tools"),
                                  tools=[WEATHER_TOOL])
    assert with_tools.prompt == rendered["prompt"] and with_tools.prompt_token_ids == rendered["prompt_token_ids"]
    assert len(with_tools.outputs[0].token_ids) == 4
    batch = llm.chat([messages, messages], params, use_tqdm=False, chat_template="gemma-tools", tools=[WEATHER_TOOL])
    assert [o.prompt for o in batch] == [with_tools.prompt] * 2
    with pytest.raises(ValueError, match="tools"):
        llm.chat(messages, params, use_tqdm=False, chat_template="gemma-tools", tools="get_weather")


# -- 5. AsyncLLM.generate with vLLM's keywords; AsyncLLM.from_engine_args(AsyncEngineArgs) ---

def test_async_llm_generate_with_vllms_names(make_tiny_checkpoint, llm, caplog):
    import asyncio
    import logging

    from pagedllm import AsyncEngineArgs, AsyncLLMEngine, TextPrompt, TokensPrompt
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.sampling_params import RequestOutputKind

    text = "The quick brown fox"
    ids = llm.get_tokenizer().encode(text)
    want = llm.generate(text, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=make_tiny_checkpoint("llama"), **ENGINE_KW,
                                                             enable_log_requests=True, disable_log_stats=True))
    assert isinstance(engine, AsyncLLM) and engine.is_running          # start_engine_loop=True
    assert engine.log_requests and engine._stats_log is None
    delta = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def collect(prompt, request_id, **kw):
        tokens, last = [], None
        async for out in engine.generate(prompt, sampling_params=delta, request_id=request_id, **kw):
            tokens += out.outputs[0].token_ids
            last = out
        return tokens, last

    async def main():
        return await asyncio.gather(collect(text, "as-str"), collect(TextPrompt(prompt=text), "as-text"),
                                    collect(TokensPrompt(prompt_token_ids=ids), "as-ids", lora_request=None,
                                            priority=0, trace_headers=None, data_parallel_rank=None))

    try:
        with caplog.at_level(logging.INFO, logger="pagedllm.engine.async_engine"):
            results = asyncio.run(main())
        for tokens, last in results:
            assert tokens == want and last.finished and last.prompt_token_ids == ids
        assert [last.request_id for _, last in results] == ["as-str", "as-text", "as-ids"]
        assert results[0][1].prompt == text and results[2][1].prompt is None
        assert "Added request as-text" in caplog.text

        async def positional():     # vLLM's positional order: prompt, sampling_params, request_id
            return [o async for o in engine.generate(text, GREEDY, "positional")]
        final = asyncio.run(positional())[-1]
        assert final.request_id == "positional" and final.outputs[0].token_ids == want

        async def unsupported(**kw):
            async for _ in engine.generate(text, GREEDY, "bad", **kw):
                pass
        for kw, name in (({"lora_request": object()}, "lora_request"), ({"priority": 1}, "priority")):
            with pytest.raises(ValueError, match=name):
                asyncio.run(unsupported(**kw))
    finally:
        engine.shutdown()


# -- 6. hf_overrides -------------------------------------------------------------------------

def test_hf_overrides_dict_and_callable_change_the_model_built(make_tiny_checkpoint, tmp_path, hf_greedy, llm):
    import json
    import shutil

    from pagedllm.loaders.hf_overrides import apply_hf_overrides

    path = make_tiny_checkpoint("llama")
    overrides = {"rope_parameters": {"rope_theta": 50.0}, "rms_norm_eps": 0.5}
    config = json.load(open(f"{path}/config.json"))
    merged = apply_hf_overrides(config, overrides)
    assert merged["rope_parameters"] == {"rope_theta": 50.0, "rope_type": "default"}   # nested: key by key
    assert merged["rms_norm_eps"] == 0.5 and config["rms_norm_eps"] == 1e-6           # input untouched
    # The reference: transformers on a copy whose config.json has the same changes.
    ref = tmp_path / "overridden"
    shutil.copytree(path, ref)
    (ref / "config.json").write_text(json.dumps(merged))
    ids = llm.get_tokenizer().encode("The quick brown fox")
    want = hf_greedy(str(ref), [ids], 8)[0]
    plain = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert want != plain                                                               # the overrides matter

    def shrink_eps(cfg):
        cfg.rms_norm_eps = 0.5
        cfg.rope_parameters["rope_theta"] = 50.0
        return cfg

    for hf_overrides in (overrides, shrink_eps):
        overridden = LLM(path, **ENGINE_KW, hf_overrides=hf_overrides)
        assert overridden.llm_engine.model_config.rms_norm_eps == 0.5
        got = overridden.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert got == want
        overridden.llm_engine.shutdown()
    with pytest.raises(ValueError, match="hf_overrides"):
        LLM(path, **ENGINE_KW, hf_overrides="rms_norm_eps=0.5")
    with pytest.raises(ValueError, match="hf_overrides must return"):
        LLM(path, **ENGINE_KW, hf_overrides=lambda cfg: None)


# -- 10. start_profile / stop_profile with profiler_config ------------------------------------

def test_profiler_writes_a_trace_of_the_workers_steps(make_tiny_checkpoint, tmp_path, llm):
    import gzip
    import json
    import os

    trace_dir = tmp_path / "traces"
    profiled = LLM(make_tiny_checkpoint("llama"), **ENGINE_KW,
                   profiler_config={"profiler": "torch", "torch_profiler_dir": str(trace_dir)})
    profiled.generate("warm up", GREEDY, use_tqdm=False)       # not profiled
    assert not trace_dir.exists()
    profiled.start_profile()
    out = profiled.generate("The quick brown fox", GREEDY, use_tqdm=False)[0].outputs[0]
    profiled.stop_profile()
    assert len(out.token_ids) == 8
    files = os.listdir(trace_dir)
    assert len(files) == 1 and files[0].startswith("rank0.") and files[0].endswith(".pt.trace.json.gz")
    trace = json.loads(gzip.open(trace_dir / files[0]).read())
    names = [e.get("name", "") for e in trace["traceEvents"]]
    steps = [n for n in names if n == "pagedllm::execute_model"]
    assert len(steps) == 8                                     # one per step: 1 prefill + 7 decodes
    assert "aten::embedding" in names                           # the model's ops are in it
    assert {"mkldnn::_linear_pointwise", "aten::linear", "aten::mm", "aten::addmm"} & set(names) \
        or any("f32_linear" in n for n in names)                   # the GEMMs (oneDNN / torch, or ours)
    assert any("models/llama.py" in n and "forward" in n for n in names)   # Python stacks (with_stack)
    profiled.llm_engine.shutdown()

    with pytest.raises(RuntimeError, match="profiler_config"):
        llm.start_profile()
    with pytest.raises(RuntimeError, match="profiler_config"):
        llm.stop_profile()
    with pytest.raises(ValueError, match="torch_profiler_dir"):
        LLM(make_tiny_checkpoint("llama"), **ENGINE_KW, profiler_config={"profiler": "torch"})
    with pytest.raises(ValueError, match="unknown key"):
        LLM(make_tiny_checkpoint("llama"), **ENGINE_KW, profiler_config={"profiler": "torch", "dir": "x"})


def test_profiler_dir_from_the_environment_at_the_edge(monkeypatch, tmp_path):
    from pagedllm import EngineArgs
    from pagedllm.utils import FlexibleArgumentParser

    assert EngineArgs().create_profiler_config().enabled is False
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "v"))
    assert EngineArgs().profiler_config == {"profiler": "torch", "torch_profiler_dir": str(tmp_path / "v")}
    monkeypatch.setenv("PAGEDLLM_TORCH_PROFILER_DIR", str(tmp_path / "p"))
    config = EngineArgs().create_profiler_config()
    assert config.enabled and config.torch_profiler_dir == str(tmp_path / "p")
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])).profiler_config["torch_profiler_dir"] == str(tmp_path / "p")
    flag = parser.parse_args(["--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "t"}'])
    assert EngineArgs.from_cli_args(flag).create_profiler_config().torch_profiler_dir == os.path.abspath("t")


def test_profiler_and_logits_processors_in_worker_processes(make_tiny_checkpoint, tmp_path):
    """The multiprocess executor: each rank process records its own steps and writes its trace;
    class-based logits processors (item 11) travel by name to the sampling rank and run there."""
    import json

    trace_dir = tmp_path / "mp_traces"
    llm = LLM(make_tiny_checkpoint("llama"), **ENGINE_KW, distributed_executor_backend="mp", tensor_parallel_size=2,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(trace_dir),
                               "torch_profiler_use_gzip": False, "torch_profiler_with_stack": False},
              logits_processors=[DummyLogitsProcessor])
    try:
        llm.start_profile()
        llm.generate("The quick brown fox", GREEDY, use_tqdm=False)
        llm.stop_profile()
        forced = llm.generate(["The quick brown fox", "blocks"],
                              [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, extra_args={"target_token": 9}),
                               GREEDY], use_tqdm=False)
        assert forced[0].outputs[0].token_ids == [9] * 4 and forced[1].outputs[0].token_ids != [9] * 8
    finally:
        llm.llm_engine.shutdown()
    files = sorted(os.listdir(trace_dir))
    assert [f.split(".")[0] for f in files] == ["rank0", "rank1"] and all(f.endswith(".pt.trace.json") for f in files)
    for f in files:
        names = [e.get("name", "") for e in json.load(open(trace_dir / f))["traceEvents"]]
        assert names.count("pagedllm::execute_model") == 8 and "aten::embedding" in names


# -- 11. class-based logits processors (vLLM V1's interface) ---------------------------------

import torch  # noqa: E402

from pagedllm.v1.sample.logits_processor import (AdapterLogitsProcessor, BatchUpdate,  # noqa: E402
                                                 LogitsProcessor)
from pagedllm.v1.sample.logits_processor.builtin import process_dict_updates  # noqa: E402


class DummyLogitsProcessor(LogitsProcessor):
    """The logic of vLLM's examples/offline_inference/logits_processor/custom.py: a request whose
    ``extra_args`` name a ``target_token`` can only produce that token."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.req_info: dict[int, int] = {}
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.device = device

    @classmethod
    def validate_params(cls, params):
        target = (params.extra_args or {}).get("target_token")
        if target is not None and (not isinstance(target, int) or target < 0):
            raise ValueError(f"extra_args.target_token must be a token id, got {target!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        process_dict_updates(self.req_info, batch_update,
                             lambda params, _prompt, _out: (params.extra_args or {}).get("target_token"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits
        rows = torch.tensor(list(self.req_info), dtype=torch.long, device=logits.device)
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long, device=logits.device)
        keep = logits[rows, cols].clone()
        logits[rows] = float("-inf")
        logits[rows, cols] = keep
        return logits


class KeepTopOneForRandomRows(LogitsProcessor):
    """Argmax-invariant: keeps each row's best token only; counts the rows it was given."""

    calls: list[int] = []

    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        type(self).calls.append(logits.shape[0])
        best = logits.argmax(dim=-1, keepdim=True)
        return torch.full_like(logits, float("-inf")).scatter_(1, best, logits.gather(1, best))


class BanTokenAdapter(AdapterLogitsProcessor):
    """vLLM's adapter style: a per-request function from ``extra_args["ban"]``."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        ban = (params.extra_args or {}).get("ban")
        if ban is None:
            return None

        def fn(output_ids, row):
            row[ban] = float("-inf")
            return row
        return fn


PROMPTS = ["Hello, my name is", "The quick brown fox", "A paged KV cache", "Numbers 0123456789"]


def test_dummy_logits_processor_forces_the_target_token_of_its_requests_only(make_tiny_checkpoint, llm):
    target = 77
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert all(target not in o.outputs[0].token_ids for o in plain)
    # max_num_seqs=2: the batch changes as requests finish and join (removed / added / moved).
    forced = LLM(make_tiny_checkpoint("llama"), **ENGINE_KW, max_num_seqs=2, logits_processors=[DummyLogitsProcessor])
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True,
                             extra_args={"target_token": target} if i % 2 == 0 else None) for i in range(4)]
    params.append(SamplingParams(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True,
                                 extra_args={"target_token": target}))    # a random row is forced too
    outs = forced.generate(PROMPTS + ["blocks"], params, use_tqdm=False)
    for i, out in enumerate(outs[:4]):
        if i % 2 == 0:
            assert out.outputs[0].token_ids == [target] * (6 + i)
        else:   # untouched requests: exactly what the engine gives without the processor
            assert out.outputs[0].token_ids[:6] == plain[i].outputs[0].token_ids
    assert outs[4].outputs[0].token_ids == [target] * 5
    with pytest.raises(ValueError, match="target_token"):    # validate_params, before anything runs
        forced.generate("x", SamplingParams(extra_args={"target_token": "seventy"}), use_tqdm=False)
    forced.llm_engine.shutdown()
    # By name, as --logits-processors takes them; and the adapter style.
    by_name = LLM(make_tiny_checkpoint("llama"), **ENGINE_KW,
                  logits_processors=[f"{__name__}:DummyLogitsProcessor", BanTokenAdapter])
    first = plain[1].outputs[0].token_ids[0]
    outs = by_name.generate(PROMPTS[1], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                        extra_args={"ban": first})], use_tqdm=False)
    assert outs[0].outputs[0].token_ids[0] != first
    by_name.llm_engine.shutdown()
    with pytest.raises(ValueError, match="logits_processors"):
        LLM(make_tiny_checkpoint("llama"), **ENGINE_KW, logits_processors=[object])
    with pytest.raises(ValueError, match="logits_processors"):
        LLM(make_tiny_checkpoint("llama"), **ENGINE_KW, logits_processors=["no.such.module:Proc"])


def test_argmax_invariant_processors_run_after_temperature_on_random_rows_only(make_tiny_checkpoint, llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    top1 = LLM(make_tiny_checkpoint("llama"), **ENGINE_KW, logits_processors=[KeepTopOneForRandomRows])
    KeepTopOneForRandomRows.calls.clear()
    top1.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert KeepTopOneForRandomRows.calls == []                        # all greedy: never applied
    hot = top1.generate(PROMPTS, SamplingParams(temperature=5.0, seed=0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in hot] == [o.outputs[0].token_ids for o in greedy]
    assert KeepTopOneForRandomRows.calls and max(KeepTopOneForRandomRows.calls) == 4   # the whole batch
    top1.llm_engine.shutdown()


@pytest.mark.multiprocess   # spawns two replica processes
@pytest.mark.timeout(300)
def test_data_parallel_reset_and_profile_reach_every_replica(make_tiny_checkpoint, tmp_path):
    trace_dir = tmp_path / "dp_traces"
    llm = LLM(make_tiny_checkpoint("llama"), **ENGINE_KW, data_parallel_size=2,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(trace_dir)})
    try:
        llm.start_profile()
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.stop_profile()
        assert [len(o.outputs[0].token_ids) for o in outs] == [8] * 4
        assert len(os.listdir(trace_dir)) == 2                      # one trace per replica's worker
        assert llm.reset_prefix_cache(reset_running_requests=True) is True
        assert llm.reset_prefix_cache() is True
    finally:
        llm.llm_engine.shutdown()
