"""A linear layer with LoRA adapters: the base projection plus each row's own adapter.

``LoRALinearMethod`` wraps the layer's linear method (unquantized or quantized: the adapter reads
only the input, so it adds to any base) and holds every slot's adapter weights stacked, so one
``lora_shrink`` and one ``lora_expand`` per part apply all of a step's adapters at once:

- ``lora_a [max_loras, parts * max_rank, in]``: each part's A, stacked along the rank;
- ``lora_b[part] [max_loras, part_out, max_rank]``: each part's B, already multiplied by the
  adapter's scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA), so the kernels scale by 1.

A part is what the checkpoint's adapter names: q_proj, k_proj and v_proj of a fused qkv_proj,
gate_proj and up_proj of gate_up_proj, or the whole layer (o_proj, down_proj, GPT-2's c_attn,
whose adapter spans the fused q/k/v). An adapter that targets some parts leaves the others'
slot at zero, and a rank below ``max_rank`` is zero-padded: zeros add nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.kernels import lora_expand, lora_shrink
from pagedserve.kernels.lora import RowsPerSlot, rows_per_slot
from pagedserve.models.layers.linear_method import LinearMethodBase, Loaded, WeightShard


@dataclass(frozen=True)
class LoRASlice:
    """One part of a layer's output that an adapter targets by ``module`` (its checkpoint
    name, e.g. ``model.layers.0.self_attn.k_proj``): output features ``[offset, offset + size)``."""

    module: str
    offset: int
    size: int


class LoRABatch:
    """Which slot each token of the step uses, shared by every LoRA layer of a model.

    ``token_slot`` ``[T]`` (-1: the base model) is a step input like the token ids: the model
    runner writes it before each forward; ``None`` when no row of the step has an adapter, so
    the layers skip the kernels. It travels beside the forward's arguments rather than through
    them so that every architecture's forward (MLPs, GPT-2's blocks) stays as it is.
    """

    def __init__(self) -> None:
        self.token_slot: torch.Tensor | None = None
        self.groups: RowsPerSlot | None = None

    def set(self, token_slot: torch.Tensor | None) -> None:
        """This step's slots; on CPU also their grouping, once for every layer of the step
        (the reference kernels' one host sync per step instead of one per projection)."""
        self.token_slot = token_slot
        cpu = token_slot is not None and token_slot.device.type == "cpu"
        self.groups = rows_per_slot(token_slot) if cpu else None


class LoRALinearMethod(LinearMethodBase):
    """The base method's weights and product, plus the stacked adapters of every slot."""

    def __init__(
        self,
        base: LinearMethodBase,
        slices: list[LoRASlice],
        input_size: int,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        batch: LoRABatch,
    ) -> None:
        self.base, self.slices, self.batch = base, slices, batch
        self.batch_invariant = base.batch_invariant  # the adapters' products as the base's
        self.input_size, self.max_rank = input_size, max_rank
        shape = (max_loras, len(slices) * max_rank, input_size)
        self.lora_a = torch.zeros(shape, dtype=dtype, device=device)
        self.lora_b = [
            torch.zeros(max_loras, s.size, max_rank, dtype=dtype, device=device) for s in slices
        ]

    def create_weights(self, layer, input_size_per_rank, output_sizes_per_rank, dtype, loader):
        self.base.create_weights(layer, input_size_per_rank, output_sizes_per_rank, dtype, loader)

    def load_weight(self, param: nn.Parameter, loaded: Loaded, shard: WeightShard) -> None:
        self.base.load_weight(param, loaded, shard)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.base.process_weights_after_loading(layer)

    def set_slot(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Copy one part's ``a [r, in]`` and scaled ``b [size, r]`` into ``slot``."""
        r = a.shape[0]
        start = part * self.max_rank
        self.lora_a[slot, start : start + r].copy_(a)
        self.lora_b[part][slot, :, :r].copy_(b)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        for b in self.lora_b:
            b[slot].zero_()

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = self.base.apply(layer, x, bias)
        token_slot = self.batch.token_slot
        if token_slot is None:
            return out
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        flat = out.view(-1, out.shape[-1])
        y = lora_shrink(rows, self.lora_a, token_slot, 1.0, batch_invariant=self.batch_invariant)
        r = self.max_rank
        for part, s in enumerate(self.slices):
            lora_expand(
                y[:, part * r : (part + 1) * r], self.lora_b[part], token_slot, flat, s.offset,
                batch_invariant=self.batch_invariant,
            )  # fmt: skip
        return out
