"""The batched low-rank pass against a float64 hand computation: rows of three adapters (and of
none) interleaved, fused q/k/v-style slices, adapters of different ranks and targets, over the
base kernels the engine uses (plain float32, oneDNN-packed bf16, int8 weight-only)."""

import pytest
import torch
from torch import nn

from pagedllm.layers.linear import PackedLinear, onednn_linear_available
from pagedllm.layers.weight_only import INT8_WEIGHT_ONLY, make_weight_only_layer, weight_only_available
from pagedllm.lora.layers import LoRALinear, LoRAStepMapping

IN, SLICES, R_MAX = 64, [32, 16, 16], 8


def _base(kind):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(sum(SLICES), IN, generator=gen) / 8
    if kind == "float32":
        layer = nn.Linear(IN, sum(SLICES), bias=False)
        layer.weight.data.copy_(w)
        return layer, torch.float32
    if kind == "bf16-onednn":
        if not onednn_linear_available(torch.bfloat16):
            pytest.skip("oneDNN bf16 inner product needs avx512_bf16 or AMX")
        return PackedLinear(w.bfloat16(), None, 8), torch.bfloat16
    if not weight_only_available(INT8_WEIGHT_ONLY):
        pytest.skip("int8 weight-only kernel unavailable on this CPU")
    return make_weight_only_layer(INT8_WEIGHT_ONLY, w, None, torch.bfloat16), torch.float32


@pytest.mark.parametrize("kind", ["float32", "bf16-onednn", "int8-weight-only"])
def test_mixed_rows_equal_the_hand_computed_deltas(kind):
    base, dtype = _base(kind)
    mapping = LoRAStepMapping()
    layer = LoRALinear(base, SLICES, max_loras=3, max_rank=R_MAX, dtype=dtype, device=torch.device("cpu"),
                       mapping=mapping)
    gen = torch.Generator().manual_seed(1)
    # slot -> (rank, {slice: (A [r, in], B [out_j, r])}): all slices / the first and last / none.
    adapters = {0: (8, {0: None, 1: None, 2: None}), 1: (4, {0: None, 2: None}), 2: (2, {1: None})}
    for slot, (r, parts) in adapters.items():
        for j in parts:
            parts[j] = (torch.randn(r, IN, generator=gen), torch.randn(SLICES[j], r, generator=gen))
        layer.set_slot(slot, r, {j: (a.to(dtype), b.to(dtype)) for j, (a, b) in parts.items()})
    row_slots = [0, 0, -1, 1, 2, 2, 0, -1, 1]
    x = torch.randn(len(row_slots), IN, generator=gen).to(dtype)
    slots = torch.tensor(row_slots)
    mapping.groups = [(s, torch.nonzero(slots == s).flatten()) for s in (0, 1, 2)]
    with torch.inference_mode():
        y = layer(x).double()
        y_base = base(x).double()
    want = y_base.clone()
    starts = [0, 32, 48]
    for i, s in enumerate(row_slots):
        if s < 0:
            continue
        r, parts = adapters[s]
        for j, (a, b) in parts.items():
            want[i, starts[j]:starts[j] + SLICES[j]] += (x[i].double() @ a.to(dtype).double().t()) @ b.to(dtype).double().t()
    tol = 1e-4 if dtype == torch.float32 and kind == "float32" else 0.1
    assert torch.allclose(y, want, atol=tol, rtol=2e-2), (y - want).abs().max()
    assert (y - y_base).abs().max() > 1.0   # the deltas are there
    # The engine's mixed pass (one shrink and one expand per slice over all slots, masked per row).
    mapping.row_mask = (slots[:, None] == torch.arange(3)[None]).to(dtype)[:, :, None, None]
    with torch.inference_mode():
        y_mixed = layer(x).double()
    assert torch.allclose(y_mixed, want, atol=tol, rtol=2e-2), (y_mixed - want).abs().max()
    mapping.row_mask = None
    # One adapter for every row: the same values without the row gather.
    mapping.groups = [(1, None)]
    with torch.inference_mode():
        y1 = layer(x).double()
    mapping.groups = [(1, torch.arange(len(row_slots)))]
    with torch.inference_mode():
        y1_gathered = layer(x).double()
    assert torch.allclose(y1, y1_gathered, atol=1e-5)
