"""LoRA cost per decoder layer of the default model (Gemma 3 270M: hidden 640, q 1024, k / v 256,
intermediate 2048): the time the four adapted layers (qkv, o, gate_up, down) add for a batch
whose rows cycle over 4 rank-16 adapters on all seven target modules, against those layers' base
time (oneDNN packed, as the engine runs them; ``F.linear`` where oneDNN cannot), through the
torch path (``LoRALinear._add_mixed``: padded shrink, row mask, expand per slice) and the C++
SGMV kernel (``lora/punica.py``). One thread, CPU time (``time.thread_time``), best of
``--repeats`` batches of calls, so other load on the machine disturbs it little.

    OMP_NUM_THREADS=1 python benchmarks/lora_layer.py
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

HIDDEN, Q, KV, INTER = 640, 1024, 256, 2048
# (name, in_features, output slices)
LAYERS = [("qkv_proj", HIDDEN, [Q, KV, KV]), ("o_proj", Q, [HIDDEN]),
          ("gate_up_proj", HIDDEN, [INTER, INTER]), ("down_proj", INTER, [HIDDEN])]
SLOTS, RANK = 4, 16


def _base_layer(in_features: int, out_features: int, dtype: torch.dtype, rows: int) -> nn.Module:
    from pagedllm.layers.linear import PackedLinear, onednn_linear_available

    w = torch.randn(out_features, in_features, dtype=dtype) / in_features ** 0.5
    if onednn_linear_available(dtype):
        return PackedLinear(w, None, rows)
    layer = nn.Linear(in_features, out_features, bias=False, dtype=dtype)
    layer.weight.data.copy_(w)
    return layer


def _lora_layers(dtype: torch.dtype, rows: int):
    """The four adapted layers, 4 slots filled, and the step mapping of ``rows`` mixed rows."""
    from pagedllm.lora.layers import LoRALinear, LoRAStepMapping

    row_slots = torch.arange(rows) % SLOTS
    mapping = LoRAStepMapping(row_slots=row_slots,
                              row_mask=(row_slots[:, None] == torch.arange(SLOTS)[None]).to(dtype)[:, :, None, None])
    layers = []
    for _, in_features, slices in LAYERS:
        layer = LoRALinear(_base_layer(in_features, sum(slices), dtype, rows), slices, SLOTS, RANK, dtype,
                           torch.device("cpu"), mapping)
        for slot in range(SLOTS):
            layer.set_slot(slot, RANK, {j: (torch.randn(RANK, in_features, dtype=dtype) / 8,
                                            torch.randn(n, RANK, dtype=dtype) / 8) for j, n in enumerate(slices)})
        layers.append(layer)
    return layers, mapping


def _cpu_time(fn, calls: int, repeats: int) -> float:
    """Best per-call CPU time (µs) of ``fn`` over ``repeats`` batches of ``calls``."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls)
    return best * 1e6


def measure(dtype: torch.dtype, rows: int, kernel, repeats: int) -> dict[str, float]:
    """µs per decoder layer: base layers, LoRA added by the torch path, by the C++ kernel."""
    layers, mapping = _lora_layers(dtype, rows)
    xs = [torch.randn(rows, layer.in_features, dtype=dtype) for layer in layers]
    ys = [layer.base(x) for layer, x in zip(layers, xs)]
    calls = max(3, 2000 // rows)

    def base():
        for layer, x in zip(layers, xs):
            layer.base(x)

    def torch_path():
        for layer, x, y in zip(layers, xs, ys):
            layer._add_mixed(x, y, mapping.row_mask)

    def kernel_path():
        for layer, x, y in zip(layers, xs, ys):
            kernel.sgmv_add_(y, x, layer.lora_a, layer.lora_b, layer.slice_ranks, mapping.row_slots)

    with torch.inference_mode():
        out = {"base": _cpu_time(base, calls, repeats), "torch": _cpu_time(torch_path, calls, repeats)}
        out["kernel"] = _cpu_time(kernel_path, calls, repeats) if kernel is not None else float("nan")
    return out


def main() -> None:
    from pagedllm.lora.punica import load_lora_kernel

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    kernel = load_lora_kernel()
    print("| dtype | T | base µs | torch LoRA µs (x base) | kernel LoRA µs (x base) | kernel speedup |")
    print("|---|---|---|---|---|---|")
    for name in args.dtypes:
        for rows in args.rows:
            t = measure(getattr(torch, name), rows, kernel, args.repeats)
            print(f"| {name} | {rows} | {t['base']:.0f} | {t['torch']:.0f} ({t['torch'] / t['base']:.2f}) | "
                  f"{t['kernel']:.0f} ({t['kernel'] / t['base']:.2f}) | {t['torch'] / t['kernel']:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
