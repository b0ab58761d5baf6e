"""LoRARequest: which adapter a request runs with, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter by name, a positive integer id unique per adapter, and its folder.

    ``LLM.generate(..., lora_request=LoRARequest("sql", 1, "/adapters/sql"))`` runs the prompts
    with that adapter; the id is what the batch, the scheduler and the prefix cache key on, so
    two adapters never share an id and one adapter keeps its id while it is loaded.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, not {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
