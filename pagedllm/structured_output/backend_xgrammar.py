"""The xgrammar backend (``structured_outputs_backend="xgrammar"``; ``pip install 'pagedllm[xgrammar]'``).

Grammar keys become ``xgrammar.Grammar`` objects (JSON schema, regex, EBNF), compiled against
``xgrammar.TokenizerInfo``; each request has an ``xgrammar.GrammarMatcher``. The engine's bitmask
is a numpy array; xgrammar fills a torch view of the same memory.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np

from pagedllm.structured_output.backend import GrammarMatcher, StructuredOutputBackend, compile_error

logger = logging.getLogger(__name__)

# One JSON string character without escapes: U+0020-U+10FFFF less '"', '\\' and the surrogates.
# The range ends are the characters themselves: xgrammar's regex knows no "\U" escape (it warned
# and took "U" literally, which left out U+E000-U+10FFFF, emoji included).
_BOUNDED_STRING_PATTERN = "^[ !#-\\[\\]-\ud7ff\ue000-\U0010ffff]{%d,%s}$"


def bounded_strings_as_patterns(node):
    """A copy of a schema in which every length-bounded plain string (``type: string`` with
    ``minLength`` / ``maxLength``, no ``pattern`` / ``format`` / ``enum`` / ``const``) is the
    equivalent ``pattern`` of unescaped JSON characters, and a string with both a pattern and
    lengths keeps only the pattern.

    xgrammar 0.2.8 turns a length-bounded string into ``[^"\\\r\n]{m,n}``, which admits raw
    control characters (U+0000-U+001F other than CR, LF): invalid JSON that ``json.loads`` and
    pydantic refuse; and a negated class takes any continuation bytes after a UTF-8 lead byte
    (``F0 80 80 80``), which decodes to U+FFFD and breaks the length. The pattern here lists the
    allowed code points as ranges (no ``"``, ``\\``, control characters or surrogates), which
    xgrammar turns into exact UTF-8 byte ranges. Strings so bounded carry no escape sequences.
    xgrammar ignores lengths next to a pattern anyway (and warns on stderr each time).
    """
    if isinstance(node, list):
        return [bounded_strings_as_patterns(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: bounded_strings_as_patterns(v) for k, v in node.items()}
    if out.get("type") == "string" and ("minLength" in out or "maxLength" in out) \
            and not any(k in out for k in ("format", "enum", "const")):
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        if "pattern" not in out and isinstance(lo, int) and (hi == "" or isinstance(hi, int)):
            out["pattern"] = _BOUNDED_STRING_PATTERN % (lo, hi)
    return out


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes, which
    xgrammar's EBNF string literals accept)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(key: tuple[str, str]):
    """The ``xgrammar.Grammar`` of a key from ``grammar.grammar_key``.

    Raises:
        ValueError: naming the field, with xgrammar's message, when xgrammar cannot build it;
            naming ``structured_outputs_backend`` when xgrammar is not installed.
    """
    xgr = XgrammarBackend.import_engine()
    kind, text = key
    try:
        if kind in ("json", "json-compact"):
            schema = json.dumps(bounded_strings_as_patterns(json.loads(text)), ensure_ascii=False)
            if kind == "json-compact":
                return xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":"))
            return xgr.Grammar.from_json_schema(schema, any_whitespace=True)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(text)))
        if kind == "structural_tag":
            tag = json.loads(text)
            items = [xgr.StructuralTagItem(begin=s["begin"], end=s["end"], schema=json.dumps(
                bounded_strings_as_patterns(s["schema"]), ensure_ascii=False)) for s in tag["structures"]]
            return xgr.Grammar.from_structural_tag(items, tag["triggers"])
        return xgr.Grammar.from_ebnf(text)
    except Exception as e:  # xgrammar raises RuntimeError / its own errors with the parser's message
        raise compile_error(kind, "xgrammar", e) from None


class XgrammarMatcher(GrammarMatcher):
    """An ``xgrammar.GrammarMatcher``."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        import torch

        self._matcher.fill_next_token_bitmask(torch.from_numpy(bitmask), row)

    def fork(self) -> "XgrammarMatcher":
        return XgrammarMatcher(self._matcher.fork())


class XgrammarBackend(StructuredOutputBackend):
    """xgrammar's tokenizer info and compiler (one thread, its own cache off: the manager's LRU
    bounds the compiled grammars by entries)."""

    name = "xgrammar"
    modules = ("xgrammar",)
    install = "pip install 'pagedllm[xgrammar]' (or: pip install xgrammar==0.2.8)"

    @classmethod
    def validate(cls, key: tuple[str, str]) -> None:
        build_grammar(key)

    def __init__(self, tokenizer, vocab_size: int) -> None:
        xgr = self.import_engine()
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer.get_hf_tokenizer(), vocab_size=vocab_size,
                                                  stop_token_ids=list(tokenizer.eos_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        logger.info("structured output: xgrammar tokenizer info over %d tokens built in %.2f s",
                    vocab_size, time.perf_counter() - t0)

    def compile(self, key: tuple[str, str]):
        return self._compiler.compile_grammar(build_grammar(key))

    def new_matcher(self, compiled) -> XgrammarMatcher:
        xgr = self.import_engine()
        return XgrammarMatcher(xgr.GrammarMatcher(compiled))
