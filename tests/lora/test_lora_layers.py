"""The batched low-rank pass against a float64 hand computation: rows of three adapters (and of
none) interleaved, fused q/k/v-style slices, adapters of different ranks and targets, over the
base kernels the engine uses (plain float32, oneDNN-packed bf16, int8 weight-only); the C++ SGMV
kernel (``lora/punica.py``) against the same reference and against the torch path."""

import pytest
import torch
from cpp_build import require_built_extension
from torch import nn

from pagedllm.layers.linear import PackedLinear, onednn_linear_available
from pagedllm.layers.weight_only import INT8_WEIGHT_ONLY, make_weight_only_layer, weight_only_available
from pagedllm.lora.layers import LoRALinear, LoRAStepMapping
from pagedllm.lora.punica import choose_lora_kernel, load_lora_kernel

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
    # The C++ kernel on the same layer (y in the base layer's dtype, which may differ from A's).
    layer.kernel = _kernel()
    mapping.row_slots = slots.long()
    with torch.inference_mode():
        y_kernel = layer(x).double()
    assert torch.allclose(y_kernel, want, atol=tol, rtol=2e-2), (y_kernel - want).abs().max()


def _kernel():
    return require_built_extension(load_lora_kernel, "the LoRA SGMV kernel (the torch path would run instead)")


# A layer of three output slices whose widths and input are not multiples of the vector width.
K_IN, K_SLICES, K_SLOTS, K_RMAX = 72, [48, 16, 20], 4, 16
# slot -> (rank, targeted slices); slot 3 holds nothing.
K_ADAPTERS = {0: (16, (0, 1, 2)), 1: (5, (0, 2)), 2: (3, (1,))}


def _kernel_layer(dtype):
    """A float32 / bf16 ``LoRALinear`` over an ``nn.Linear`` with ``K_ADAPTERS`` in its slots, and
    slot -> {slice: (A [r, in], B [out_j, r])} in ``dtype``."""
    gen = torch.Generator().manual_seed(2)
    base = nn.Linear(K_IN, sum(K_SLICES), bias=False)
    base.weight.data.copy_(torch.randn(sum(K_SLICES), K_IN, generator=gen) / 8)
    base = base.to(dtype)
    layer = LoRALinear(base, K_SLICES, K_SLOTS, K_RMAX, dtype, torch.device("cpu"), LoRAStepMapping())
    weights = {}
    for slot, (r, targets) in K_ADAPTERS.items():
        weights[slot] = {j: ((torch.randn(r, K_IN, generator=gen) / 4).to(dtype),
                             (torch.randn(K_SLICES[j], r, generator=gen) / 2).to(dtype)) for j in targets}
        layer.set_slot(slot, r, weights[slot])
    return layer, weights


def _reference_delta(x, row_slots, weights):
    """[T, out] float64: each row's x A^T B^T through its own adapter's targeted slices."""
    starts = [sum(K_SLICES[:j]) for j in range(len(K_SLICES))]
    delta = torch.zeros(x.shape[0], sum(K_SLICES), dtype=torch.float64)
    for t, s in enumerate(row_slots.tolist()):
        for j, (a, b) in weights.get(s, {}).items():
            delta[t, starts[j]:starts[j] + K_SLICES[j]] = (x[t].double() @ a.double().t()) @ b.double().t()
    return delta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_sgmv_kernel_equals_float64_reference_and_torch_path(dtype, rows):
    kernel = _kernel()
    layer, weights = _kernel_layer(dtype)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, K_IN, generator=gen).to(dtype)
    row_slots = torch.randint(-1, K_SLOTS, (rows,), generator=gen)   # -1: no adapter; slot 3: empty
    if rows == 1:
        row_slots[0] = 0
    with torch.inference_mode():
        y_base = layer.base(x)
        layer.kernel, layer.mapping.row_slots = kernel, row_slots
        y_kernel = layer(x)
        layer.kernel = None   # the torch fallback path on the same slots
        layer.mapping.groups = [(s, torch.nonzero(row_slots == s).flatten()) for s in range(K_SLOTS)]
        layer.mapping.row_mask = (row_slots[:, None] == torch.arange(K_SLOTS)[None]).to(dtype)[:, :, None, None]
        y_torch = layer(x)
    want = y_base.double() + _reference_delta(x, row_slots, weights)
    # float32: float32 sums; bfloat16: one rounding of y (plus the torch path's bf16 h).
    atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (2e-2, 1e-2)
    assert torch.allclose(y_kernel.double(), want, atol=atol, rtol=rtol), (y_kernel.double() - want).abs().max()
    assert torch.allclose(y_kernel.double(), y_torch.double(), atol=2 * atol, rtol=4 * rtol)
    no_adapter = (row_slots == -1) | (row_slots == 3)
    assert torch.equal(y_kernel[no_adapter], y_base[no_adapter])   # rows of no adapter untouched
    assert (y_kernel.double() - y_base.double())[~no_adapter].abs().max() > 0.5


def test_sgmv_kernel_after_clear_slot_and_on_strided_rows():
    kernel = _kernel()
    layer, weights = _kernel_layer(torch.float32)
    layer.clear_slot(0)
    x = torch.randn(16, 2 * K_IN)[:, :K_IN]            # rows strided: a view of a wider tensor
    row_slots = torch.tensor([0, 1, 2, -1] * 4)
    layer.kernel, layer.mapping.row_slots = kernel, row_slots
    with torch.inference_mode():
        delta = layer(x) - layer.base(x)
    assert torch.allclose(delta.double(), _reference_delta(x, row_slots, {1: weights[1], 2: weights[2]}), atol=1e-4)


def test_sgmv_kernel_rejects_what_it_cannot_run():
    kernel = _kernel()
    layer, _ = _kernel_layer(torch.float32)
    x, y = torch.randn(3, K_IN), torch.zeros(3, sum(K_SLICES))
    with pytest.raises(RuntimeError, match="outside"):
        kernel.sgmv_add_(y, x, layer.lora_a, layer.lora_b, layer.slice_ranks, torch.tensor([0, 4, 1]))
    with pytest.raises(RuntimeError, match="row_slots"):
        kernel.sgmv_add_(y, x, layer.lora_a, layer.lora_b, layer.slice_ranks, torch.tensor([0, 1]))
    assert choose_lora_kernel(torch.device("cuda"), torch.float32)[0] is None   # no CUDA tensor reaches it
    assert choose_lora_kernel(torch.device("cpu"), torch.float16)[0] is None
