"""The llguidance backend (``structured_outputs_backend="guidance"``, the default; a dependency).

Grammar keys become llguidance grammar texts (``LLMatcher.grammar_from_json_schema``,
``llguidance.grammar_from`` for regex / choice / GBNF or Lark); "compiling" one is checking it
(``LLMatcher.validate_grammar``) and building a matcher at its start, which each request copies;
llguidance computes each mask from the token trie (https://github.com/guidance-ai/llguidance). Matchers never raise
on a bad token: they enter an error state, which ``accept_token`` reports as False.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np

from pagedllm.structured_output.backend import GrammarMatcher, StructuredOutputBackend, compile_error
from pagedllm.structured_output.grammar import map_subschemas

logger = logging.getLogger(__name__)

def _bounded_number_decimals(schema: dict) -> dict:
    """A ``number`` with a bound (``minimum`` / ``maximum`` / exclusive ones) and no
    ``multipleOf`` gets ``multipleOf: 1e-6``: at most 6 decimals, what xgrammar 0.2.8 allows
    there. llguidance allows any number of digits, and the default model, asked for a number in
    [-10, 10], wrote 320-token decimals (tests/structured_output/test_structured_default_model.py:
    4 of 80 samples ended by max_tokens, all of that schema)."""
    if schema.get("type") == "number" and "multipleOf" not in schema and any(
            k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        schema["multipleOf"] = 1e-6
    return schema


def _object_schema(schema) -> dict:
    """A schema as llguidance takes it: ``true`` as ``{}``, bounded numbers rewritten.

    Raises:
        ValueError: for the schema ``false`` (it admits nothing).
    """
    if schema is True:      # the schema that admits every JSON value
        schema = {}
    elif schema is False:
        raise ValueError("the schema false admits no value")
    return map_subschemas(schema, _bounded_number_decimals)


# JSON compile options (llguidance docs/json_schema.md): compact separators, or free whitespace.
_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_FLEXIBLE = {"whitespace_flexible": True}


def grammar_text(key: tuple[str, str]) -> str:
    """The llguidance grammar (its serialized form) of a key from ``grammar.grammar_key``.

    Raises:
        ValueError: naming the field, with llguidance's message, when the constraint is invalid;
            naming ``structured_outputs_backend`` when llguidance is not installed.
    """
    llg = GuidanceBackend.import_engine()
    kind, text = key
    try:
        if kind in ("json", "json-compact"):
            schema = _object_schema(json.loads(text))
            grammar = llg.LLMatcher.grammar_from_json_schema(
                json.dumps(schema, ensure_ascii=False), defaults=_COMPACT if kind == "json-compact" else _FLEXIBLE)
        elif kind == "structural_tag":
            tag = json.loads(text)
            options = _COMPACT if tag["compact"] else _FLEXIBLE
            tags = [llg.StructTag(trigger=next(t for t in tag["triggers"] if s["begin"].startswith(t)),
                                  begin=s["begin"], end=s["end"],
                                  grammar={**_object_schema(s["schema"]), "x-guidance": options})
                    for s in tag["structures"]]
            # assume_special=False: a trigger such as "<function=" is text here, not a special token.
            grammar = llg.LLMatcher.grammar_from_lark(llg.StructTag.to_grammar(tags, assume_special=False))
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(text)
        elif kind == "choice":
            grammar = llg.grammar_from("choice", text)
        else:
            grammar = llg.grammar_from("grammar", text)   # GBNF (xgrammar's / llama.cpp's EBNF) or Lark
        error = llg.LLMatcher.validate_grammar(grammar)
    except Exception as e:  # ValueError from the GBNF converter or a malformed schema
        raise compile_error(kind, "llguidance", e) from None
    if error:
        raise compile_error(kind, "llguidance", error)
    return grammar


class GuidanceMatcher(GrammarMatcher):
    """An ``llguidance.LLMatcher``."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        view = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)

    def fork(self) -> "GuidanceMatcher":
        return GuidanceMatcher(self._matcher.deep_copy())


def _tokenizer_json(backend) -> str:
    """``backend`` (a ``tokenizers.Tokenizer``) as JSON with no padding and no truncation: what a
    tokenizer holds for llguidance's token trie."""
    text = backend.to_str()
    if backend.padding is None and backend.truncation is None:
        return text
    spec = json.loads(text)
    spec["padding"] = spec["truncation"] = None
    return json.dumps(spec)


class GuidanceBackend(StructuredOutputBackend):
    """llguidance's tokenizer (``LLTokenizer``: the token trie) and matchers."""

    name = "guidance"
    modules = ("llguidance", "llguidance.hf")
    install = "pip install llguidance (a dependency of pagedllm: pip install -e .)"

    @classmethod
    def validate(cls, key: tuple[str, str]) -> None:
        grammar_text(key)

    def __init__(self, tokenizer, vocab_size: int) -> None:
        llg = self.import_engine()
        t0 = time.perf_counter()
        # The engine's own tokenizer, serialized as llguidance's ``hf.from_tokenizer`` serializes a
        # transformers one (with padding and truncation off), without building that transformers
        # tokenizer and its copy first (Gemma 3: ~5 s instead of ~15 s).
        self._tokenizer = llg.LLTokenizer(_tokenizer_json(tokenizer.backend), n_vocab=vocab_size,
                                          eos_token=list(tokenizer.eos_token_ids))
        self._llg = llg
        logger.info("structured output: llguidance tokenizer over %d tokens built in %.2f s",
                    vocab_size, time.perf_counter() - t0)

    def compile(self, key: tuple[str, str]):
        """A matcher at the grammar's start (llguidance builds its parser here, in the compile
        pool); each request gets a deep copy.

        Raises:
            ValueError: as ``grammar_text``, or naming the field when the matcher fails.
        """
        # log_level 0: a rejected token is logged by the scheduler, not printed on stderr.
        matcher = self._llg.LLMatcher(self._tokenizer, grammar_text(key), log_level=0)
        if matcher.is_error():
            raise compile_error(key[0], "llguidance", matcher.get_error())
        return matcher

    def new_matcher(self, compiled) -> GuidanceMatcher:
        return GuidanceMatcher(compiled.deep_copy())
