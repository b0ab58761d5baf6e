"""Linear layers written to be sharded by tensor parallelism (Megatron style).

A column-parallel layer splits its *output* features across ranks: each rank computes a slice,
no communication. A row-parallel layer splits its *input* features: each rank computes a partial
sum, and an all-reduce adds them. Attention puts qkv (column) before o_proj (row) and the MLP puts
gate_up (column) before down (row), so each block needs one all-reduce.

With ``tp_size == 1`` (today's default) these are plain linear layers. Each parameter carries a
``weight_loader`` that takes the full checkpoint tensor and copies in this rank's shard.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def _attach_loader(param: nn.Parameter, loader: Callable) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b, with W's rows (output features) split across ranks."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        if output_size % tp_size:
            raise ValueError(f"output size {output_size} is not divisible by tp_size {tp_size}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.output_size_per_rank = output_size // tp_size
        self.weight = _attach_loader(
            nn.Parameter(
                torch.empty(self.output_size_per_rank, input_size, dtype=dtype), requires_grad=False
            ),
            self.weight_loader,
        )
        self.bias = None
        if bias:
            self.bias = _attach_loader(
                nn.Parameter(
                    torch.empty(self.output_size_per_rank, dtype=dtype), requires_grad=False
                ),
                self.weight_loader,
            )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = loaded.narrow(
            0, self.tp_rank * self.output_size_per_rank, self.output_size_per_rank
        )
        param.data.copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul.

    Used for the MLP's gate and up projections: the checkpoint holds them as two tensors;
    ``weight_loader(param, tensor, shard_id)`` copies each one's rank slice into its place.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, **kw) -> None:
        super().__init__(input_size, sum(output_sizes), bias=bias, **kw)
        self.output_sizes = output_sizes

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None:
            raise ValueError("a merged projection is loaded one shard at a time")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """The fused query/key/value projection; heads are split across ranks.

    When there are fewer KV heads than ranks, each KV head is replicated on
    ``tp_size // num_kv_heads`` ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if num_heads % tp_size:
            raise ValueError(f"{num_heads} attention heads cannot be split over {tp_size} ranks")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        if num_kv_heads >= tp_size:
            if num_kv_heads % tp_size:
                raise ValueError(f"{num_kv_heads} KV heads cannot be split over {tp_size} ranks")
            self.num_kv_heads = num_kv_heads // tp_size
            self.kv_head_start = tp_rank * self.num_kv_heads
        else:
            if tp_size % num_kv_heads:
                raise ValueError(f"{tp_size} ranks cannot share {num_kv_heads} KV heads evenly")
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank * num_kv_heads // tp_size
        out_per_rank = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(
            hidden_size,
            out_per_rank * tp_size,
            bias=bias,
            dtype=dtype,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start = self.kv_size, self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"qkv shard must be 'q', 'k' or 'v', got {shard_id!r}")
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))


class RowParallelLinear(nn.Module):
    """y = x W^T + b, with W's columns (input features) split; partial sums are all-reduced."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        if input_size % tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tp_size {tp_size}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size_per_rank = input_size // tp_size
        self.all_reduce = all_reduce
        self.weight = _attach_loader(
            nn.Parameter(
                torch.empty(output_size, self.input_size_per_rank, dtype=dtype), requires_grad=False
            ),
            self.weight_loader,
        )
        self.bias = None
        if bias:
            self.bias = _attach_loader(
                nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False),
                lambda p, w: p.data.copy_(w),
            )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(
            loaded.narrow(1, self.tp_rank * self.input_size_per_rank, self.input_size_per_rank)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.tp_size > 1 and self.all_reduce is not None:
            y = self.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias  # added once, after the reduce
        return y
