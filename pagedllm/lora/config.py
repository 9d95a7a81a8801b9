"""``LoRAConfig``: the engine's LoRA sizes (vLLM's ``--enable-lora`` family). No torch."""

from __future__ import annotations

from dataclasses import dataclass

LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoRAConfig:
    """How many adapters the engine serves at once, and how large.

    Attributes:
        enable_lora: serve LoRA adapters at all.
        max_loras: adapters resident in the model's slots at once (distinct adapters in one batch).
        max_lora_rank: the largest adapter rank ``r`` accepted (slots are this wide).
        max_cpu_loras: adapters kept loaded on the host (LRU, >= ``max_loras``); None: ``max_loras``.
        lora_dtype: the adapters' weights' dtype; "auto": the model's.
    Raises:
        ValueError: naming the field, for a value out of range.
    """

    enable_lora: bool = False
    max_loras: int = 1          # slots
    max_lora_rank: int = 16     # rank r
    max_cpu_loras: int | None = None  # adapters on the host
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be an int >= 1, got {self.max_loras!r}")
        if not isinstance(self.max_lora_rank, int) or self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be an int >= 1, got {self.max_lora_rank!r}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int)
                                               or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras!r}) must be an int >= max_loras ({self.max_loras})")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {LORA_DTYPES}, got {self.lora_dtype!r}")

    @property
    def num_cpu_loras(self) -> int:
        """Adapters the host cache holds (``max_cpu_loras``, default ``max_loras``)."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
