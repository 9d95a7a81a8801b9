"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request``). No torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """One LoRA adapter, named by the caller (vLLM's fields).

    Attributes:
        lora_name: the adapter's name (the server's ``model`` field picks it).
        lora_int_id: a positive id, unique per adapter in the engine (slot and prefix-cache key).
        lora_path: a folder in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``).
    Raises:
        ValueError: for an empty name or path, or ``lora_int_id < 1``.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of ``lora_int_id``."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
