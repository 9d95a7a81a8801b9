"""``KernelConfig`` (pagedllm/config.py): the CPU-kernel settings, validated once, built by
``EngineArgs`` from its vLLM-style fields of the same names, off ``ModelConfig``."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from pagedllm.config import KernelConfig, ModelConfig, VllmConfig
from pagedllm.engine.arg_utils import EngineArgs

KERNEL_FIELDS = ("attention_backend", "cpu_gemm", "cpu_isa", "cpu_bf16_gemm", "cpu_f32_gemm", "cpu_fused_ops", "exact_greedy_head")


def test_defaults_and_fields():
    assert tuple(f.name for f in dataclasses.fields(KernelConfig)) == KERNEL_FIELDS
    assert KernelConfig() == KernelConfig(attention_backend="auto", cpu_gemm="onednn", cpu_isa="auto",
                                          cpu_bf16_gemm="auto", cpu_f32_gemm="auto", cpu_fused_ops="auto",
                                          exact_greedy_head="auto")
    assert pickle.loads(pickle.dumps(KernelConfig(cpu_isa="avx2"))) == KernelConfig(cpu_isa="avx2")


@pytest.mark.parametrize("kwargs, message", [
    (dict(cpu_isa="neon"), r"cpu_isa \(\$PAGEDLLM_CPU_ISA\) must be 'auto' or one of"),
    (dict(cpu_gemm="blas"), r"\$PAGEDLLM_CPU_GEMM"),
    (dict(attention_backend="flash"), r"attention_backend \(\$PAGEDLLM_ATTENTION_BACKEND\) must be one of"),
    (dict(cpu_bf16_gemm="mkl"), r"cpu_bf16_gemm \(\$PAGEDLLM_CPU_BF16_GEMM\) must be one of"),
    (dict(cpu_f32_gemm="mkl"), r"cpu_f32_gemm \(\$PAGEDLLM_CPU_F32_GEMM\) must be one of"),
    (dict(cpu_fused_ops="on"), r"cpu_fused_ops must be one of"),
    (dict(exact_greedy_head="on"), r"exact_greedy_head must be one of"),
])
def test_bad_values_raise_naming_the_setting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KernelConfig(**kwargs)


def test_model_config_no_longer_has_the_kernel_settings():
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    assert not names & set(KERNEL_FIELDS)
    with pytest.raises(TypeError):
        ModelConfig(cpu_isa="avx2")


def test_engine_args_build_the_kernel_config():
    args = EngineArgs(attention_backend="cpu_sdpa", cpu_gemm="torch", cpu_isa="portable", cpu_bf16_gemm="onednn",
                      cpu_fused_ops="off", exact_greedy_head="off")
    config = args.create_engine_config(128)
    assert isinstance(config, VllmConfig)
    assert config.kernel_config == KernelConfig(attention_backend="cpu_sdpa", cpu_gemm="torch", cpu_isa="portable",
                                                cpu_bf16_gemm="onednn", cpu_fused_ops="off",
                                                exact_greedy_head="off")
    for name in KERNEL_FIELDS:
        assert not hasattr(config.model_config, name)
    assert config.scheduler_config.max_model_len == 128


def test_engine_args_errors_name_the_env_var(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "neon")
    with pytest.raises(ValueError, match=r"\$PAGEDLLM_CPU_ISA"):
        EngineArgs().create_engine_config(128)
    monkeypatch.delenv("PAGEDLLM_CPU_ISA")
    with pytest.raises(ValueError, match=r"\$PAGEDLLM_ATTENTION_BACKEND"):
        EngineArgs(attention_backend="flash").create_engine_config(128)


def test_the_engine_and_its_worker_hold_it(make_tiny_checkpoint):
    """``LLM(..., attention_backend=...)`` (vLLM's keyword arguments) reaches the worker's kernel
    plan and the model's attention layers through ``KernelConfig``."""
    from pagedllm import LLM

    llm = LLM(make_tiny_checkpoint("llama"), dtype="float32", max_model_len=64, kv_cache_memory_bytes=8 << 20,
              attention_backend="cpu_sdpa", cpu_fused_ops="off", exact_greedy_head="off")
    engine = llm.llm_engine
    assert engine.kernel_config == engine.vllm_config.kernel_config
    assert engine.kernel_config.attention_backend == "cpu_sdpa"
    worker = engine.executor.driver_worker
    assert worker.kernel_config is engine.kernel_config
    assert worker.kernel_plan.attention_backend == "cpu_sdpa" and not worker.kernel_plan.fused_ops
    assert worker.model.kernel_config is engine.kernel_config
    assert worker.model.model.layers[0].self_attn.attn.backend == "cpu_sdpa"
    assert not worker.model.use_fused_ops


def test_create_engine_config_without_arguments_reads_the_model(make_tiny_checkpoint):
    """vLLM's ``EngineArgs(model=...).create_engine_config()`` with no arguments: the model's own
    config.json fills ``ModelConfig``, and the optional configs ride along as in vLLM's ``VllmConfig``."""
    import json
    import os

    folder = make_tiny_checkpoint("llama")
    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    config = EngineArgs(model=folder, max_model_len=64, enable_lora=True, max_loras=2).create_engine_config()
    assert config.model_config.architectures == tuple(hf["architectures"]) == ("LlamaForCausalLM",)
    assert (config.model_config.hidden_size, config.model_config.num_hidden_layers,
            config.model_config.vocab_size) == (hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"])
    assert config.scheduler_config.max_model_len == 64
    assert config.lora_config.max_loras == 2 and config.speculative_config is None
    assert config.structured_outputs_config.backend == "auto"
    assert EngineArgs(model=folder).create_engine_config().scheduler_config.max_model_len == \
        hf["max_position_embeddings"]


def test_one_spelling_for_every_setting():
    """Case and spaces are folded for every kernel setting alike (a value from an environment
    variable is often upper case), and None (vLLM's unset ``attention_backend``) is the default."""
    config = KernelConfig(attention_backend="CPU_SDPA", cpu_gemm="TORCH", cpu_isa=" AVX2 ", cpu_bf16_gemm="OneDNN",
                          cpu_fused_ops="Off", exact_greedy_head="OFF")
    assert config == KernelConfig(attention_backend="cpu_sdpa", cpu_gemm="torch", cpu_isa="avx2",
                                  cpu_bf16_gemm="onednn", cpu_fused_ops="off", exact_greedy_head="off")
    assert KernelConfig(attention_backend=None, cpu_gemm=None, cpu_isa=None) == KernelConfig()
