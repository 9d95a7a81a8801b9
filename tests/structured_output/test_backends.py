"""Choosing the structured-output backend: names, vLLM's config forms, the CLI flags, and the
errors (unknown names and keys, a backend whose package is missing) that come before any weight
loads."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from pagedllm.config import StructuredOutputsConfig
from pagedllm.engine.arg_utils import EngineArgs, add_engine_cli_args, engine_args_from_cli
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.backend import get_backend_class, resolve_backend_name
from pagedllm.structured_output.grammar import validate_structured_outputs
from tests.structured_output.backends import BACKENDS


def test_auto_is_guidance_and_unknown_names_are_value_errors():
    assert resolve_backend_name("auto") == "guidance"
    assert get_backend_class("auto").name == "guidance"
    for bad in ("outlines", "lm-format-enforcer", ""):
        with pytest.raises(ValueError, match="structured_outputs_backend"):
            StructuredOutputsConfig(backend=bad)
        with pytest.raises(ValueError, match="structured_outputs_backend"):
            resolve_backend_name(bad)


def test_vllm_structured_outputs_config_forms():
    args = EngineArgs(structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": False})
    config = args.create_structured_outputs_config()
    assert (config.backend, config.disable_any_whitespace, config.max_grammar_cache) == ("xgrammar", False, 64)
    # The dict is laid over the flat arguments; a config object is taken as it is.
    config = EngineArgs(structured_outputs_backend="xgrammar", max_structured_output_grammar_cache=3,
                        structured_outputs_config={"disable_additional_properties": False}
                        ).create_structured_outputs_config()
    assert (config.backend, config.max_grammar_cache, config.disable_additional_properties) == ("xgrammar", 3, False)
    given = StructuredOutputsConfig(backend="guidance", compile_threads=1)
    assert EngineArgs(structured_outputs_config=given).create_structured_outputs_config() is given
    with pytest.raises(ValueError, match=r"structured_outputs_config has unknown key\(s\) \['bakend'\]"):
        EngineArgs(structured_outputs_config={"bakend": "guidance"}).create_structured_outputs_config()
    with pytest.raises(ValueError, match="structured_outputs_config must be a dict"):
        EngineArgs(structured_outputs_config="guidance").create_structured_outputs_config()


def test_cli_flags():
    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    ns = parser.parse_args(["--structured-outputs-backend", "guidance",
                            "--structured-outputs-config", '{"disable_any_whitespace": false}'])
    config = engine_args_from_cli(ns, "m").create_structured_outputs_config()
    assert (config.backend, config.disable_any_whitespace) == ("guidance", False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--structured-outputs-backend", "outlines"])


def test_missing_backend_package_fails_before_weights_load(monkeypatch, make_tiny_checkpoint):
    """With xgrammar absent (an import that fails), asking for it is a ValueError naming the
    option and the install command, at engine start: no engine, no weights read."""
    monkeypatch.setitem(sys.modules, "xgrammar", None)   # ``import xgrammar`` raises ImportError
    with pytest.raises(ValueError, match=r"structured_outputs_backend='xgrammar' needs the xgrammar package.*"
                                         r"pip install 'pagedllm\[xgrammar\]'"):
        LLM("/nonexistent/model/folder", structured_outputs_backend="xgrammar")
    with pytest.raises(ValueError, match="structured_outputs_backend='xgrammar'"):
        validate_structured_outputs(StructuredOutputsParams(regex="a"), StructuredOutputsConfig(backend="xgrammar"))
    # The default backend does not need it.
    llm = LLM(make_tiny_checkpoint("llama"), max_model_len=64, kv_cache_memory_bytes=8 << 20, block_size=4)
    out = llm.generate(["x"], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"])), use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("constraint, field, fragment", [
    (dict(regex="(unclosed"), "structured_outputs.regex", "regular expression"),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "structured_outputs.json", "JSON schema"),
    (dict(json={"type": "strin"}), "structured_outputs.json", "JSON schema"),
    (dict(grammar="root ::= missing_rule"), "structured_outputs.grammar", "grammar"),
])
def test_compile_errors_name_the_field_and_the_backend(backend, constraint, field, fragment):
    engine_name = {"guidance": "llguidance", "xgrammar": "xgrammar"}[backend]
    try:
        validate_structured_outputs(StructuredOutputsParams(**constraint), StructuredOutputsConfig(backend=backend))
    except ValueError as e:
        assert str(e).startswith(f"{field}: {engine_name} cannot compile this {fragment}: "), str(e)
    else:
        # xgrammar accepts some schemas llguidance refuses (it ignores what it cannot express).
        assert backend == "xgrammar" and "json" in constraint, constraint


def test_engine_start_imports_no_grammar_engine_until_the_first_grammar(make_tiny_checkpoint):
    """An engine start only checks that the backend's package is installed (``check_engine``):
    ``llguidance.hf`` imports transformers (seconds of CPU per server start), so neither is imported
    until the first constrained request, which then runs as before."""
    folder = make_tiny_checkpoint("llama")
    code = ("import json, sys; from pagedllm import LLM, SamplingParams\n"
            "from pagedllm.sampling_params import StructuredOutputsParams\n"
            f"llm = LLM({folder!r}, max_model_len=64, kv_cache_memory_bytes=8 << 20, block_size=4)\n"
            "llm.generate(['x'], SamplingParams(max_tokens=4), use_tqdm=False)\n"
            "names = ('transformers', 'llguidance.hf')\n"
            "before = [m for m in names if m in sys.modules]\n"
            "text = llm.generate(['x'], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams("
            "choice=['yes', 'no'])), use_tqdm=False)[0].outputs[0].text\n"
            "print(json.dumps([before, [m for m in names if m in sys.modules], text]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    before, after, text = json.loads(done.stdout.strip().splitlines()[-1])
    assert before == [] and "llguidance.hf" in after and text in ("yes", "no"), done.stdout


@pytest.mark.parametrize("truncation", [False, True], ids=["engine-tokenizer", "truncation-set"])
def test_guidance_vocabulary_equals_llguidance_from_the_transformers_tokenizer(tiny_tokenizer_dir, truncation):
    """The guidance backend builds its token trie from the engine's own tokenizer (its JSON, as
    llguidance's ``hf.from_tokenizer`` serializes a transformers tokenizer: padding and truncation
    off, also when the engine's tokenizer has truncation set). Either way: llguidance's reference
    built from ``AutoTokenizer``, token for token."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from pagedllm.structured_output.backend_guidance import GuidanceBackend
    from pagedllm.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(tiny_tokenizer_dir)
    if truncation:
        tokenizer.backend.enable_truncation(64)
    vocab = tokenizer.vocab_size + 3   # a model's embedding rows past the tokenizer's
    ours = GuidanceBackend(tokenizer, vocab)._tokenizer
    ref = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tiny_tokenizer_dir), n_vocab=vocab,
                                       eos_token=list(tokenizer.eos_token_ids))
    assert isinstance(ours, llguidance.LLTokenizer)
    assert ours.vocab_size == ref.vocab_size == vocab
    assert ours.eos_token == ref.eos_token
    assert [ours.decode_bytes([i]) for i in range(vocab)] == [ref.decode_bytes([i]) for i in range(vocab)]
    assert [ours.is_special_token(i) for i in range(vocab)] == [ref.is_special_token(i) for i in range(vocab)]
    long_text = "The quick brown fox jumps over the lazy dog. " * 20   # past the truncation's 64 tokens
    assert len(ref.tokenize_str(long_text)) > 64
    for text in ("The quick brown fox", "Über café naïve — 你好，世界！ 😀", "  two  spaces\nand a newline", long_text):
        assert ours.tokenize_str(text) == ref.tokenize_str(text)
