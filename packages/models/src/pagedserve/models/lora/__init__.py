"""LoRA adapters on a loaded model: wrapped projections with stacked per-slot weights, and the
PEFT adapter reader that validates an adapter against the model before it is served."""

from pagedserve.models.lora.layers import LoRABatch, LoRALinearMethod, LoRASlice
from pagedserve.models.lora.model import LoRAModel, LoRATarget
from pagedserve.models.lora.peft import LoRAAdapterError, LoRAAdapterWeights, load_peft_adapter

__all__ = [
    "LoRAAdapterError",
    "LoRAAdapterWeights",
    "LoRABatch",
    "LoRALinearMethod",
    "LoRAModel",
    "LoRASlice",
    "LoRATarget",
    "load_peft_adapter",
]
