"""The kernel plan: the dtype and the kernels a worker runs, chosen once from the model's config, the
kernel settings (``config.KernelConfig``) and the CPU's flags, logged once as a table, then applied
by the worker.

One row per decision, each from a chooser that returns ``(choice, reason)`` and logs nothing:

- dtype: ``choose_dtype`` (here): ``"auto"`` is bfloat16 on a CPU that multiplies it natively.
- linear layers (the LM head's included): ``choose_linear`` (here): the quantization's layers
  (``layers/quantization.py``; ``layers/weight_only.py`` with ``layers.int8_gemm.int8_kernel_for``),
  else ``layers.linear.packed_kernel_for`` (oneDNN, our bf16 GEMM, or ``F.linear``).
- exact greedy head: ``sample.greedy_head.choose_greedy_head``.
- attention backend: ``attention.backends.prepare_backend`` (builds the C++ kernel on a first start).
- fused CPU ops: ``layers.fused_ops.prepare_fused_ops`` (likewise).

The worker logs ``KernelPlan.table()`` at INFO, for example::

    Kernel plan:
      dtype              float32                     (asked for (dtype='float32'))
      linear layers      oneDNN packed               (float32: oneDNN's packed inner product)
      exact greedy head  int8_vnni, up to 1024 rows  (float32 model, AVX-512 VNNI: int8 cheap pass)
      attention backend  cpu_paged                   (the default on the CPU: the C++ paged-attention kernel; ...)
      fused CPU ops      on                          (avx512 code for float32)
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.config import KernelConfig, ModelConfig
from pagedllm.distributed.parallel_state import ParallelContext

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}

# ``LinearKernel.kind`` values, in words for the table.
_LINEAR_WORDS = {"torch": "torch F.linear", "onednn": "oneDNN packed", "avx512_bf16": "bf16 GEMM (avx512_bf16)",
                 "amx_bf16": "bf16 GEMM (AMX tiles)", "avx2_bf16": "bf16 GEMM (AVX2 + FMA)", "f32_gemm": "float32 GEMM (ours)",
                 "int8": "int8 W8A8 (fbgemm)"}
# The kinds whose layers ``pack_linear_layers`` replaces by a packed copy (``LinearKernel.packed``).
_PACKED_KINDS = ("onednn", "avx512_bf16", "amx_bf16", "avx2_bf16", "f32_gemm")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def choose_dtype(dtype: str, model_config: ModelConfig | dict, device: torch.device, cpu_isa: str = "auto",
                 flags: frozenset[str] | None = None) -> tuple[torch.dtype, str]:
    """The model dtype, and why. ``"auto"``: on the CPU, bfloat16 where the CPU multiplies it
    natively (``avx512_bf16`` or AMX, and ``KernelConfig.cpu_isa`` does not force a path without
    them), else float32 (float32 with ``quantization="int8"``, whose layers take float32
    activations); on CUDA, the checkpoint's ``dtype`` / ``torch_dtype``
    (``ModelConfig.checkpoint_dtype``; float32 -> bfloat16 not applied).

    Args:
        dtype: the asked dtype name.
        model_config: the model's config (or its config.json dict).
        device: where the model runs.
        cpu_isa: ``KernelConfig.cpu_isa`` (a forced path without native bf16 makes "auto" float32).
        flags: the CPU's flags (default: this machine's).
    Raises:
        ValueError: as ``platforms.cpu.native_bf16`` (a forced ``cpu_isa`` this CPU lacks).
    """
    from pagedllm.platforms.cpu import native_bf16

    if dtype == "auto" and not isinstance(model_config, dict) and model_config.quantization == "int8":
        return torch.float32, "auto with quantization='int8' (its layers take float32 activations)"
    if dtype != "auto":
        return _DTYPES[dtype], f"asked for (dtype={dtype!r})"
    if device.type == "cpu":
        bf16, why = native_bf16(cpu_isa, flags)
        return (torch.bfloat16 if bf16 else torch.float32), f"auto on the CPU: {why}"
    if isinstance(model_config, dict):
        name = model_config.get("dtype") or model_config.get("torch_dtype")
    else:
        name = model_config.checkpoint_dtype
    return _DTYPES.get(str(name or "bfloat16").replace("torch.", ""), torch.bfloat16), \
        f"auto on {device.type}: the checkpoint's dtype ({name or 'not set: bfloat16'})"


@dataclass(frozen=True)
class LinearKernel:
    """How a model's linear layers and LM head run (``choose_linear``).

    Attributes:
        kind: "torch" (``F.linear``: the layers stay ``nn.Linear``), "onednn" (``PackedLinear``),
            "avx512_bf16" / "amx_bf16" / "avx2_bf16" (``layers.bf16_gemm.Bf16Linear``), "f32_gemm"
            (``layers.f32_gemm.F32Linear``), "int8" (``Int8DynamicLinear``), or
            "int8_weight_only" / "int4_weight_only" (``layers/weight_only.py``).
        int8_kernel: the weight-only layers' int8 kernel ("vnni" or "torch", ``layers/int8_gemm.py``;
            int4's LM head is int8); None for the other kinds.
    """

    kind: str
    int8_kernel: str | None = None

    @property
    def packed(self) -> bool:
        """Whether ``pack_linear_layers`` replaces the layers (and an untied LM head) by a packed
        copy of their weight: every kind ``layers.linear.packed_kernel_for`` returns but "torch"."""
        return self.kind in _PACKED_KINDS

    def describe(self) -> str:
        """The kind in words, for the table."""
        if self.int8_kernel is not None:
            return f"{self.kind} ({self.int8_kernel} int8 kernel)"
        return _LINEAR_WORDS.get(self.kind, self.kind)


def choose_linear(model_config: ModelConfig, kernel_config: KernelConfig, dtype: torch.dtype, device: torch.device,
                  flags: frozenset[str] | None = None) -> tuple[LinearKernel, str]:
    """How ``model_config``'s linear layers run in ``dtype`` on ``device`` with ``kernel_config``'s
    kernels, and why.

    Raises:
        ValueError: for a bad ``cpu_gemm`` / ``cpu_bf16_gemm``, or a forced ``cpu_isa`` the CPU lacks.
    """
    from pagedllm.layers.int8_gemm import int8_kernel_for
    from pagedllm.layers.linear import packed_kernel_for
    from pagedllm.layers.weight_only import WEIGHT_ONLY_MODES

    quant = model_config.quantization
    if quant == "int8":
        return LinearKernel("int8"), "quantization='int8'"
    if quant in WEIGHT_ONLY_MODES:
        kernel, why = int8_kernel_for(kernel_config.cpu_isa, flags)
        return LinearKernel(quant, kernel), f"quantization={quant!r}; int8 kernel: {why}"
    kind, why = packed_kernel_for(dtype, device, kernel_config.cpu_gemm, kernel_config.cpu_isa, flags,
                                  kernel_config.cpu_bf16_gemm, kernel_config.cpu_f32_gemm)
    return LinearKernel(kind), why


def apply_linear(model: nn.Module, linear: LinearKernel, dtype: torch.dtype, device: torch.device,
                 batch_hint: int) -> int:
    """Move ``model``'s linear layers into ``linear``'s layouts (after loading).

    Args:
        batch_hint: rows oneDNN's layout is tuned for (``max_num_seqs``).
    Returns:
        Bytes added (negative when quantization saved memory).
    Raises:
        ValueError: as ``quantize_linear_layers`` / ``quantize_weight_only`` (a model they cannot take).
    """
    if linear.kind == "int8":
        from pagedllm.layers.quantization import quantize_linear_layers

        return quantize_linear_layers(model)
    if linear.int8_kernel is not None:
        from pagedllm.layers.weight_only import quantize_weight_only

        return quantize_weight_only(model, linear.kind, int8_kernel=linear.int8_kernel)
    from pagedllm.layers.linear import pack_linear_layers

    return pack_linear_layers(model, dtype, device, batch_hint, kernel=linear.kind)


@dataclass(frozen=True)
class KernelPlan:
    """What a worker runs (``choose_kernel_plan``), each decision with its reason.

    Attributes:
        dtype: the model dtype.
        linear: the linear layers' kernel (the LM head's included).
        greedy_head: the exact greedy head's cheap pass ("bf16", "int8", "int8_vnni", "int8_avx2"), or None (off).
        greedy_head_max_rows: the most plain greedy rows per step it is used for (0 when off).
        attention_backend: "torch_ref", "cpu_sdpa" or "cpu_paged".
        fused_ops: whether the layers run the fused CPU ops.
        *_reason: why, in words, per decision.
        warnings: lines the worker logs at WARNING after the table.
    """

    dtype: torch.dtype
    dtype_reason: str
    linear: LinearKernel
    linear_reason: str
    greedy_head: str | None
    greedy_head_max_rows: int
    greedy_head_reason: str
    attention_backend: str
    attention_reason: str
    fused_ops: bool
    fused_ops_reason: str
    warnings: tuple[str, ...] = ()

    def rows(self) -> list[tuple[str, str, str]]:
        """(decision, choice, reason) per row, in the table's order."""
        head = f"{self.greedy_head}, up to {self.greedy_head_max_rows} rows" if self.greedy_head else "off"
        return [("dtype", _dtype_name(self.dtype), self.dtype_reason),
                ("linear layers", self.linear.describe(), self.linear_reason),
                ("exact greedy head", head, self.greedy_head_reason),
                ("attention backend", self.attention_backend, self.attention_reason),
                ("fused CPU ops", "on" if self.fused_ops else "off, eager torch ops", self.fused_ops_reason)]

    def table(self) -> str:
        """``"Kernel plan:"`` and one aligned line per row: decision, choice, (reason)."""
        rows = self.rows()
        w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
        return "\n".join(["Kernel plan:", *(f"  {d:<{w0}}  {c:<{w1}}  ({why})" for d, c, why in rows)])


