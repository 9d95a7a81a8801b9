"""``bench throughput --structured-output json``: the cost of grammar-constrained decoding.

The workload's prompts, request ``i`` constrained by ``BENCH_JSON_SCHEMAS[i % 8]`` (8 distinct
schemas, every string and array bounded so a reply can end). Reported: the grammar compile time
of each distinct schema over the model's vocabulary (mean, p99; compiled once each, before the
timed runs, as the LRU cache would), the one-off tokenizer-info build, and output tokens/s of the
same workload with and without constraints (greedy; ``ignore_eos`` on the unconstrained run as
in plain ``bench throughput``, while a constrained reply ends when its grammar does). No torch here.
"""

from __future__ import annotations

import time

from pagedllm.benchmarks.metrics import mean, percentile

_NAME = {"type": "string", "maxLength": 16}
BENCH_JSON_SCHEMAS: tuple[dict, ...] = (
    {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": _NAME, "temp_c": {"type": "number", "minimum": -60, "maximum": 60},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["city", "temp_c", "unit"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1, "maxItems": 8},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 24},
                                      "tags": {"type": "array", "items": _NAME, "maxItems": 4}},
     "required": ["title", "tags"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "code": {"type": "integer", "minimum": 100,
                                                                          "maximum": 599}}, "required": ["ok", "code"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                                "email": {"type": "string",
                                                                                          "maxLength": 32}},
                                               "required": ["id", "email"]}}, "required": ["user"]},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 12}]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                                      "event": {"type": "string", "maxLength": 20}}, "required": ["date", "event"]},
)


def schema_for(index: int) -> dict:
    """The schema of request ``index`` (round robin over the 8)."""
    return BENCH_JSON_SCHEMAS[index % len(BENCH_JSON_SCHEMAS)]


def compile_schemas(engine) -> dict:
    """Compile the 8 schemas through the engine's ``StructuredOutputManager`` (its cache then
    holds them for the timed run) and time each compile.

    Returns:
        ``tokenizer_info_s`` (the one-off vocabulary build of the backend, s), ``compile_mean_s``,
        ``compile_p99_s``, ``compile_max_s`` (per distinct schema, s), ``num_schemas``.
    """
    from pagedllm.sampling_params import StructuredOutputsParams

    manager = engine.structured_output_manager
    t0 = time.perf_counter()
    manager.compiled_grammar(StructuredOutputsParams(choice=["warm"])).result()  # builds the tokenizer info
    tokenizer_info_s = time.perf_counter() - t0 - (manager.compile_times_s[-1] if manager.compile_times_s else 0.0)
    first = len(manager.compile_times_s)
    for schema in BENCH_JSON_SCHEMAS:  # one at a time: each time is one compile, not a queue wait
        manager.compiled_grammar(StructuredOutputsParams(json=schema)).result()
    times = manager.compile_times_s[first:]
    return {"tokenizer_info_s": tokenizer_info_s, "num_schemas": len(times), "compile_mean_s": mean(times),
            "compile_p99_s": percentile(times, 99), "compile_max_s": max(times, default=None)}
