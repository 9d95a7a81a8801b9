"""Linear-layer kernels at a model's shapes, side by side (``pagedllm bench kernels``).

For each distinct linear shape of the model (from its config.json; the model is built on the
``meta`` device, so no weights are read) and each row count M, time ``y[M, out] = x[M, in] @
W[out, in]^T`` with random data through each backend and report GFLOP/s (2·M·in·out FLOPs per
call; for int8, the float32-equivalent FLOPs). Per backend and M, the "step" figure adds up the
time of every linear layer and the LM head of one decode step of M tokens, weighted by how many
layers have each shape, and gives the tokens/s those layers allow.

Backends (CPU; each is skipped with a reason where it does not run):
- ``onednn``: float32 oneDNN inner product with the weight packed once (the engine's CPU default,
  ``layers/linear.py``).
- ``torch``: float32 ``F.linear`` (MKL on the CPU; the reference path, ``PAGEDLLM_CPU_GEMM=torch``).
- ``bf16``: bfloat16 ``F.linear``.
- ``int8``: the engine's ``--quantization int8`` layer (``layers/quantization.py``: fbgemm's
  dynamically quantized linear with 7-bit per-channel weights and per-token scaled 8-bit
  activations).
- ``int8_wo`` / ``int4_wo``: the engine's ``--quantization int8_weight_only`` /
  ``int4_weight_only`` layers (``layers/weight_only.py``; int8: the kernel the engine picks here,
  the AVX-512 VNNI one of ``layers/int8_gemm.py`` where the CPU has it, else torch's
  ``_weight_int8pack_mm``; int4: torch's ``_weight_int4pack_mm_for_cpu``; weights only quantized).
- ``int8_wo_torch``: the int8 weight-only layer on torch's kernel (bfloat16 activations), to hold
  the VNNI kernel against.

Bandwidth: each kernel's GB/s is the bytes of its weight (``BYTES_PER_WEIGHT``) per call over
the call's time, the rate at which it streams its weight; at the small M of single-user decode a
linear layer is memory bound, so this is the figure to hold against the machine's memory
bandwidth, which ``stream_bandwidth`` measures like STREAM's Copy kernel (McCalpin 1995: ``b[:] =
a[:]`` over arrays far larger than the caches, counting the bytes read and written).

With ``compile_mlp``, one Gemma-style MLP block (RMSNorm, gate/up, GELU-tanh × up, down, RMSNorm,
residual add) at the model's sizes is also timed eagerly with packed weights and through
``torch.compile(dynamic=True)`` with inductor's weight freezing (docs/performance.md, step 4).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.benchmarks.latency import LinearShape, measure_linear_gflops, model_linear_layers, seconds_per_call

logger = logging.getLogger(__name__)

BACKENDS = ("onednn", "torch", "bf16", "int8", "int8_wo", "int8_wo_torch", "int4_wo")
# Bytes of weight each backend reads per weight element (scales and zeros left out: < 4% more).
BYTES_PER_WEIGHT = {"onednn": 4.0, "torch": 4.0, "bf16": 2.0, "int8": 1.0, "int8_wo": 1.0, "int8_wo_torch": 1.0,
                    "int4_wo": 0.5}
STREAM_ARRAY_BYTES = 256 << 20   # per array: far larger than any L3 cache


def stream_bandwidth(array_bytes: int = STREAM_ARRAY_BYTES, min_seconds: float = 0.3) -> dict:
    """STREAM-like memory bandwidth with torch's threads: Copy (``b.copy_(a)``: bytes read +
    written) and a read-only sum (``a.sum()``: bytes read), each over float32 arrays of
    ``array_bytes``.

    Returns:
        ``{"copy_gb_per_s", "read_gb_per_s", "array_bytes"}`` (GB = 1e9 bytes).
    """
    n = array_bytes // 4
    a = torch.ones(n, dtype=torch.float32)
    b = torch.empty_like(a)
    copy_s = seconds_per_call(lambda: b.copy_(a), min_seconds)
    read_s = seconds_per_call(lambda: a.sum(), min_seconds)
    return {"copy_gb_per_s": 2 * n * 4 / copy_s / 1e9, "read_gb_per_s": n * 4 / read_s / 1e9,
            "array_bytes": n * 4}


def model_linear_shapes(config: dict) -> list[LinearShape]:
    """Distinct linear shapes of the model described by ``config`` (a config.json dict), with how
    many layers of a decode step have each; the LM head is [vocab, hidden], counted once
    (``latency.model_linear_layers`` on the model built on the ``meta`` device).

    Raises:
        ValueError: for an unsupported architecture.
    """
    from pagedllm.config import ModelConfig
    from pagedllm.models.registry import get_model_class

    model_config = ModelConfig.from_hf_config(config)
    with torch.device("meta"):
        model = get_model_class(model_config)(model_config)
    return [LinearShape(i, o, c) for _, i, o, c in model_linear_layers(model)]


class BackendUnavailable(RuntimeError):
    """A kernel (or the compiled MLP block) that this machine or torch build cannot run."""


def make_backend(name: str, weight: torch.Tensor, batch_hint: int):
    """A callable x[M, in] float32 -> [M, out] running ``weight`` ([out, in] float32) through the
    backend ``name``, and the input dtype it takes.

    Raises:
        BackendUnavailable: if the backend does not run on this machine (the message says why).
        ValueError: for an unknown backend name.
    """
    if name == "onednn":
        from pagedllm.layers.linear import PackedLinear, onednn_linear_available

        if not onednn_linear_available(torch.float32):
            raise BackendUnavailable("oneDNN packed linear is unavailable here")
        return PackedLinear(weight, None, batch_hint), torch.float32
    if name == "torch":
        return (lambda x: F.linear(x, weight)), torch.float32
    if name == "bf16":
        w16 = weight.to(torch.bfloat16)
        return (lambda x: F.linear(x, w16)), torch.bfloat16
    if name == "int8":
        from pagedllm.layers.quantization import Int8DynamicLinear, int8_linear_available

        if not int8_linear_available():
            raise BackendUnavailable("fbgemm's int8 linear is unavailable in this torch build")
        return Int8DynamicLinear(weight, None), torch.float32
    if name in ("int8_wo", "int8_wo_torch", "int4_wo"):
        from pagedllm.layers.int8_gemm import TORCH_KERNEL, int8_kernel_for
        from pagedllm.layers.weight_only import (INT4_WEIGHT_ONLY, INT8_WEIGHT_ONLY, WEIGHT_ONLY_COMPUTE_DTYPE,
                                                 make_weight_only_layer, weight_only_available)

        mode = INT4_WEIGHT_ONLY if name == "int4_wo" else INT8_WEIGHT_ONLY
        if not weight_only_available(mode):
            raise BackendUnavailable(f"torch's CPU {mode} kernel does not run here")
        kernel = int8_kernel_for()[0] if name == "int8_wo" else TORCH_KERNEL
        return make_weight_only_layer(mode, weight, None, WEIGHT_ONLY_COMPUTE_DTYPE, kernel), torch.float32
    raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS}")


@dataclass
class KernelResult:
    """GFLOP/s per (shape, M, backend); ``skipped`` maps a backend to why it did not run."""

    shapes: list[LinearShape]
    rows: list[int]
    backends: list[str]
    gflops: dict[tuple[int, int, int, str], float] = field(default_factory=dict)  # (out, in, M, backend)
    skipped: dict[str, str] = field(default_factory=dict)
    mlp_block: list[dict] = field(default_factory=list)
    bandwidth: dict | None = None   # stream_bandwidth()

    def gb_per_s(self, out_features: int, in_features: int, m: int, backend: str) -> float | None:
        """Weight bytes streamed per second by one call (``BYTES_PER_WEIGHT``)."""
        rate = self.gflops.get((out_features, in_features, m, backend))
        return None if rate is None else BYTES_PER_WEIGHT[backend] * rate / (2 * m)

    def step_seconds(self, m: int, backend: str) -> float | None:
        """Seconds of all linear layers + LM head of one decode step of ``m`` tokens."""
        total = 0.0
        for s in self.shapes:
            rate = self.gflops.get((s.out_features, s.in_features, m, backend))
            if rate is None:
                return None
            total += s.flops(m) / (rate * 1e9)
        return total

    def to_dict(self) -> dict:
        """JSON-ready: one row per shape/M/backend, step totals, the skipped backends, the MLP block."""
        rows = [{"out_in": [o, i], "rows": m, "backend": b, "gflops_per_s": v}
                for (o, i, m, b), v in self.gflops.items()]
        steps = []
        for m in self.rows:
            for b in self.backends:
                sec = self.step_seconds(m, b)
                if sec is not None:
                    steps.append({"rows": m, "backend": b, "step_seconds": sec, "tokens_per_s": m / sec})
        for r in rows:
            r["weight_gb_per_s"] = self.gb_per_s(r["out_in"][0], r["out_in"][1], r["rows"], r["backend"])
        return {"kernels": rows, "steps": steps, "skipped": self.skipped, "mlp_block": self.mlp_block,
                "bandwidth": self.bandwidth,
                "shapes": [{"out_in": [s.out_features, s.in_features], "count": s.count} for s in self.shapes]}


def run_kernels(shapes: list[LinearShape], rows: list[int], backends: list[str], min_seconds: float = 0.3,
                seed: int = 0) -> KernelResult:
    """Time every shape × M × backend (see the module docstring).

    Raises:
        ValueError: for an unknown backend, or a row count < 1.
    """
    for name in backends:
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS}")
    if not rows or min(rows) < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    result = KernelResult(shapes=shapes, rows=list(rows), backends=list(backends))
    gen = torch.Generator().manual_seed(seed)
    for s in shapes:
        weight = torch.randn(s.out_features, s.in_features, generator=gen) * s.in_features ** -0.5
        for name in backends:
            if name in result.skipped:
                continue
            try:
                layer, dtype = make_backend(name, weight, max(rows))
            except BackendUnavailable as exc:
                result.skipped[name] = str(exc)
                logger.warning("kernels: backend %s skipped: %s", name, exc)
                continue
            for m in rows:
                rate = measure_linear_gflops(layer, s.in_features, s.out_features, m, dtype, torch.device("cpu"),
                                             min_seconds)
                result.gflops[(s.out_features, s.in_features, m, name)] = rate
                logger.info("kernels: [%d x %d] M=%d %s %.1f GFLOP/s", s.out_features, s.in_features, m, name, rate)
            del layer
    return result


class _GemmaMLPBlock(nn.Module):
    """``x + norm2(down(gelu_tanh(gate(norm1(x))) * up(norm1(x))))``; [M, hidden] float32."""

    def __init__(self, hidden: int, intermediate: int, packed: bool, gen: torch.Generator) -> None:
        super().__init__()
        from pagedllm.layers.linear import PackedLinear
        from pagedllm.layers.norm import GemmaRMSNorm

        self.pre, self.post = GemmaRMSNorm(hidden), GemmaRMSNorm(hidden)
        weights = [torch.randn(intermediate, hidden, generator=gen) * hidden ** -0.5,
                   torch.randn(intermediate, hidden, generator=gen) * hidden ** -0.5,
                   torch.randn(hidden, intermediate, generator=gen) * intermediate ** -0.5]
        layers = []
        for w in weights:
            if packed:
                layers.append(PackedLinear(w, None, 64))
            else:
                lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
                lin.weight.data.copy_(w)
                layers.append(lin)
        self.gate, self.up, self.down = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        return x + self.post(self.down(F.gelu(self.gate(h), approximate="tanh") * self.up(h)))


def time_mlp_block(hidden: int, intermediate: int, rows: list[int], min_seconds: float = 0.3,
                   seed: int = 0) -> list[dict]:
    """Milliseconds per call of one MLP block, eager with packed oneDNN weights vs
    ``torch.compile(dynamic=True)`` with ``freezing`` (inductor packs the weights itself), and
    the largest absolute difference of their outputs. Needs the oneDNN backend and a C++
    compiler (inductor's CPU code generation).

    Raises:
        BackendUnavailable: if oneDNN does not run here. Errors of torch.compile itself propagate.
    """
    import torch._inductor.config as inductor_config

    from pagedllm.layers.linear import onednn_linear_available

    if not onednn_linear_available(torch.float32):
        raise BackendUnavailable("oneDNN packed linear is unavailable here")
    eager = _GemmaMLPBlock(hidden, intermediate, True, torch.Generator().manual_seed(seed))
    plain = _GemmaMLPBlock(hidden, intermediate, False, torch.Generator().manual_seed(seed))
    out = []
    with inductor_config.patch(freezing=True), torch.inference_mode():
        compiled = torch.compile(plain, dynamic=True)
        for m in rows:
            x = torch.randn(m, hidden, generator=torch.Generator().manual_seed(seed + m))
            diff = float((eager(x) - compiled(x)).abs().max())
            times = {label: seconds_per_call(lambda fn=fn: fn(x), min_seconds) * 1e3
                     for label, fn in (("eager_packed_ms", eager), ("compiled_ms", compiled))}
            out.append({"rows": m, **times, "max_abs_diff": diff})
    return out


def format_kernels(result: KernelResult) -> str:
    """The table printed by ``pagedllm bench kernels``."""
    names = [b for b in result.backends if b not in result.skipped]
    lines = ["==== Linear kernels, GFLOP/s (2·M·in·out per call; int8 counted as float32 FLOPs) ====",
             f"{'shape [out x in] x count':<28}{'M':>6}" + "".join(f"{b:>14}" for b in names)]
    for s in result.shapes:
        for m in result.rows:
            vals = [result.gflops.get((s.out_features, s.in_features, m, b)) for b in names]
            lines.append(f"{f'[{s.out_features} x {s.in_features}] x{s.count}':<28}{m:>6}"
                         + "".join(f"{'n/a' if v is None else f'{v:.1f}':>14}" for v in vals))
    lines.append("---- one decode step of M tokens through all linear layers + LM head: tokens/s ----")
    for m in result.rows:
        cells = []
        for b in names:
            sec = result.step_seconds(m, b)
            cells.append("n/a" if sec is None else f"{m / sec:.1f}")
        lines.append(f"{'step':<28}{m:>6}" + "".join(f"{c:>14}" for c in cells))
    small = [m for m in result.rows if m <= 8]
    if small:
        bw = result.bandwidth
        ref = bw["copy_gb_per_s"] if bw else None
        head = "" if bw is None else (f" (STREAM-like copy {bw['copy_gb_per_s']:.1f} GB/s, "
                                      f"read-only sum {bw['read_gb_per_s']:.1f} GB/s)")
        lines.append(f"---- weight GB/s at M <= 8 (bytes of the weight per call / time){head} ----")
        lines.append(f"{'shape [out x in] x count':<28}{'M':>6}" + "".join(f"{b:>14}" for b in names))
        for s in result.shapes:
            for m in small:
                vals = [result.gb_per_s(s.out_features, s.in_features, m, b) for b in names]
                lines.append(f"{f'[{s.out_features} x {s.in_features}] x{s.count}':<28}{m:>6}"
                             + "".join(f"{'n/a' if v is None else f'{v:.1f}':>14}" for v in vals))
        if ref:
            lines.append(f"(as a fraction of the copy bandwidth: divide by {ref:.1f})")
    elif result.bandwidth:
        bw = result.bandwidth
        lines.append(f"memory: STREAM-like copy {bw['copy_gb_per_s']:.1f} GB/s, read-only sum "
                     f"{bw['read_gb_per_s']:.1f} GB/s")
    for b, why in result.skipped.items():
        lines.append(f"skipped {b}: {why}")
    if result.mlp_block:
        lines.append("---- one Gemma MLP block: eager (packed oneDNN) vs torch.compile (freezing) ----")
        for r in result.mlp_block:
            lines.append(f"M={r['rows']:<5} eager {r['eager_packed_ms']:.2f} ms  compiled {r['compiled_ms']:.2f} ms  "
                         f"({(r['compiled_ms'] / r['eager_packed_ms'] - 1) * 100:+.0f}%), "
                         f"max |diff| {r['max_abs_diff']:.1e}")
    return "\n".join(lines)