def logits_edit(model_config: ModelConfig) -> str | None:
    """What the model's ``compute_logits`` does to the LM head's output, in words, or None (the
    head's logits as they are): Gemma 2's final soft cap, Granite's logit scaling."""
    if model_config.final_logit_softcapping:
        return f"final logit soft cap {model_config.final_logit_softcapping}"
    if model_config.logits_scaling != 1.0:
        return f"logits divided by {model_config.logits_scaling}"
    return None


def choose_kernel_plan(model_config: ModelConfig, kernel_config: KernelConfig, device: torch.device,
                       parallel: ParallelContext, flags: frozenset[str] | None = None) -> KernelPlan:
    """Every decision of ``KernelPlan`` from the model's config (dtype, quantization), the kernel
    settings, where this rank sits (the exact greedy head needs one tensor rank and the last
    pipeline stage) and the CPU's flags. Builds the C++ kernels that will run (attention, fused
    ops, the bf16 / int8 GEMMs) on a first start: attention's, the fused ops' and the GEMMs' at
    once, each in its own thread (its compiler in its own process).

    Args:
        kernel_config: ``attention_backend``, ``cpu_gemm``, ``cpu_isa``, ``cpu_bf16_gemm``,
            ``cpu_fused_ops``, ``exact_greedy_head``.
        flags: the CPU's flags (default: this machine's).
    Raises:
        ValueError: a bad ``cpu_gemm`` / ``exact_greedy_head``, or a forced ``cpu_isa`` the CPU lacks.
    """
    from pagedllm.attention.backends import prepare_backend
    from pagedllm.layers.fused_ops import prepare_fused_ops
    from pagedllm.platforms.cpu import cpu_flags, native_bf16
    from pagedllm.sample.greedy_head import choose_greedy_head, greedy_head_max_rows

    flags = cpu_flags() if flags is None else flags
    kc = kernel_config
    dtype, dtype_reason = choose_dtype(model_config.dtype, model_config, device, kc.cpu_isa, flags)
    warnings = []
    # The three independent choices run at once: on a first start each compiles its C++ kernels
    # (one single-threaded compiler run of 20-40 s per extension), so their compiles overlap
    # instead of following one another. The linear layers' choice and the greedy head's (which
    # depends on it) stay in order, in this thread.
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="pagedllm-kernel-plan") as pool:
        backend_future = pool.submit(prepare_backend, kc.attention_backend, device, dtype, kc.cpu_isa, flags)
        fused_future = pool.submit(prepare_fused_ops, kc.cpu_fused_ops, device, dtype)
        linear, linear_reason = choose_linear(model_config, kc, dtype, device, flags)
        head, head_reason = choose_greedy_head(kc.exact_greedy_head, dtype, device, parallel.tp_size,
                                               model_config.quantization, parallel.is_last_stage, kc.cpu_isa, flags,
                                               hidden_size=model_config.hidden_size or None,
                                               linear_kind=linear.kind, logits_edit=logits_edit(model_config))
        backend, backend_reason = backend_future.result()
        fused, fused_reason = fused_future.result()
    if model_config.dtype != "auto" and device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) \
            and linear.kind != "avx2_bf16":
        # The CPU's own flags: a forced cpu_isa below avx512_bf16 still leaves oneDNN's bf16
        # kernels native (only the attention kernel's bf16 micro-kernels are not used). The AVX2
        # bf16 GEMM (layers/bf16_gemm.py) is the exception: bf16 linear layers without native bf16.
        native, why = native_bf16("auto", flags)
        if not native:
            warnings.append(f"{model_config.dtype} on a CPU without native bf16 ({why}): its matmuls run several "
                            "times slower than float32 here (docs/performance.md); --dtype float32 is faster")
    return KernelPlan(dtype=dtype, dtype_reason=dtype_reason, linear=linear, linear_reason=linear_reason,
                      greedy_head=head, greedy_head_max_rows=greedy_head_max_rows(head, dtype),
                      greedy_head_reason=head_reason, attention_backend=backend, attention_reason=backend_reason,
                      fused_ops=fused, fused_ops_reason=fused_reason, warnings=tuple(warnings))
