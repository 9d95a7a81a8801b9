"""GGUF conversion time and peak memory per quant type, on the default model (Gemma 3 270M).

    python benchmarks/gguf_quant_types.py --work-dir /tmp/gguf_types [--types Q4_0,Q4_K] [--json out.json]

1. Dequantization speed: :func:`pagedllm.loaders.gguf.dequantize_tensor` on a 16384 x 2048
   tensor (33.5 M values) of each type, best of 5 interleaved rounds, in this process (Mvalues/s and the ratio to
   Q4_K's time; the target is no type slower than 2x Q4_K).
2. Conversion: for each type, the default model's GGUF rewritten with every 2-D weight in that type
   (norms stay F32, as llama.cpp keeps them), then ``convert_gguf_to_hf_folder`` run in a child
   process under ``tools/peak_memory.py`` (wall time, peak summed RSS, and the converter's own
   header / weights / tokenizer split). Each weight is, in order of preference: copied when the
   Q4_K_M file already holds it in that type; quantized by gguf-py from the dequantized Q4_K_M
   values (F16/BF16/Q4_0 ... Q8_0); or valid random blocks of that type
   (:func:`pagedllm.benchmarks.gguf_types.random_blocks`; gguf-py has no K-quant/IQ4_XS
   quantizer, and dequantization cost does not depend on the values). Rows whose length is not a
   multiple of the type's block (Gemma 3 270M's hidden size 640 is not a multiple of the K-quants'
   256) fall back as llama.cpp's ``llama-quantize`` does: Q4_K -> Q5_0, Q5_K -> Q5_1,
   Q6_K -> Q8_0, and Q2_K / Q3_K / IQ4_XS -> Q4_0 (llama.cpp uses IQ4_NL, which pagedllm does
   not load). The table says how many values each file holds in the type itself.

The conversions write into ``--work-dir`` (each GGUF and its 1.07 GB folder are deleted after
use) and a private cache, never ``~/.cache/pagedllm``. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np

from pagedllm.benchmarks.gguf_types import encode
from pagedllm.loaders.gguf import (
    SUPPORTED_GGUF_TYPES,
    GGUFHeader,
    GGUFTensorInfo,
    dequantize_tensor,
    read_gguf_header,
)
from pagedllm.loaders.model_files import default_gguf_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# llama.cpp llama-quant.cpp: the type used when a row is not a multiple of the K-quant block.
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "IQ4_XS": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# Metadata the rewritten file must not copy (the writer adds the architecture; the file type
# would be wrong).
_SKIP_KEYS = {"general.architecture", "general.file_type", "GGUF.version", "GGUF.tensor_count",
              "GGUF.kv_count"}


def _value_type(value):
    """(GGUFValueType, array sub-type or None, value) for one metadata value of our reader."""
    from gguf import GGUFValueType as V

    numpy_types = {np.dtype(np.uint8): V.UINT8, np.dtype(np.int8): V.INT8, np.dtype(np.uint16): V.UINT16,
                   np.dtype(np.int16): V.INT16, np.dtype(np.uint32): V.UINT32, np.dtype(np.int32): V.INT32,
                   np.dtype(np.float32): V.FLOAT32, np.dtype(np.uint64): V.UINT64,
                   np.dtype(np.int64): V.INT64, np.dtype(np.float64): V.FLOAT64, np.dtype(np.bool_): V.BOOL}
    if isinstance(value, np.ndarray):
        return V.ARRAY, numpy_types[value.dtype], value.tolist()
    if isinstance(value, list):
        return V.ARRAY, V.STRING, value
    if isinstance(value, bool):
        return V.BOOL, None, value
    if isinstance(value, int):
        return (V.UINT32 if 0 <= value < 2**32 else V.INT64), None, value
    if isinstance(value, float):
        return V.FLOAT32, None, value
    return V.STRING, None, value


def _storage_type(type_name: str, info: GGUFTensorInfo) -> str:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if len(info.shape) < 2:
        return "F32"
    block_size, _ = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return type_name if info.shape[-1] % block_size == 0 else FALLBACK[type_name]


def write_in_type(source: GGUFHeader, type_name: str, path: str, seed: int = 0) -> dict[str, int]:
    """Rewrite ``source`` with its weights in ``type_name`` (see the module docstring).

    Returns:
        values per origin: ``copied`` / ``quantized`` / ``random`` (in ``type_name``),
        ``fallback`` (another block type), ``f32`` (1-D tensors kept in F32).
    """
    import gguf
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, source.architecture, use_temp_file=True)
    for key, value in source.metadata.items():
        if key not in _SKIP_KEYS:
            vtype, sub_type, packed = _value_type(value)
            writer.add_key_value(key, packed, vtype, sub_type)
    blob = np.memmap(source.path, dtype=np.uint8, mode="r")
    counts = {"copied": 0, "quantized": 0, "random": 0, "fallback": 0, "f32": 0}
    for info in source.tensors:
        target = _storage_type(type_name, info)
        numel = int(np.prod(info.shape))
        if GGMLQuantizationType(info.ggml_type).name == target:  # already in that type: copy
            origin = "copied"
            array = np.array(blob[info.offset:info.offset + info.nbytes]).reshape(*info.shape[:-1], -1)
            raw_dtype = GGMLQuantizationType[target]
        else:
            origin = "quantized" if gguf_quantizes(target) else "random"
            array, raw_dtype = encode(target, dequantize_tensor(blob, info), rng)
        if target != type_name:
            origin = "f32" if target == "F32" else "fallback"
        counts[origin] += numel
        writer.add_tensor(info.name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def gguf_quantizes(type_name: str) -> bool:
    """Whether gguf-py has a numpy quantizer for the type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[type_name]
    try:
        quantize(np.zeros((1, GGML_QUANT_SIZES[qtype][0]), np.float32), qtype)
    except NotImplementedError:
        return False
    return True


