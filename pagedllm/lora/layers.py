"""The batched low-rank pass: LoRA deltas for a batch that mixes adapters (Punica's SGMV, Chen
et al. 2023), added to the base layer's output whatever its kernel (oneDNN, bf16 GEMM, int8).

Each adapted layer holds its adapters stacked by slot: ``lora_a`` [max_loras, n_slices * r_max,
in] (the A of each targeted slice of the layer's output, compact: rows of the slices the slot's
adapter targets, ``r`` rows each) and one ``lora_b[j]`` [max_loras, out_j, r_max] per output slice
``j`` (q / k / v of ``qkv_proj``, gate / up of ``gate_up_proj``; one for ``o_proj`` /
``down_proj``), with the adapter's scale folded into B. A step's ``LoRAStepMapping`` (built once
per step by ``worker_manager.LoRAWorkerManager``) lists, for each slot in the batch, the rows
that use it; each layer then runs, per slot, one shrink ``h = x[rows] A^T`` [n, slices * r] and
per slice one expand ``y[rows, slice] += h_j B_j^T``: a Python loop over slots and slices (at
most ``max_loras`` x 3), never over tokens; a batch with one adapter skips the row gather.

Tensor parallelism (Megatron's layouts): a column-parallel layer (q/k/v, gate/up) holds this
rank's rows of B and all of A; a row-parallel one (o_proj, down_proj) this rank's columns of A
and all of B, so its partial delta joins the base layer's partial sum before the model's
all-reduce. ``layers.parallel.checkpoint_shard`` of the base weight gives both slices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
            or None for every row; rows of no adapter are in no group.
    """

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)


class LoRALinear(nn.Module):
    """A base linear layer plus the LoRA deltas of the step's adapters.

    Args:
        base: the layer (``nn.Linear``, ``MergedLinear`` or a kernel layer with ``in_features`` /
            ``out_features``), this rank's size.
        slice_sizes: widths of the output slices, in order (sum = ``base.out_features``).
        max_loras, max_rank: slots and their rank.
        dtype, device: of the adapter weights (the activations' dtype).
        mapping: the step's ``LoRAStepMapping`` (shared by every layer, owned by the manager).
    Shapes:
        x: [T, in_features] -> [T, out_features].
    """

    def __init__(self, base: nn.Module, slice_sizes: list[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, mapping: LoRAStepMapping) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = int(base.in_features), int(base.out_features)
        if sum(slice_sizes) != self.out_features:
            raise RuntimeError(f"LoRA slices {slice_sizes} do not cover {self.out_features} output features")
        self.slices = [(sum(slice_sizes[:j]), n) for j, n in enumerate(slice_sizes)]
        self.max_rank = max_rank
        self.mapping = mapping
        self.register_buffer("lora_a", torch.zeros(max_loras, len(slice_sizes) * max_rank, self.in_features,
                                                   dtype=dtype, device=device), persistent=False)
        self.lora_b = [torch.zeros(max_loras, n, max_rank, dtype=dtype, device=device) for n in slice_sizes]
        # slot -> (rank, slices it targets); empty: the slot's adapter leaves this layer alone.
        self.slot_slices: list[tuple[int, tuple[int, ...]]] = [(0, ())] * max_loras

    def set_slot(self, slot: int, rank: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter in ``slot``: ``parts`` maps slice index -> (A [rank, in], B [out_j, rank]
        with the scale folded in), this rank's shards; slices not in ``parts`` get no delta.

        Raises:
            ValueError: if a tensor's shape does not fit the layer (the adapter is for another model).
        """
        order = tuple(sorted(parts))
        for k, j in enumerate(order):
            a, b = parts[j]
            if tuple(a.shape) != (rank, self.in_features) or tuple(b.shape) != (self.slices[j][1], rank):
                raise ValueError(f"LoRA weights A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a layer of "
                                 f"{self.in_features} -> {self.slices[j][1]} features at rank {rank}")
            self.lora_a[slot, k * rank:(k + 1) * rank].copy_(a)
            self.lora_b[j][slot, :, :rank].copy_(b)
        self.slot_slices[slot] = (rank, order)

    def clear_slot(self, slot: int) -> None:
        self.slot_slices[slot] = (0, ())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, rows in self.mapping.groups:
            rank, order = self.slot_slices[slot]
            if not order:
                continue
            xs = x if rows is None else x.index_select(0, rows)                   # [n, in]
            h = xs @ self.lora_a[slot, :len(order) * rank].t()                     # [n, slices * r]: shrink
            for k, j in enumerate(order):
                start, size = self.slices[j]
                d = h[:, k * rank:(k + 1) * rank] @ self.lora_b[j][slot, :, :rank].t()  # [n, out_j]: expand
                if d.dtype != y.dtype:   # a weight-only base layer answers in its compute dtype
                    d = d.to(y.dtype)
                if rows is None:
                    y[:, start:start + size] += d
                else:
                    y[:, start:start + size].index_add_(0, rows, d)
        return y

    def extra_repr(self) -> str:
        return f"slices={[n for _, n in self.slices]}, max_rank={self.max_rank}, slots={len(self.slot_slices)}"


def wrap_lora_layers(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                     device: torch.device, mapping: LoRAStepMapping) -> dict[str, tuple[LoRALinear, int]]:
    """Wrap the model's q/k/v, o, gate/up and down layers (after their kernels replaced them).

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
            wrapper = LoRALinear(child, sizes, max_loras, max_rank, dtype, device, mapping)
            setattr(parent, child_name, wrapper)
            for j, hf in enumerate(hf_names):
                targets[f"{parent_name}.{hf}" if parent_name else hf] = (wrapper, j)
    return targets
