"""A loaded model made ready for LoRA adapters: its projections wrapped, their slots addressable.

``LoRAModel(model, config, max_loras, max_rank)`` wraps every attention and MLP projection of a
Llama-family or GPT-2 model in a ``LoRALinearMethod`` and maps each adapter module name that a
PEFT checkpoint may use (``model.layers.3.mlp.up_proj``, ``transformer.h.0.attn.c_attn``) onto
its layer and part. Slots are filled and cleared by the engine's LoRA manager; the model never
decides which adapter sits where.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.models.config import ModelConfig
from pagedserve.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.models.lora.layers import LoRABatch, LoRALinearMethod, LoRASlice
from pagedserve.models.registry import ARCHITECTURES

# Which architectures take adapters is the registry's ``lora``. The checkpoint names of the
# parts of our fused layers:
_FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@dataclass(frozen=True)
class LoRATarget:
    """Where an adapter module's A and B go: ``method``'s part ``part``, and the shapes the
    base layer implies (A ``[r, in_features]``, B ``[out_features, r]``)."""

    method: LoRALinearMethod
    part: int
    in_features: int
    out_features: int


def _slices(name: str, layer: nn.Module) -> list[LoRASlice]:
    """The adapter-addressable parts of ``layer`` (at module path ``name``)."""
    parent, _, leaf = name.rpartition(".")
    prefix = parent + "." if parent else ""
    parts = _FUSED_PARTS.get(leaf)
    if isinstance(layer, QKVParallelLinear) and parts:
        q, kv = layer.q_size, layer.kv_size
        sizes = [q, kv, kv]
    elif isinstance(layer, MergedColumnParallelLinear) and parts:
        sizes = list(layer.output_sizes)
    else:
        return [LoRASlice(name, 0, layer.output_size)]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [
        LoRASlice(prefix + part, offset, size)
        for part, offset, size in zip(parts, offsets, sizes, strict=True)
    ]


class LoRAModel:
    """The LoRA view of a loaded model: its wrapped layers, their adapter names, the batch."""

    def __init__(self, model: nn.Module, config: ModelConfig, max_loras: int, max_rank: int):
        if not ARCHITECTURES[config.hf_architecture].lora:
            served = [name for name, a in ARCHITECTURES.items() if a.lora]
            raise ValueError(
                f"LoRA adapters are not supported for {config.hf_architecture}; they are for "
                f"{', '.join(served)}"
            )
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.batch = LoRABatch()
        self.methods: list[LoRALinearMethod] = []
        self.targets: dict[str, LoRATarget] = {}
        for name, layer in model.named_modules():
            if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                self._wrap(name, layer, config.torch_dtype)

    def _wrap(self, name: str, layer: nn.Module, dtype: torch.dtype) -> None:
        if layer.tp_size > 1:
            raise ValueError("LoRA adapters are not supported with tensor parallelism yet")
        slices = _slices(name, layer)
        device = next(layer.parameters()).device
        method = LoRALinearMethod(
            layer.linear_method,
            slices,
            layer.input_size,
            self.max_loras,
            self.max_rank,
            dtype,
            device,
            self.batch,
        )
        layer.linear_method = method
        self.methods.append(method)
        for part, s in enumerate(slices):
            self.targets[s.module] = LoRATarget(method, part, layer.input_size, s.size)

    @property
    def target_module_names(self) -> set[str]:
        """The short names (PEFT's ``target_modules``) an adapter may target here."""
        return {name.rpartition(".")[2] for name in self.targets}

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put one adapter (module name -> (A, scaled B)) into ``slot``, replacing what was
        there; the parts it does not target are zero."""
        self.clear_slot(slot)
        for module, (a, b) in weights.items():
            target = self.targets[module]
            target.method.set_slot(slot, target.part, a, b)

    def clear_slot(self, slot: int) -> None:
        for method in self.methods:
            method.clear_slot(slot)

    def set_batch(self, token_slot: torch.Tensor | None) -> None:
        """This step's slot per token (``None``: no row has an adapter)."""
        self.batch.set(token_slot)
