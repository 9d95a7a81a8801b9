"""Constrained decoding on a tiny random Llama (nothing downloaded): a random model never writes
valid JSON by chance, so every valid output here is the grammar's doing. Outputs are checked with
``jsonschema`` / ``re.fullmatch`` / membership; greedy constrained ids equal a reference that masks
transformers' logits with the backend library's own matcher, step by step. Every test that runs
an engine runs once per backend (llguidance, the default, and xgrammar, the extra)."""

from __future__ import annotations

import gc
import json
import re
import weakref
from pathlib import Path

import jsonschema
import pytest

from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from tests.structured_output.backends import BACKENDS, ReferenceMatcher

SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "json_schemas.json").read_text())
MAX_TOKENS = 400
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request, make_tiny_checkpoint):
    engine = LLM(make_tiny_checkpoint("llama"), dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20, seed=0,
                 block_size=4, max_num_seqs=16, structured_outputs_backend=request.param)
    assert engine.llm_engine.structured_output_manager.backend_name == request.param
    yield engine
    engine.llm_engine.shutdown()


def _params(seed=None, temperature=1.0, max_tokens=MAX_TOKENS, **constraint):
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint))


def test_json_schemas_valid_at_temperature_one(llm):
    """20 schemas x 4 seeded samples (n=4) at temperature 1: all finish with "stop" and validate."""
    params = [SamplingParams(n=4, temperature=1.0, seed=100 + i, max_tokens=MAX_TOKENS,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for i, schema in enumerate(SCHEMAS)]
    outs = llm.generate([f"Write item {i}:" for i in range(len(SCHEMAS))], params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs):
        assert len(out.outputs) == 4
        for c in out.outputs:
            assert c.finish_reason == "stop", (schema, c.text)
            jsonschema.validate(json.loads(c.text), schema)
        # A random model at temperature 1 does not repeat itself across 4 seeds (schemas with
        # few values, booleans and enums, may).
    texts = {c.text for out in outs for c in out.outputs}
    assert len(texts) > 40


@pytest.mark.parametrize("seed", range(6))
def test_regex_and_choice_valid_for_many_seeds(llm, seed):
    regex = r"(\+|-)?[0-9]{1,3}\.[0-9]{2} [A-Z][a-z]{2,5}"
    choices = ["alpha", "beta gamma", "δέλτα", "x"]
    outs = llm.generate(["a", "b"], [_params(seed, regex=regex), _params(seed, choice=choices)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "stop"
    assert re.fullmatch(regex, outs[0].outputs[0].text), outs[0].outputs[0].text
    assert outs[1].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].text in choices


def test_grammar_and_json_object(llm):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    outs = llm.generate(["x"] * 2, [_params(3, grammar=grammar), _params(4, json_object=True)], use_tqdm=False)
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", outs[0].outputs[0].text)
    assert isinstance(json.loads(outs[1].outputs[0].text), dict)
    assert GuidedDecodingParams is StructuredOutputsParams


def _reference_greedy(backend: str, model_dir: str, prompt_ids: list[int], schema: dict, eos_ids: list[int],
                      max_tokens: int) -> list[int]:
    """transformers' logits, masked by a fresh matcher of the backend's library each step, argmax."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    matcher = ReferenceMatcher(backend, AutoTokenizer.from_pretrained(model_dir), model.config.vocab_size, eos_ids,
                               schema)
    ids, out = list(prompt_ids), []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1, :].float()
            logits[~matcher.allowed()] = float("-inf")
            tok = int(logits.argmax(-1))
            assert matcher.accept(tok)
            out.append(tok)
            ids.append(tok)
            if matcher.is_terminated():
                break
    return out


def test_greedy_equals_backend_reference_over_transformers(llm, make_tiny_checkpoint):
    # No length-bounded strings: the engine hands this schema to the backend unchanged (the
    # xgrammar backend rewrites those), so the reference compiles the same grammar.
    schema = {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[a-f0-9]{4}$"}, "level": {"enum": ["low", "mid", "high"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 500}, "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["code", "level", "n", "ok", "tags"], "additionalProperties": False}
    tok = llm.get_tokenizer()
    prompt_ids = tok.encode("Fill in the user:")
    out = llm.generate([prompt_ids], _params(temperature=0.0, json=schema), use_tqdm=False)[0].outputs[0]
    backend = llm.llm_engine.structured_output_manager.backend_name
    ref = _reference_greedy(backend, make_tiny_checkpoint("llama"), prompt_ids, schema, list(tok.eos_token_ids),
                            MAX_TOKENS)
    assert out.token_ids == ref
    jsonschema.validate(json.loads(out.text), schema)


def test_batched_constrained_rows_equal_alone_and_unconstrained_rows_unaffected(llm):
    schema = SCHEMAS[9]
    free = SamplingParams(temperature=0.0, max_tokens=20)
    alone_free = llm.generate(["plain"], free, use_tqdm=False)[0].outputs[0].token_ids
    alone_json = llm.generate(["json"], _params(temperature=0.0, json=schema), use_tqdm=False)[0].outputs[0]
    both = llm.generate(["plain", "json"], [free, _params(temperature=0.0, json=schema)], use_tqdm=False)
    assert both[0].outputs[0].token_ids == alone_free
    assert both[1].outputs[0].token_ids == alone_json.token_ids


def test_max_tokens_cut_gives_length_and_a_valid_prefix(llm, make_tiny_checkpoint):
    from transformers import AutoTokenizer

    schema = SCHEMAS[18]
    out = llm.generate(["x"], _params(5, max_tokens=6, json=schema), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    tok = llm.get_tokenizer()
    reference = ReferenceMatcher(llm.llm_engine.structured_output_manager.backend_name,
                                 AutoTokenizer.from_pretrained(make_tiny_checkpoint("llama")),
                                 llm.llm_engine.vocab_size, list(tok.eos_token_ids), schema)
    assert all(reference.accept(t) for t in out.token_ids) and not reference.is_terminated()


def test_logprobs_stop_strings_and_seeds(llm):
    choices = ["apple pie", "banana split", "cherry tart"]
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=30, logprobs=2,
                       structured_outputs=StructuredOutputsParams(choice=choices))
    a = llm.generate(["q"], p, use_tqdm=False)[0]
    b = llm.generate(["q"], p, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    for c in a.outputs:
        assert c.text in choices
        assert len(c.logprobs) == len(c.token_ids)
        # The mask is applied before the logprobs: the sampled token is finite and every listed
        # alternative is a token the grammar allowed (finite).
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert entry[tok].logprob > float("-inf")
    stopped = llm.generate(["q"], SamplingParams(temperature=0.0, max_tokens=30, stop=[" "],
                                                 structured_outputs=StructuredOutputsParams(choice=choices)),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.text in {c.split(" ")[0] for c in choices}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_chunked_prefill_and_prefix_caching(make_tiny_checkpoint, mode, backend):
    """A KV pool too small for the batch preempts constrained requests (recompute, or swap to the
    host pool); long shared prompts hit the prefix cache and are chunked: outputs stay valid and
    equal the unpressured run (each matcher keeps its state across the preemption)."""
    schema = SCHEMAS[16]
    path = make_tiny_checkpoint("llama")
    prompt = "shared prefix " * 4
    params = [_params(seed, json=schema, max_tokens=100) for seed in range(6)]
    roomy = LLM(path, dtype="float32", max_model_len=160, kv_cache_memory_bytes=64 << 20, seed=0, block_size=4,
                structured_outputs_backend=backend)
    want = [o.outputs[0].text for o in roomy.generate([prompt] * 6, params, use_tqdm=False)]
    roomy.llm_engine.shutdown()
    tight = LLM(path, dtype="float32", max_model_len=160, num_gpu_blocks_override=40, seed=0, block_size=4,
                max_num_batched_tokens=64, preemption_mode=mode, swap_space=0.01, structured_outputs_backend=backend)
    got = [o.outputs[0].text for o in tight.generate([prompt] * 6, params, use_tqdm=False)]
    assert tight.llm_engine.scheduler.num_preemptions_by_mode[mode] > 0
    tight.llm_engine.shutdown()
    assert got == want
    for text in got:
        jsonschema.validate(json.loads(text), schema)


def test_abort_leaves_no_matcher_and_no_bitmask_row(llm):
    engine = llm.llm_engine
    engine.add_request("keep", "k", _params(1, json=SCHEMAS[19]))
    engine.add_request("drop", "d", _params(2, json=SCHEMAS[19]))
    for _ in range(50):
        engine.step()
        if engine.scheduler.get_request("drop").num_output_tokens >= 3:
            break
    handle = weakref.ref(engine.scheduler.get_request("drop").structured_output_request.matcher)
    engine.abort_request("drop")
    sched = engine.scheduler.schedule()
    assert "drop" in sched.finished_req_ids and "drop" not in sched.structured_output_request_ids
    assert list(sched.structured_output_request_ids) == ["keep"]
    # Undo the manual schedule: finish "keep" too, then let the engine drain.
    engine.abort_request("keep")
    engine.scheduler.worker_diffs.num_tokens.clear()
    gc.collect()
    assert handle() is None
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("constraint,field", [
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar="root ::= missing_rule"), "structured_outputs.grammar"),
])
def test_invalid_constraints_name_the_field(llm, constraint, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_two_kinds_or_none_is_a_value_error():
    with pytest.raises(ValueError, match="only one kind"):
        StructuredOutputsParams(json={"type": "string"}, regex="a")
    with pytest.raises(ValueError, match="must set one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice="abc")


def test_compile_cache_is_keyed_by_canonical_schema_and_bounded(make_tiny_checkpoint):
    path = make_tiny_checkpoint("llama")
    small = LLM(path, max_model_len=128, kv_cache_memory_bytes=16 << 20, seed=0,
                max_structured_output_grammar_cache=2)
    manager = small.llm_engine.structured_output_manager
    a = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "boolean"}}, "required": ["x"]}
    # The same schema with its keywords in another order (the members of "properties" keep theirs:
    # their order is the order the JSON is written in).
    a_reordered = {"required": ["x"], "properties": {"x": {"type": "integer"}, "y": {"type": "boolean"}},
                   "type": "object"}
    f1 = manager.compiled_grammar(StructuredOutputsParams(json=a))
    f2 = manager.compiled_grammar(StructuredOutputsParams(json=json.dumps(a_reordered, indent=2)))
    assert f1 is f2 and manager.num_cached_grammars == 1
    a_swapped = {"type": "object", "properties": {"y": {"type": "boolean"}, "x": {"type": "integer"}}, "required": ["x"]}
    assert manager.compiled_grammar(StructuredOutputsParams(json=a_swapped)) is not f1
    assert manager.num_cached_grammars == 2
    manager.compiled_grammar(StructuredOutputsParams(regex="a+"))
    manager.compiled_grammar(StructuredOutputsParams(choice=["p", "q"]))
    assert manager.num_cached_grammars == 2
    assert manager.compiled_grammar(StructuredOutputsParams(json=a)) is not f1  # evicted, recompiled
    out = small.generate(["x"], _params(0, json=a, max_tokens=60), use_tqdm=False)[0].outputs[0]
    jsonschema.validate(json.loads(out.text), a)
    small.llm_engine.shutdown()


def test_batched_bitmask_fill_and_apply_equal_per_row_reference(llm):
    """The manager's step bitmask holds each matcher's own fill (alone, in a fresh array) in its
    row, and the worker's apply (unpacked bits, ``masked_fill_``), on rows out of order and on
    rows ``0..k-1``, equals setting the forbidden logits of each row to -inf by hand."""
    import numpy as np
    import torch

    from pagedllm.structured_output.bitmask import apply_grammar_bitmask

    manager = llm.llm_engine.structured_output_manager
    handles = [manager.make_request(StructuredOutputsParams(json=SCHEMAS[i])) for i in (0, 5, 9)]
    handles.append(manager.make_request(StructuredOutputsParams(regex=r"[a-c]{2,4}")))
    for h in handles:
        h._compiled.result()
        assert h.is_ready() and h.error is None
    words = (manager.vocab_size + 31) // 32
    first = np.zeros((1, words), dtype=np.int32)  # move one matcher past its start state
    handles[1].matcher.fill_bitmask(first, 0)
    first_allowed = int(np.flatnonzero(np.unpackbits(first.view(np.uint8), bitorder="little"))[0])
    assert handles[1].accept_tokens([first_allowed])

    class _Req:  # what the manager reads of a core.Request
        def __init__(self, handle):
            self.structured_output_request = handle

    rows = {f"r{i}": i for i in range(len(handles))}
    got = manager.grammar_bitmask({f"r{i}": _Req(h) for i, h in enumerate(handles)}, rows)
    vocab = manager.vocab_size
    want = np.zeros((len(handles), words), dtype=np.int32)
    for i, h in enumerate(handles):
        alone = np.zeros((1, words), dtype=np.int32)
        h.matcher.fill_bitmask(alone, 0)
        want[i] = alone[0]
    assert got.shape == (len(handles), words) and np.array_equal(got, want)

    allowed = (torch.from_numpy(got).to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1  # [4, W, 32]
    allowed = allowed.reshape(len(handles), -1)[:, :vocab].bool()
    assert 0 < int(allowed.sum()) < allowed.numel()
    for positions in ([4, 0, 5, 2], [0, 1, 2, 3]):  # logits row of each bitmask row
        logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
        expected = logits.clone()
        for i, p in enumerate(positions):
            expected[p][~allowed[i]] = float("-inf")
        apply_grammar_bitmask(logits, got, positions)
        assert torch.equal(logits, expected)
        for p in set(range(6)) - set(positions):  # unconstrained rows untouched
            assert torch.isfinite(logits[p]).all()


def _accepts(backend: str, key: tuple[str, str], text: str, hf_tokenizer) -> bool:
    """Whether the backend's grammar of ``key`` accepts exactly ``text`` (the library's own check)."""
    if backend == "xgrammar":
        from xgrammar.testing import _is_grammar_accept_string

        from pagedllm.structured_output.backend_xgrammar import build_grammar

        return _is_grammar_accept_string(build_grammar(key), text)
    import llguidance
    import llguidance.hf

    from pagedllm.structured_output.backend_guidance import grammar_text

    tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=len(hf_tokenizer))
    matcher = llguidance.LLMatcher(tok, grammar_text(key), log_level=0)
    return matcher.consume_tokens(hf_tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_whitespace_is_what_the_readme_says(backend, make_tiny_checkpoint):
    """No free whitespace in JSON constraints: a schema's declared members and items are joined by
    "," and ":" alone; the parts a schema leaves untyped (all of ``json_object``, extra
    properties) get the same with llguidance, and xgrammar 0.2.8's fixed ", " between members
    and items; never newlines."""
    from transformers import AutoTokenizer

    from pagedllm.structured_output.grammar import grammar_key

    hf_tokenizer = AutoTokenizer.from_pretrained(make_tiny_checkpoint("llama"))

    def accepts(constraint, text):
        key = grammar_key(StructuredOutputsParams(**constraint), disable_any_whitespace=True)
        return _accepts(backend, key, text, hf_tokenizer)

    untyped = '{"a":"x", "b":[1, {"c":null}]}' if backend == "xgrammar" else '{"a":"x","b":[1,{"c":null}]}'
    assert accepts(dict(json_object=True), '{"a":1}') and accepts(dict(json_object=True), untyped)
    refused = ['{ "a":1}', '{"a": 1}', '{"a":1,\n"b":2}']
    refused += ['{"a":1,"b":2}', '{"a":[1,2]}'] if backend == "xgrammar" else ['{"a":1, "b":2}', '{"a":[1, 2]}']
    for text in refused:
        assert not accepts(dict(json_object=True), text), text
    typed = dict(json={"type": "object", "properties": {"l": {"type": "array", "items": {"type": "integer"}},
                                                        "n": {"type": "integer"}},
                       "required": ["l", "n"], "additionalProperties": False})
    assert accepts(typed, '{"l":[1,2],"n":1}')
    for text in ('{"l":[1,2], "n":1}', '{"l":[1, 2],"n":1}', '{"l": [],"n":1}'):
        assert not accepts(typed, text), text


def test_json_members_are_written_in_the_schema_order(llm):
    """Two schemas that differ only in the order of their properties compile to two grammars, and
    each reply writes its members in its schema's order (not sorted: a pydantic model's field
    order survives)."""
    for order in (["zeta", "alpha", "mid"], ["alpha", "mid", "zeta"]):
        schema = {"type": "object", "properties": {k: {"type": "boolean"} for k in order},
                  "required": order, "additionalProperties": False}
        out = llm.generate(["order"], _params(0, json=schema, max_tokens=40), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop"
        assert list(json.loads(out.text, object_pairs_hook=lambda pairs: [k for k, _ in pairs])) == order



WEATHER_TAG = {"type": "structural_tag", "triggers": ["<function="], "structures": [
    {"begin": "<function=get_weather>", "end": "</function>",
     "schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}},
    {"begin": "<function=get_time>", "end": "</function>",
     "schema": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}]}


def test_structural_tag_free_text_then_each_structure(llm):
    """vLLM's structural tag: free text is accepted; after a trigger only the begin of a structure,
    JSON valid against its schema and its end; then free text again (the handle's own accept, token
    by token, with the engine's tokenizer)."""
    manager = llm.llm_engine.structured_output_manager
    tok = llm.get_tokenizer()

    def accepts(text: str) -> bool:
        handle = manager.make_request(StructuredOutputsParams(structural_tag=json.dumps(WEATHER_TAG)))
        handle._compiled.result()
        assert handle.is_ready() and handle.error is None, handle.error
        return handle.accept_tokens(tok.encode(text, add_special_tokens=False))

    assert accepts("Just some text, no call.")
    assert accepts('Sure. <function=get_weather>{"city":"Paris"}</function> and <function=get_time>{"tz":"CET"}'
                   '</function> done')
    for bad in ('<function=get_weather>{"town":"Paris"}', '<function=get_date>{}', '<function=get_time>{"tz":"PST"}',
                '<function=get_weather>{"city":"Paris"}</func'):
        if bad.endswith("</func"):   # a prefix of the end is fine; a different end is not
            assert accepts(bad) and not accepts(bad + "x>")
        else:
            assert not accepts(bad), bad
    out = llm.generate(["Call a tool:"], _params(3, structural_tag=WEATHER_TAG, max_tokens=40), use_tqdm=False)
    assert out[0].outputs[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("tag, fragment", [
    ({"structures": [], "triggers": ["<f"]}, "structures must be a non-empty list"),
    ({"structures": [{"begin": "<g>", "schema": {}, "end": "</g>"}], "triggers": ["<f"]}, "does not start with any trigger"),
    ({"structures": [{"begin": "<f>", "schema": {}}], "triggers": ["<f"]}, "exactly begin, schema and end"),
    ({"structures": [{"begin": "<f>", "schema": {"$ref": "#/$defs/x"}, "end": ""}], "triggers": ["<f"]}, "cannot be resolved"),
    ({"structures": [{"begin": "<f>", "schema": {}, "end": ""}], "triggers": []}, "triggers must be a non-empty list"),
    ("{not json", "not valid JSON"),
])
def test_bad_structural_tags_name_the_field(llm, tag, fragment):
    with pytest.raises(ValueError, match=r"structured_outputs\.structural_tag.*" + re.escape(fragment)):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag=tag)),
                     use_tqdm=False)
