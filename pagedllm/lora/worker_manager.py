"""The worker's adapters: ``max_loras`` slots in the model's layers, an LRU host cache of
``max_cpu_loras`` loaded adapters, and each step's row -> slot mapping (``layers.py``)."""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagedllm.layers.parallel import checkpoint_shard
from pagedllm.lora.adapter import LoRAWeights, load_peft_adapter
from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.layers import LoRALinear, LoRAStepMapping, wrap_lora_layers
from pagedllm.lora.punica import choose_lora_kernel
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAWorkerManager:
    """Slots and host cache of one worker (every tensor-parallel rank holds its own shards).

    Args:
        model: the loaded model (its linear layers already in their kernels' layouts); its
            target layers are wrapped here.
        lora_config: the sizes.
        dtype, device: the activations' dtype and the model's device.
    Attributes:
        mapping: the step's rows per slot, read by every wrapped layer.
        kernel: the C++ kernel the layers run (``punica.choose_lora_kernel``), or None (torch).
        slots: lora_int_id held by each slot, or None.
    """

    def __init__(self, model: nn.Module, lora_config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.config = lora_config
        self.model = model
        self.dtype = dtype if lora_config.lora_dtype == "auto" else getattr(torch, lora_config.lora_dtype)
        self.device = device
        self.mapping = LoRAStepMapping()
        self.kernel, kernel_reason = choose_lora_kernel(device, self.dtype)
        self.targets = wrap_lora_layers(model, lora_config.max_loras, lora_config.max_lora_rank, self.dtype,
                                        device, self.mapping, self.kernel)
        self.layers: list[LoRALinear] = list({id(w): w for w, _ in self.targets.values()}.values())
        self.slots: list[int | None] = [None] * lora_config.max_loras
        self._slot_lru: OrderedDict[int, int] = OrderedDict()          # lora_int_id -> slot, oldest first
        self._host: OrderedDict[int, tuple[LoRARequest, LoRAWeights]] = OrderedDict()  # LRU host cache
        logger.info("LoRA: %d layers adapted, %d slots of rank %d (%s), %d adapters cached on the host; %s",
                    len(self.layers), lora_config.max_loras, lora_config.max_lora_rank,
                    str(self.dtype).replace("torch.", ""), lora_config.num_cpu_loras, kernel_reason)

    # -- host cache ------------------------------------------------------------------------

    def _shard(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's A / B of ``module`` (see ``layers.py``: B by output rows for column-parallel
        layers, A by input columns for row-parallel ones)."""
        ctx, config = getattr(self.model, "ctx", None), getattr(self.model, "config", None)
        shard = None if ctx is None or ctx.tp_size == 1 else checkpoint_shard(f"{module}.weight", config, ctx)
        if shard is not None:
            dim, start, length = shard
            if dim == 0:
                b = b.narrow(0, start, length)
            else:
                a = a.narrow(1, start, length)
        return a, b

    def add_lora(self, lora: LoRARequest) -> bool:
        """Load ``lora`` into the host cache (evicting the least recently used adapter not in a
        slot when full). Returns False if it was there already.

        Raises:
            ValueError: a bad adapter (``adapter.load_peft_adapter``), or one whose modules are not
                in this model.
        """
        if lora.lora_int_id in self._host:
            self._host.move_to_end(lora.lora_int_id)
            return False
        weights = load_peft_adapter(lora.lora_path, self.config.max_lora_rank)
        missing = [m for m in weights.lora_a if m not in self.targets and not self._other_stage(m)]
        if missing:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: modules not in this model: {missing[:3]}")
        for module in list(weights.lora_a):
            if module not in self.targets:   # another pipeline stage's layer
                del weights.lora_a[module], weights.lora_b[module]
                continue
            weights.lora_a[module], weights.lora_b[module] = self._shard(
                module, weights.lora_a[module], weights.lora_b[module])
        while len(self._host) >= self.config.num_cpu_loras:
            victim = next((i for i in self._host if i not in self._slot_lru), None)
            if victim is None:
                break
            del self._host[victim]
        self._host[lora.lora_int_id] = (lora, weights)
        logger.info("LoRA adapter %r (id %d, r=%d, %d modules) loaded from %s in %.3f s", lora.lora_name,
                    lora.lora_int_id, weights.config.r, len(weights.lora_a), lora.lora_path, weights.load_s)
        return True

    def _other_stage(self, module: str) -> bool:
        ctx = getattr(self.model, "ctx", None)
        parts = module.split(".")
        if ctx is None or len(parts) < 3 or parts[1] != "layers" or not parts[2].isdigit():
            return False
        return not ctx.owns_layer(int(parts[2]))

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from its slot and the host cache. Returns whether it was loaded."""
        slot = self._slot_lru.pop(lora_int_id, None)
        if slot is not None:
            self.slots[slot] = None
            for layer in self.layers:
                layer.clear_slot(slot)
        return self._host.pop(lora_int_id, None) is not None or slot is not None

    def list_loras(self) -> list[int]:
        return list(self._host)

    # -- slots -----------------------------------------------------------------------------

    def _activate(self, lora: LoRARequest, keep: set[int]) -> int:
        """The slot holding ``lora``, loading it into a free one or the least recently used slot
        whose adapter is not in ``keep`` (this step's adapters).

        Raises:
            RuntimeError: if every slot holds an adapter of this step (the scheduler admitted more
                than ``max_loras`` adapters).
        """
        lid = lora.lora_int_id
        if lid in self._slot_lru:
            self._slot_lru.move_to_end(lid)
            return self._slot_lru[lid]
        if None in self.slots:
            slot = self.slots.index(None)
        else:
            victim = next((i for i in self._slot_lru if i not in keep), None)
            if victim is None:
                raise RuntimeError(f"{len(keep)} adapters in one step for {len(self.slots)} LoRA slots")
            slot = self._slot_lru.pop(victim)
        self.add_lora(lora)
        self._host.move_to_end(lid)
        _, weights = self._host[lid]
        by_layer: dict[int, tuple[LoRALinear, dict]] = {}
        for module, a in weights.lora_a.items():
            layer, j = self.targets[module]
            by_layer.setdefault(id(layer), (layer, {}))[1][j] = (a, weights.lora_b[module])
        for layer in self.layers:
            entry = by_layer.get(id(layer))
            if entry is None:
                layer.clear_slot(slot)
            else:
                layer.set_slot(slot, weights.config.r, entry[1])
        self.slots[slot] = lid
        self._slot_lru[lid] = slot
        return slot

    def prepare(self, loras: list[LoRARequest | None], num_tokens: list[int]) -> None:
        """Set the step's mapping: request ``i`` (in batch order) runs ``num_tokens[i]`` rows with
        adapter ``loras[i]`` (None: the base model alone)."""
        keep = {lo.lora_int_id for lo in loras if lo is not None}
        self.mapping.row_mask = self.mapping.row_slots = None
        self.mapping.groups = []
        if not keep:
            return
        slot_of = {lid: self._activate(lo, keep) for lo in loras if lo is not None
                   for lid in (lo.lora_int_id,)}
        row_slots = np.repeat(np.asarray([-1 if lo is None else slot_of[lo.lora_int_id] for lo in loras]),
                              np.asarray(num_tokens))
        if self.kernel is not None:   # [T] int64 on the CPU: the C++ kernel's one input per step
            self.mapping.row_slots = torch.from_numpy(row_slots.astype(np.int64))
            return
        if len(keep) == 1 and all(lo is not None for lo in loras):
            self.mapping.groups = [(slot_of[next(iter(keep))], None)]
            return
        self.mapping.groups = [
            (slot, torch.from_numpy(np.flatnonzero(row_slots == slot)).to(self.device))
            for slot in sorted(set(slot_of.values()))]
        # [T, slots, 1, 1]: 1 where the row uses the slot (the mixed pass, ``LoRALinear``).
        one_hot = row_slots[:, None] == np.arange(self.config.max_loras)[None, :]
        self.mapping.row_mask = torch.from_numpy(one_hot).to(self.device, self.dtype)[:, :, None, None]
