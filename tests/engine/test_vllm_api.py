"""vLLM's Python surface (issue 28, item 3): a vLLM script runs with ``vllm`` -> ``pagedllm`` in
its imports. Tiny random Llama checkpoints; every check asserts values, not only that a call works."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys

import pytest

import pagedllm
from pagedllm import LLM, SamplingParams

ENGINE_KW = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20)
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
    from pagedllm.v1.engine.async_llm import AsyncLLM as V1AsyncLLM

    assert pagedllm.EngineArgs is EngineArgs and pagedllm.AsyncEngineArgs is AsyncEngineArgs
    assert issubclass(AsyncEngineArgs, EngineArgs)
    assert pagedllm.LLMEngine is LLMEngine and pagedllm.LLM is LLMFromEntrypoints
    assert pagedllm.AsyncLLMEngine is AsyncLLM is AsyncLLMEngine is V1AsyncLLM is pagedllm.AsyncLLM
    assert pagedllm.BeamSearchParams is BeamSearchParams is BeamFromEngine
    assert FlexibleArgumentParser is FAP
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
