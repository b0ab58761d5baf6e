"""LoRAConfig: how many adapters a step may mix, how large, how many stay in host memory."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    """``max_loras`` adapters have a slot on the device (a step mixes at most that many);
    ``max_cpu_loras`` (at least ``max_loras``) stay read in host memory, least recently used
    dropped first (a dropped adapter is read again from its folder when a request needs it);
    an adapter's rank may be at most ``max_lora_rank`` (the slots' size)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def cpu_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
