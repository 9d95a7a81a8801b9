"""Batch invariance of the linear layers the engine packs (``pack_linear_layers``: the kernel it
picks here for each dtype): row r's output computed alone is the same bits (``torch.equal``) as
inside every batch of M = 2..40 rows, and of a prefill-sized 300, at the default model's shapes
(Gemma 3 270M: hidden 640, q/k/v 1536, o 1024, gate/up 4096, down 2048). bfloat16 runs our
AMX GEMM on AMX CPUs, our AVX-512 BF16 GEMM on other ``avx512_bf16`` CPUs and our AVX2 bf16 GEMM on
AVX2 + FMA CPUs without either; float32 runs our float32 GEMM, or oneDNN, whose one-row call is made
a two-row one (``PackedLinear``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.layers.amx_gemm import AMX_KERNEL
from pagedllm.layers.bf16_gemm import AVX2_KERNEL, BF16_GEMM_FLAGS, ONEDNN_KERNEL, Bf16Linear, bf16_kernel_for
from pagedllm.layers.linear import KernelLinear, onednn_linear_available, pack_linear_layers
from pagedllm.platforms.cpu import cpu_flags

# (in_features, out_features) of the default model's linear layers.
SHAPES = [(640, 1536), (1024, 640), (640, 4096), (2048, 640)]
ROW_COUNTS = list(range(2, 41)) + [300]


class Layers(nn.Module):
    """One ``nn.Linear`` per shape, for ``pack_linear_layers`` to replace (no tied head)."""

    tie_word_embeddings = False

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(k, n, bias=False) for k, n in SHAPES)

    def get_lm_head(self):
        return None


def packed_layers(dtype: torch.dtype) -> list[KernelLinear]:
    ours = dtype == torch.bfloat16 and bf16_kernel_for("auto")[0] != ONEDNN_KERNEL
    if not onednn_linear_available(dtype) and not ours:
        pytest.skip(f"neither oneDNN nor a GEMM of ours packs {dtype} here (bf16 needs avx2 + fma, avx512_bf16 "
                    "or amx_bf16)")
    torch.manual_seed(0)
    model = Layers()
    with torch.no_grad():
        for layer in model.layers:
            layer.weight.normal_(0, 0.05)
    model = model.to(dtype)
    pack_linear_layers(model, dtype, torch.device("cpu"), batch_hint=64)
    assert all(isinstance(layer, KernelLinear) for layer in model.layers)
    return list(model.layers)


def check_rows(layer: KernelLinear, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(max(ROW_COUNTS), layer.in_features, generator=gen).to(dtype)
    with torch.no_grad():
        alone = torch.cat([layer(x[r:r + 1]) for r in range(40)])
        for m in ROW_COUNTS:
            y = layer(x[:m])
            bad = [r for r in range(min(m, 40)) if not torch.equal(y[r], alone[r])]
            assert not bad, f"{type(layer).__name__} {layer.in_features}->{layer.out_features}, M={m}: rows {bad}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_packed_rows_do_not_depend_on_the_batch(dtype):
    layers = packed_layers(dtype)
    if dtype == torch.bfloat16 and (not [f for f in BF16_GEMM_FLAGS if f not in cpu_flags()]
                                    or bf16_kernel_for("auto")[0] == AVX2_KERNEL):
        assert all(isinstance(layer, Bf16Linear) for layer in layers)   # the invariant kernel runs
    for layer in layers:
        check_rows(layer, dtype)


@pytest.mark.skipif("amx_bf16" not in cpu_flags(), reason="CPU lacks amx_bf16 (the AMX chooser path)")
def test_amx_cpus_run_the_invariant_bf16_kernel():
    """On AMX the chooser sends bf16 to our AMX GEMM (oneDNN's tile kernels change with the batch)."""
    kernel, why = bf16_kernel_for("auto")
    assert kernel == AMX_KERNEL, why
    layers = packed_layers(torch.bfloat16)
    assert all(isinstance(layer, Bf16Linear) and AMX_KERNEL in layer._ext.compiled_isas() for layer in layers)
