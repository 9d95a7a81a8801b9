"""The batched low-rank pass: LoRA deltas for a batch that mixes adapters (Punica's SGMV, Chen
et al. 2023), added to the base layer's output whatever its kernel (oneDNN, bf16 GEMM, int8).

Each adapted layer holds its adapters stacked by slot: ``lora_a`` [max_loras, n_slices, r_max,
in] (the A of each output slice) and one ``lora_b[j]`` [max_loras, r_max, out_j] per output slice
``j`` (q / k / v of ``qkv_proj``, gate / up of ``gate_up_proj``; one for ``o_proj`` /
``down_proj``; B transposed, the adapter's scale folded in), zeros past an adapter's rank and in
the slices it does not target. A step's ``LoRAStepMapping`` (built once per step by
``worker_manager.LoRAWorkerManager``) says which rows use which slot. Two ways to add the deltas,
chosen once at wrap time (``punica.choose_lora_kernel``):

- the C++ kernel (``punica.py``, Punica's SGMV): one call per layer over ``row_slots``, each row
  through its own adapter's rank and targeted slices only;
- the torch fallback (other devices and dtypes, no compiler): per slot one shrink
  ``h = x[rows] A^T`` [n, slices * r] and per slice one expand ``y[rows, slice] += h_j B_j``; a
  batch mixing slots runs one shrink and one expand per slice over all slots at once, masked per
  row. Never a loop over tokens.

Tensor parallelism (Megatron's layouts): a column-parallel layer (q/k/v, gate/up) holds this
rank's rows of B and all of A; a row-parallel one (o_proj, down_proj) this rank's columns of A
and all of B, so its partial delta joins the base layer's partial sum before the model's
all-reduce. ``layers.parallel.checkpoint_shard`` of the base weight gives both slices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

# Base-model module (fused, as the models build them) -> the Hugging Face layers in its output order.
FUSED_SLICES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
                "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


@dataclass
class LoRAStepMapping:
    """Which rows of this step's flattened batch use which slot.

    Attributes:
        groups: (slot, rows) per slot in the batch: rows a [n] int64 tensor of token indices,
            or None for every row; rows of no adapter are in no group (the torch path).
        row_mask: for a batch mixing slots (or adapter and base rows): [T, max_loras, 1, 1] in the
            adapters' dtype, 1 where row ``t`` uses slot ``s``; None when one slot has every row
            (the torch path).
        row_slots: [T] int64 on the CPU, each row's slot or -1 (no adapter); None when no row
            has an adapter (the C++ kernel's path).
    """

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    row_mask: torch.Tensor | None = None
    row_slots: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """A base linear layer plus the LoRA deltas of the step's adapters.

    Weights by slot, each slice's rows at a fixed place (zeros past an adapter's rank and in the
    slices it does not target): ``lora_a`` [max_loras, n_slices, r_max, in], ``lora_b[j]``
    [max_loras, r_max, out_j]; ``slice_ranks`` [max_loras, n_slices] int32 on the CPU, each slot's
    rank in each slice (0: not targeted).

    With ``kernel`` (``punica.py``): one ``sgmv_add_`` call per forward over
    ``LoRAStepMapping.row_slots`` (x, y on the CPU, rows contiguous). Without (the torch fallback): a batch on one slot runs that
    slot's rows only; a mixed batch runs one shrink over every slot, ``h = x A_all^T``
    [T, max_loras * n_slices * r_max], keeps each row's own slot (``LoRAStepMapping.row_mask``)
    and one expand per slice over all slots: 1 + n_slices matmuls whatever the mix (Punica's BGMV
    in dense form).

    Args:
        base: the layer (``nn.Linear``, ``MergedLinear`` or a kernel layer with ``in_features`` /
            ``out_features``), this rank's size.
        slice_sizes: widths of the output slices, in order (sum = ``base.out_features``).
        max_loras, max_rank: slots and their rank.
        dtype, device: of the adapter weights (the activations' dtype).
        mapping: the step's ``LoRAStepMapping`` (shared by every layer, owned by the manager).
        kernel: the C++ kernel module (``punica.choose_lora_kernel``), or None for the torch path.
    Shapes:
        x: [T, in_features] -> [T, out_features].
    """

    def __init__(self, base: nn.Module, slice_sizes: list[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, mapping: LoRAStepMapping,
                 kernel: ModuleType | None = None) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = int(base.in_features), int(base.out_features)
        if sum(slice_sizes) != self.out_features:
            raise RuntimeError(f"LoRA slices {slice_sizes} do not cover {self.out_features} output features")
        self.slices = [(sum(slice_sizes[:j]), n) for j, n in enumerate(slice_sizes)]
        self.max_rank, self.max_loras = max_rank, max_loras
        self.mapping = mapping
        self.kernel = kernel
        self.register_buffer("lora_a", torch.zeros(max_loras, len(slice_sizes), max_rank, self.in_features,
                                                   dtype=dtype, device=device), persistent=False)
        self.lora_b = [torch.zeros(max_loras, max_rank, n, dtype=dtype, device=device) for n in slice_sizes]
        self.slice_ranks = torch.zeros(max_loras, len(slice_sizes), dtype=torch.int32)

    def set_slot(self, slot: int, rank: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter in ``slot``: ``parts`` maps slice index -> (A [rank, in], B [out_j, rank]
        with the scale folded in), this rank's shards; slices not in ``parts`` get no delta.

        Raises:
            ValueError: if a tensor's shape does not fit the layer (the adapter is for another model).
        """
        for j, (a, b) in parts.items():
            if tuple(a.shape) != (rank, self.in_features) or tuple(b.shape) != (self.slices[j][1], rank):
                raise ValueError(f"LoRA weights A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a layer of "
                                 f"{self.in_features} -> {self.slices[j][1]} features at rank {rank}")
        self.clear_slot(slot)
        for j, (a, b) in parts.items():
            self.lora_a[slot, j, :rank].copy_(a)
            self.lora_b[j][slot, :rank].copy_(b.t())
            self.slice_ranks[slot, j] = rank

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        for b in self.lora_b:
            b[slot].zero_()
        self.slice_ranks[slot].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.kernel is not None:
            if self.mapping.row_slots is not None:
                self.kernel.sgmv_add_(y, x, self.lora_a, self.lora_b, self.slice_ranks, self.mapping.row_slots)
            return y
        mask = self.mapping.row_mask
        if mask is not None:
            return self._add_mixed(x, y, mask)
        for slot, rows in self.mapping.groups:   # one slot, every row (the manager's fast case)
            if not bool(self.slice_ranks[slot].any()):   # the slot's adapter leaves this layer alone
                continue
            xs = x if rows is None else x.index_select(0, rows)                   # [n, in]
            n, r = len(self.slices), self.max_rank
            h = xs @ self.lora_a[slot].view(n * r, self.in_features).t()           # [n, slices * r]: shrink
            for j, (start, size) in enumerate(self.slices):
                d = h[:, j * r:(j + 1) * r] @ self.lora_b[j][slot]                 # [n, out_j]: expand
                if d.dtype != y.dtype:   # a weight-only base layer answers in its compute dtype
                    d = d.to(y.dtype)
                if rows is None:
                    y[:, start:start + size] += d
                else:
                    y[:, start:start + size].index_add_(0, rows, d)
        return y

    def _add_mixed(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        T, S, r, n = x.shape[0], self.max_loras, self.max_rank, len(self.slices)
        h = x @ self.lora_a.view(S * n * r, self.in_features).t()                  # [T, S * n * r]: shrink
        h = h.view(T, S, n, r).mul_(mask)                                          # each row's own slot only
        for j, (start, size) in enumerate(self.slices):
            hj = h[:, :, j].reshape(T, S * r)                                      # [T, S * r]
            bj = self.lora_b[j].view(S * r, size)
            if y.dtype == hj.dtype:
                y[:, start:start + size].addmm_(hj, bj)                            # expand, added in place
            else:   # a weight-only base layer answers in its compute dtype
                y[:, start:start + size] += (hj @ bj).to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"slices={[n for _, n in self.slices]}, max_rank={self.max_rank}, slots={self.max_loras}"


def wrap_lora_layers(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                     device: torch.device, mapping: LoRAStepMapping,
                     kernel: ModuleType | None = None) -> dict[str, tuple[LoRALinear, int]]:
    """Wrap the model's q/k/v, o, gate/up and down layers (after their kernels replaced them);
    ``kernel``: the C++ kernel they run (``punica.choose_lora_kernel``), or None (torch).

    Returns:
        Hugging Face module name (``model.layers.0.self_attn.q_proj``) -> (the wrapper, slice index).
    """
    targets: dict[str, tuple[LoRALinear, int]] = {}
    for parent_name, parent in list(model.named_modules()):
        for child_name, hf_names in FUSED_SLICES.items():
            child = getattr(parent, child_name, None)
            if child is None or isinstance(child, LoRALinear) or not hasattr(child, "out_features"):
                continue
            if child_name == "qkv_proj":
                sizes = [parent.q_size, parent.kv_size, parent.kv_size]
            else:
                sizes = [child.out_features // len(hf_names)] * len(hf_names)
            wrapper = LoRALinear(child, sizes, max_loras, max_rank, dtype, device, mapping, kernel)
            setattr(parent, child_name, wrapper)
            for j, hf in enumerate(hf_names):
                targets[f"{parent_name}.{hf}" if parent_name else hf] = (wrapper, j)
    return targets
