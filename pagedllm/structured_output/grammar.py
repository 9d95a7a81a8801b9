"""``StructuredOutputsParams`` -> ``xgrammar.Grammar`` (no vocabulary needed: cheap, done at the edge).

The grammar of a request is built twice: once by the input processor, to refuse an invalid
schema, regex or grammar with a ``ValueError`` before anything is queued, and again in the compile
thread (then compiled against the vocabulary). ``grammar_key`` is the canonical text used as the
compile cache's key: two requests with the same schema, whatever its key order or spacing, share
one compiled grammar.
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.sampling_params import StructuredOutputsParams

# ``json_object``: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
_JSON_OBJECT_SCHEMA = {"type": "object"}


def _schema_of(params: StructuredOutputsParams) -> dict | bool:
    """The JSON schema of a ``json`` / ``json_object`` constraint.

    Raises:
        ValueError: naming ``structured_outputs.json`` when the text is not JSON.
    """
    if params.json_object:
        return _JSON_OBJECT_SCHEMA
    schema = params.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
    check_schema_refs(schema)
    return schema


def _pointer_target(root: Any, pointer: str) -> bool:
    """Whether the JSON pointer ``pointer`` (RFC 6901, the part after ``#``; ``""`` is the root)
    names a value inside ``root``."""
    from urllib.parse import unquote

    node = root
    for token in pointer.split("/")[1:] if pointer else []:
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return False
    return True


def walk_schema(node: Any, path: str = "#"):
    """(path, dict) for every object in a schema, depth first; ``path`` is a JSON pointer."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from walk_schema(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from walk_schema(value, f"{path}/{i}")


def check_schema_refs(schema: Any, field: str = "structured_outputs.json") -> None:
    """Every ``$ref`` of ``schema`` resolves inside ``schema`` itself: a JSON pointer (``#``,
    ``#/$defs/Name``, ``#/definitions/Name``, ``#/properties/a``) to a value that exists, or a
    ``#name`` fragment that some subschema declares as its ``$anchor``. A reference that does not
    (a missing definition, a URL, a file) would otherwise leave that part of the output
    unconstrained (xgrammar warns and accepts it); nothing is fetched.

    Raises:
        ValueError: naming ``field``, the ``$ref`` and where it is (a JSON pointer).
    """
    nodes = list(walk_schema(schema, "#"))
    anchors = {n["$anchor"] for _, n in nodes if isinstance(n.get("$anchor"), str)}
    for path, node in nodes:
        if "$ref" not in node or path.endswith(("/properties", "/$defs", "/definitions")):
            continue   # (a property or definition named "$ref" is not a reference)
        ref = node["$ref"]
        if not isinstance(ref, str):
            raise ValueError(f"{field}: the $ref at {path} must be a string, got {type(ref).__name__}")
        if not ref.startswith("#"):
            raise ValueError(f"{field}: the $ref {ref!r} at {path} is not a reference inside this schema "
                             "('#', '#/$defs/...'); remote and file references are not fetched")
        fragment = ref[1:]
        ok = _pointer_target(schema, fragment) if fragment == "" or fragment.startswith("/") else fragment in anchors
        if not ok:
            raise ValueError(f"{field}: the $ref {ref!r} at {path} cannot be resolved: this schema has nothing there")


# One JSON string character without escapes: U+0020-U+10FFFF less '"', '\\' and the surrogates.
# The range ends are the characters themselves: xgrammar's regex knows no "\U" escape (it warned
# and took "U" literally, which left out U+E000-U+10FFFF, emoji included).
_BOUNDED_STRING_PATTERN = "^[ !#-\\[\\]-\ud7ff\ue000-\U0010ffff]{%d,%s}$"


def _bounded_strings_as_patterns(node):
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
        return [_bounded_strings_as_patterns(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _bounded_strings_as_patterns(v) for k, v in node.items()}
    if out.get("type") == "string" and ("minLength" in out or "maxLength" in out) \
            and not any(k in out for k in ("format", "enum", "const")):
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        if "pattern" not in out and isinstance(lo, int) and (hi == "" or isinstance(hi, int)):
            out["pattern"] = _BOUNDED_STRING_PATTERN % (lo, hi)
    return out


def _choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes, which
    xgrammar's EBNF string literals accept)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _canonical(schema: Any, ordered: bool = False) -> Any:
    """``schema`` with the keys of every object sorted, except the members of a ``properties``
    object: their order is the order in which the constrained JSON writes them (xgrammar follows
    it), so it is part of what the grammar means and stays as given."""
    if isinstance(schema, dict):
        items = schema.items() if ordered else sorted(schema.items())
        return {k: _canonical(v, ordered=not ordered and k == "properties") for k, v in items}
    if isinstance(schema, list):
        return [_canonical(v) for v in schema]
    return schema


def grammar_key(params: StructuredOutputsParams, disable_any_whitespace: bool) -> tuple[str, str]:
    """(kind, canonical text) identifying the compiled grammar of ``params``.

    Args:
        params: the constraint.
        disable_any_whitespace: the engine's default, used when ``params`` leaves it None.
    Raises:
        ValueError: as ``_schema_of``.
    """
    kind = params.kind
    if kind in ("json", "json_object"):
        compact = disable_any_whitespace if params.disable_any_whitespace is None else params.disable_any_whitespace
        text = json.dumps(_canonical(_bounded_strings_as_patterns(_schema_of(params))), separators=(",", ":"),
                          ensure_ascii=False)
        return ("json-compact" if compact else "json", text)
    if kind == "regex":
        return ("regex", params.regex)
    if kind == "choice":
        return ("grammar", _choice_ebnf(params.choice))
    return ("grammar", params.grammar)


# How xgrammar is installed (README Quickstart): without its dependencies, because its metadata
# asks for triton on Linux x86_64, which only its CUDA kernels use (docs/structured_output.md).
XGRAMMAR_INSTALL = "pip install --no-deps xgrammar==0.2.8"


def import_xgrammar():
    """``import xgrammar``, or an ImportError that says how to install it.

    Raises:
        ImportError: when xgrammar is not installed.
    """
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(f"structured outputs and tools need xgrammar, which is not installed: "
                          f"{XGRAMMAR_INSTALL} (see the README's Quickstart)") from e
    return xgrammar


def build_grammar(key: tuple[str, str]):
    """The ``xgrammar.Grammar`` of a key from ``grammar_key``.

    Raises:
        ValueError: naming the field, with xgrammar's message, when xgrammar cannot build it.
        ImportError: when xgrammar is not installed.
    """
    xgr = import_xgrammar()

    kind, text = key
    try:
        if kind in ("json", "json-compact"):
            if kind == "json-compact":
                return xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=(",", ":"))
            return xgr.Grammar.from_json_schema(text, any_whitespace=True)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        return xgr.Grammar.from_ebnf(text)
    except Exception as e:  # xgrammar raises RuntimeError / its own errors with the parser's message
        field = {"json": "json", "json-compact": "json", "regex": "regex", "grammar": "grammar"}[kind]
        what = {"json": "JSON schema", "regex": "regular expression", "grammar": "grammar"}[field]
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"structured_outputs.{field}: xgrammar cannot compile this {what}: {message}") from None


def validate_structured_outputs(params: StructuredOutputsParams, disable_any_whitespace: bool = True) -> None:
    """Check that xgrammar can build the constraint's grammar (the edge check; no vocabulary).

    Raises:
        ValueError: naming the field (``structured_outputs.json`` / ``.regex`` / ``.grammar``).
    """
    build_grammar(grammar_key(params, disable_any_whitespace))
