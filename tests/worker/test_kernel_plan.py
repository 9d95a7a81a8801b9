"""The kernel plan (pagedllm/worker/kernel_plan.py): each row is its chooser's answer, the table has
one aligned line per decision, and the engine logs it once."""

from __future__ import annotations

import logging
import re

import torch

from pagedllm.attention.backends import prepare_backend
from pagedllm.config import KernelConfig, ModelConfig
from pagedllm.distributed.parallel_state import ParallelContext
from pagedllm.layers.fused_ops import prepare_fused_ops
from pagedllm.layers.linear import packed_kernel_for
from pagedllm.sample.greedy_head import GREEDY_HEAD_MAX_ROWS, choose_greedy_head, greedy_head_max_rows
from pagedllm.worker.kernel_plan import LinearKernel, choose_dtype, choose_kernel_plan

CPU = torch.device("cpu")
AVX2_ONLY = frozenset("fpu sse2 avx avx2 fma bmi2".split())   # no native bf16


def test_rows_are_the_choosers_answers():
    config, kernels = ModelConfig(dtype="float32"), KernelConfig()
    plan = choose_kernel_plan(config, kernels, CPU, ParallelContext())
    assert (plan.dtype, plan.dtype_reason) == choose_dtype("float32", config, CPU)
    kind, why = packed_kernel_for(torch.float32, CPU, kernels.cpu_gemm, kernels.cpu_isa)
    assert (plan.linear, plan.linear_reason) == (LinearKernel(kind), why)
    head, why = choose_greedy_head(kernels.exact_greedy_head, torch.float32, CPU, 1, None)
    assert (plan.greedy_head, plan.greedy_head_reason) == (head, why)
    assert plan.greedy_head_max_rows == GREEDY_HEAD_MAX_ROWS.get(head, 0)
    assert (plan.attention_backend, plan.attention_reason) == prepare_backend("auto", CPU, torch.float32)
    assert (plan.fused_ops, plan.fused_ops_reason) == prepare_fused_ops("auto", CPU, torch.float32)
    assert plan.warnings == ()


def test_bf16_plan_passes_the_head_kernel_and_the_logit_edits():
    """A bfloat16 model's greedy head row: the chooser's answer for the plan's linear kind (the
    head's kernel) and hidden size, off when the model edits its logits after the head."""
    kernels = KernelConfig()
    plain = ModelConfig(dtype="bfloat16", hidden_size=640)
    plan = choose_kernel_plan(plain, kernels, CPU, ParallelContext())
    want = choose_greedy_head("auto", plan.dtype, CPU, 1, None, hidden_size=640, linear_kind=plan.linear.kind)
    assert (plan.greedy_head, plan.greedy_head_reason) == want
    assert plan.greedy_head_max_rows == greedy_head_max_rows(want[0], torch.bfloat16)
    for edit in (dict(final_logit_softcapping=30.0), dict(logits_scaling=8.0)):
        edited = choose_kernel_plan(ModelConfig(dtype="bfloat16", hidden_size=640, **edit), kernels, CPU,
                                    ParallelContext())
        assert edited.greedy_head is None and edited.greedy_head_max_rows == 0
        if plan.greedy_head is not None:   # the edit is what turned it off
            assert "edits its logits" in edited.greedy_head_reason


def test_packed_is_every_packed_kernel_for_kind_but_torch():
    """``LinearKernel.packed`` (the worker's memory accounting of an untied head) covers what
    ``packed_kernel_for`` can answer, forced kernels included, and no quantized kind."""
    kinds = {packed_kernel_for(dtype, CPU, cpu_gemm, cpu_isa, cpu_bf16_gemm=bf16, cpu_f32_gemm=f32)[0]
             for dtype in (torch.float32, torch.bfloat16) for cpu_gemm in ("onednn", "torch")
             for cpu_isa in ("auto", "portable") for bf16 in ("auto", "onednn") for f32 in ("auto", "onednn")}
    assert "torch" in kinds and "onednn" in kinds
    assert all(LinearKernel(k).packed == (k != "torch") for k in kinds)
    assert not any(LinearKernel(k).packed for k in ("int8", "int8_weight_only", "int4_weight_only"))