def dequantize_speeds(types: list[str], rows: int = 16384, cols: int = 2048,
                      repeats: int = 5) -> dict[str, float]:
    """Best-of-``repeats`` seconds of :func:`dequantize_tensor` on a rows x cols tensor per type,
    the types interleaved in each round (so a busy spell of a shared machine hits them alike)."""
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(0)
    data = rng.normal(0, 0.05, (rows, cols)).astype(np.float32)
    inputs = {}
    for type_name in types:
        array, _ = encode(type_name, data, rng)
        raw = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        inputs[type_name] = raw, GGUFTensorInfo(
            "x.weight", (rows, cols), int(GGMLQuantizationType[type_name]), 0, raw.nbytes)
    best = dict.fromkeys(types, float("inf"))
    for _ in range(repeats):
        for type_name, (raw, info) in inputs.items():
            t0 = time.perf_counter()
            dequantize_tensor(raw, info)
            best[type_name] = min(best[type_name], time.perf_counter() - t0)
    return best


_CONVERT = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from pagedllm.loaders.gguf import convert_gguf_to_hf_folder
convert_gguf_to_hf_folder(sys.argv[1], sys.argv[2])
"""
_LOG_RE = re.compile(r"header ([\d.]+) s, weights ([\d.]+) s .*tokenizer ([\d.]+) s")
_PEAK_RE = re.compile(r"wall ([\d.]+) s, peak summed RSS ([\d.]+) GiB")


def measure_conversion(gguf_path: str, out_dir: str) -> dict[str, float]:
    """Convert in a child process under tools/peak_memory.py; seconds and GiB."""
    os.makedirs(out_dir)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "peak_memory.py"), "--", sys.executable, "-c", _CONVERT,
         gguf_path, out_dir], capture_output=True, text=True, env=env, check=True)
    log = _LOG_RE.search(proc.stderr)
    peak = _PEAK_RE.search(proc.stderr)
    if log is None or peak is None:
        raise RuntimeError(f"could not parse the conversion output:\n{proc.stderr[-2000:]}")
    shutil.rmtree(out_dir)
    return {"wall_s": float(peak.group(1)), "peak_rss_gib": float(peak.group(2)),
            "header_s": float(log.group(1)), "weights_s": float(log.group(2)), "tokenizer_s": float(log.group(3))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", required=True, help="scratch folder (GGUFs, converted folders)")
    parser.add_argument("--types", default=",".join(SUPPORTED_GGUF_TYPES), help="comma-separated type names")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--dequantize-only", action="store_true", help="only the dequantization table")
    ns = parser.parse_args(argv)
    types = [t for t in ns.types.split(",") if t]
    for t in types:
        if t not in SUPPORTED_GGUF_TYPES:
            parser.error(f"--types: {t!r} is not one of {', '.join(SUPPORTED_GGUF_TYPES)}")
    os.makedirs(ns.work_dir, exist_ok=True)
    source_path, _ = default_gguf_path(cache_dir=os.path.join(ns.work_dir, "cache"))
    source = read_gguf_header(source_path)

    speeds = dequantize_speeds(types)
    results = {"source": source_path, "dequantize_s": speeds, "conversion": {}}
    print("| type | dequantize 33.5 M values (s) | Mvalues/s | / Q4_K |")
    print("|---|---|---|---|")
    base = speeds.get("Q4_K")
    for t, seconds in speeds.items():
        ratio = f"{seconds / base:.2f}" if base else "-"
        print(f"| {t} | {seconds:.3f} | {33.554432 / seconds:.0f} | {ratio} |")

    if ns.dequantize_only:
        return 0
    print("\n| file | values in the type | written (s) | conversion wall (s) | weights (s) | tokenizer (s) "
          "| peak RSS (GiB) |")
    print("|---|---|---|---|---|---|---|")
    jobs = [("Q4_K_M (original)", None), *((t, t) for t in types)]
    for label, type_name in jobs:
        t0 = time.perf_counter()
        if type_name is None:
            path, share = source_path, "-"
        else:
            path = os.path.join(ns.work_dir, f"gemma3-270m-{type_name}.gguf")
            counts = write_in_type(source, type_name, path)
            total = sum(counts.values())
            in_type = counts["copied"] + counts["quantized"] + counts["random"]
            how = ", ".join(f"{k} {v / total:.0%}" for k, v in counts.items() if v)
            share = f"{in_type / total:.0%} ({how})"
        written = time.perf_counter() - t0
        row = measure_conversion(path, os.path.join(ns.work_dir, "converted"))
        row["values_in_type"] = share
        results["conversion"][label] = row
        if type_name is not None:
            os.remove(path)
        print(f"| {label} | {share} | {written:.1f} | {row['wall_s']:.1f} | {row['weights_s']:.2f} | "
              f"{row['tokenizer_s']:.2f} | {row['peak_rss_gib']:.2f} |", flush=True)
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
