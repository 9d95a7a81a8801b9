"""``StructuredOutputsParams`` -> a grammar key, the backend-neutral form of a constraint.

A request's grammar is checked once, by the input processor, to refuse an invalid schema, regex
or grammar with a ``StructuredOutputsError`` before anything is queued
(``validate_structured_outputs``; the server maps it to the request field the constraint came
from), then compiled against the vocabulary in the compile thread by the engine's backend
(``backend.py``). ``grammar_key`` is the canonical text used as the
compile cache's key: two requests with the same schema, whatever its key order or spacing, share
one compiled grammar.
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.config import StructuredOutputsConfig
from pagedllm.sampling_params import StructuredOutputsParams

# ``json_object``: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
_JSON_OBJECT_SCHEMA = {"type": "object"}


def _parsed(value: Any, field: str) -> Any:
    """``value`` itself, or the value of its JSON text when it is a string.

    Raises:
        ValueError: naming ``field`` when the text is not JSON.
    """
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{field} is not valid JSON: {e}") from None


def _schema_of(params: StructuredOutputsParams) -> dict | bool:
    """The JSON schema of a ``json`` / ``json_object`` constraint.

    Raises:
        ValueError: naming ``structured_outputs.json`` when the text is not JSON.
    """
    if params.json_object:
        return _JSON_OBJECT_SCHEMA
    schema = _parsed(params.json, "structured_outputs.json")
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


def _structural_tag_of(params: StructuredOutputsParams) -> dict:
    """vLLM's structural tag, checked: ``{"structures": [{"begin", "schema", "end"}], "triggers"}``
    (a ``"type": "structural_tag"`` key is allowed); every ``begin`` starts with a trigger.

    Raises:
        ValueError: naming ``structured_outputs.structural_tag`` and what is wrong.
    """
    field = "structured_outputs.structural_tag"
    tag = _parsed(params.structural_tag, field)
    if not isinstance(tag, dict):
        raise ValueError(f"{field} must be an object with structures and triggers, got {type(tag).__name__}")
    unknown = sorted(set(tag) - {"type", "structures", "triggers"})
    if unknown:
        raise ValueError(f"{field} has unknown key(s) {unknown}; it takes structures and triggers")
    triggers, structures = tag.get("triggers"), tag.get("structures")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{field}.triggers must be a non-empty list of non-empty strings, got {triggers!r}")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{field}.structures must be a non-empty list, got {structures!r}")
    out = []
    for i, s in enumerate(structures):
        where = f"{field}.structures[{i}]"
        if not isinstance(s, dict) or set(s) != {"begin", "schema", "end"}:
            raise ValueError(f"{where} must be an object with exactly begin, schema and end, got {s!r}")
        if not isinstance(s["begin"], str) or not isinstance(s["end"], str):
            raise ValueError(f"{where}: begin and end must be strings")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise ValueError(f"{where}: begin {s['begin']!r} does not start with any trigger {triggers}")
        if not isinstance(s["schema"], (dict, bool)):
            raise ValueError(f"{where}.schema must be a JSON schema object, got {type(s['schema']).__name__}")
        check_schema_refs(s["schema"], f"{where}.schema")
        out.append({"begin": s["begin"], "schema": s["schema"], "end": s["end"]})
    return {"structures": out, "triggers": list(triggers)}


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
    unconstrained (xgrammar warns and accepts it) or fail inside the backend; nothing is fetched.

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


def _canonical(schema: Any, ordered: bool = False) -> Any:
    """``schema`` with the keys of every object sorted, except the members of a ``properties``
    object: their order is the order in which the constrained JSON writes them (both backends
    follow it), so it is part of what the grammar means and stays as given."""
    if isinstance(schema, dict):
        items = schema.items() if ordered else sorted(schema.items())
        return {k: _canonical(v, ordered=not ordered and k == "properties") for k, v in items}
    if isinstance(schema, list):
        return [_canonical(v) for v in schema]
    return schema


# Keywords whose values are data, not schemas; keywords whose values map names to schemas.
_DATA_KEYWORDS = ("enum", "const", "default", "examples")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def map_subschemas(node: Any, fn) -> Any:
    """A copy of a schema with ``fn`` (dict -> dict) applied to every subschema, innermost first.
    Values of data keywords (``enum``, ``const``, ``default``, ``examples``) are kept as they are;
    the values of name -> schema maps (``properties``, ``$defs``, ...) are subschemas, the maps
    themselves are not (a property may be named like a keyword)."""
    if isinstance(node, list):
        return [map_subschemas(v, fn) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: map_subschemas(schema, fn) for name, schema in value.items()}
        else:
            out[key] = map_subschemas(value, fn)
    return fn(out)


def _closed_object(schema: dict) -> dict:
    if isinstance(schema.get("properties"), dict) and not any(
            k in schema for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")):
        schema["additionalProperties"] = False
    return schema


def declared_properties_only(schema: Any) -> Any:
    """A copy of a schema in which every object schema that declares ``properties`` and says
    nothing of others (no ``additionalProperties``, ``patternProperties`` or
    ``unevaluatedProperties``) gets ``additionalProperties: false``: the output holds only the
    properties the schema names. xgrammar does this itself (its ``strict_mode``, on by default);
    llguidance follows JSON Schema, where undeclared properties are allowed, and a small model
    then writes made-up members until ``max_tokens``. vLLM offers the same rewrite for its
    guidance backend (``disable_additional_properties``)."""
    return map_subschemas(schema, _closed_object)


def grammar_key(params: StructuredOutputsParams, disable_any_whitespace: bool,
                disable_additional_properties: bool = True) -> tuple[str, str]:
    """(kind, canonical text) identifying the compiled grammar of ``params``.

    Args:
        params: the constraint.
        disable_any_whitespace: the engine's default, used when ``params`` leaves it None.
        disable_additional_properties: object schemas with ``properties`` admit no others
            (``declared_properties_only``).
    Raises:
        ValueError: as ``_schema_of``.
    """
    kind = params.kind
    if kind in ("json", "json_object"):
        compact = disable_any_whitespace if params.disable_any_whitespace is None else params.disable_any_whitespace
        schema = _schema_of(params)
        if disable_additional_properties:
            schema = declared_properties_only(schema)
        text = json.dumps(_canonical(schema), separators=(",", ":"), ensure_ascii=False)
        return ("json-compact" if compact else "json", text)
    if kind == "structural_tag":
        tag = _structural_tag_of(params)
        compact = disable_any_whitespace if params.disable_any_whitespace is None else params.disable_any_whitespace
        for s in tag["structures"]:
            s["schema"] = _canonical(declared_properties_only(s["schema"]) if disable_additional_properties
                                     else s["schema"])
        return ("structural_tag", json.dumps({**tag, "compact": compact}, separators=(",", ":"), ensure_ascii=False))
    if kind == "regex":
        return ("regex", params.regex)
    if kind == "choice":
        return ("choice", json.dumps(list(params.choice), ensure_ascii=False))
    return ("grammar", params.grammar)


def config_key(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> tuple[str, str]:
    """``grammar_key`` with the engine's defaults (``config``)."""
    return grammar_key(params, config.disable_any_whitespace, config.disable_additional_properties)


class StructuredOutputsError(ValueError):
    """A constraint the backend cannot build. The message names the engine's field
    (``structured_outputs.json: ...``, or ``structured_outputs_backend=...`` when its package is
    missing)."""

    @property
    def reason(self) -> str:
        """The message without its leading ``structured_outputs.<field>: ``."""
        message = str(self)
        return message.split(": ", 1)[-1] if message.startswith("structured_outputs.") else message


def validate_structured_outputs(params: StructuredOutputsParams, config: StructuredOutputsConfig | None = None) -> None:
    """Check that the backend can build the constraint's grammar (the edge check; no vocabulary).

    Args:
        params: the constraint.
        config: the engine's settings (its backend, JSON defaults); None: the defaults.
    Raises:
        StructuredOutputsError: naming the field (``structured_outputs.json`` / ``.regex`` /
            ``.choice`` / ``.grammar``), or ``structured_outputs_backend`` when its package is missing.
    """
    from pagedllm.structured_output.backend import get_backend_class

    config = config or StructuredOutputsConfig()
    try:
        get_backend_class(config.backend).validate(config_key(params, config))
    except StructuredOutputsError:
        raise
    except ValueError as e:
        raise StructuredOutputsError(str(e)) from None