def test_table_has_one_aligned_row_per_decision():
    plan = choose_kernel_plan(ModelConfig(dtype="float32", quantization="int8"), KernelConfig(cpu_fused_ops="off"),
                              CPU, ParallelContext())
    lines = plan.table().split("\n")
    assert lines[0] == "Kernel plan:"
    rows = [re.fullmatch(r"  (\S.*?) {2,}(\S.*?) {2,}\((.*)\)", line) for line in lines[1:]]
    assert all(rows), lines
    assert [m.group(1) for m in rows] == ["dtype", "linear layers", "exact greedy head", "attention backend",
                                          "fused CPU ops"]
    assert len({m.start(2) for m in rows}) == 1 and len({m.start(3) for m in rows}) == 1   # aligned columns
    assert [m.group(2) for m in rows] == ["float32", "int8 W8A8 (fbgemm)", "off", plan.attention_backend,
                                          "off, eager torch ops"]
    assert rows[1].group(3) == "quantization='int8'" and rows[4].group(3) == "cpu_fused_ops='off'"


def test_flags_choose_and_bf16_without_native_warns():
    """The CPU's flags are the plan's: without avx512_bf16 / AMX "auto" is float32, and an asked
    bfloat16 runs its linear layers on the AVX2 bf16 GEMM (no warning), or, with them forced to
    oneDNN / F.linear, with a warning that float32 is faster."""
    auto = choose_kernel_plan(ModelConfig(), KernelConfig(), CPU, ParallelContext(), flags=AVX2_ONLY)
    assert auto.dtype == torch.float32 and auto.warnings == ()
    forced = choose_kernel_plan(ModelConfig(dtype="bfloat16"), KernelConfig(), CPU, ParallelContext(),
                                flags=AVX2_ONLY)
    assert forced.dtype == torch.bfloat16 and forced.greedy_head is None
    assert forced.linear.kind != "avx512_bf16"   # the AVX-512 bf16 GEMM needs the avx512_bf16 flags
    if forced.linear.kind == "avx2_bf16":        # where the AVX2 GEMM builds (tests/layers/test_bf16_gemm_avx2.py)
        assert forced.warnings == ()
    else:
        assert len(forced.warnings) == 1 and "--dtype float32 is faster" in forced.warnings[0]
    slow = choose_kernel_plan(ModelConfig(dtype="bfloat16"), KernelConfig(cpu_bf16_gemm="onednn"), CPU,
                              ParallelContext(), flags=AVX2_ONLY)
    assert len(slow.warnings) == 1 and "--dtype float32 is faster" in slow.warnings[0]


def test_engine_logs_the_plan_once(make_tiny_checkpoint, caplog):
    from pagedllm import LLM

    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(make_tiny_checkpoint("llama"), dtype="float32", max_model_len=64, kv_cache_memory_bytes=8 << 20)
        worker = llm.llm_engine.executor.driver_worker
        worker.reload_weights()   # applies the same plan without choosing or logging it again
    assert caplog.text.count("Kernel plan:") == 1
    assert worker.kernel_plan.table() in caplog.text
    assert (worker.greedy_head is None) == (worker.kernel_plan.greedy_head is None)


def test_attention_fused_ops_and_linear_choices_run_at_once(monkeypatch):
    """On a first start each chooser compiles its C++ kernels (20-40 s each): attention's, the fused
    ops' and the linear layers' choices run in three threads at once. Each stand-in below waits for
    the other two at a barrier, which only a concurrent run passes (one after the other, the first
    would time out), then answers as the real chooser does."""
    import threading

    import pagedllm.attention.backends as backends
    import pagedllm.layers.fused_ops as fused_ops
    import pagedllm.worker.kernel_plan as kernel_plan

    barrier = threading.Barrier(3, timeout=30)
    threads = []

    def meeting(real):
        def chooser(*args, **kwargs):
            threads.append(threading.current_thread().name)
            barrier.wait()
            return real(*args, **kwargs)
        return chooser

    monkeypatch.setattr(backends, "prepare_backend", meeting(prepare_backend))
    monkeypatch.setattr(fused_ops, "prepare_fused_ops", meeting(prepare_fused_ops))
    monkeypatch.setattr(kernel_plan, "choose_linear", meeting(kernel_plan.choose_linear))
    plan = choose_kernel_plan(ModelConfig(dtype="float32"), KernelConfig(), CPU, ParallelContext())
    assert len(set(threads)) == 3
    assert (plan.attention_backend, plan.attention_reason) == prepare_backend("auto", CPU, torch.float32)
    assert (plan.fused_ops, plan.fused_ops_reason) == prepare_fused_ops("auto", CPU, torch.float32)
