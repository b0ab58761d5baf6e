"""LoRA serving in the engine: the request type, the configuration, the adapter manager."""

from pagedserve.engine.lora.config import LoRAConfig
from pagedserve.engine.lora.manager import LoRAManager
from pagedserve.engine.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRAManager", "LoRARequest"]
