"""Linear layers written to be sharded by tensor parallelism (Megatron style).

A column-parallel layer splits its *output* features across ranks: each rank computes a slice,
no communication. A row-parallel layer splits its *input* features: each rank computes a partial
sum, and an all-reduce adds them. Attention puts qkv (column) before o_proj (row) and the MLP puts
gate_up (column) before down (row), so each block needs one all-reduce.

With ``tp_size == 1`` these are plain linear layers. Each parameter carries a ``weight_loader``
that takes the whole checkpoint tensor (a lazy ``CheckpointTensor`` handle when loading from
disk), narrows it to this rank's rows or columns and reads only those.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.models.config import ModelLoadError
from pagedserve.models.parallel import kv_heads_per_rank
from pagedserve.models.weights import CheckpointTensor, copy_shard, default_weight_loader

Loaded = torch.Tensor | CheckpointTensor


def _loadable_param(shape: tuple[int, ...], dtype: torch.dtype, loader: Callable) -> nn.Parameter:
    """An inference-only parameter that knows how to copy its shard from a checkpoint tensor."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
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
        self.output_size = output_size
        self.output_size_per_rank = output_size // tp_size
        size = self.output_size_per_rank
        self.weight = _loadable_param((size, input_size), dtype, self.weight_loader)
        self.bias = _loadable_param((size,), dtype, self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Loaded) -> None:
        _check_full(loaded, 0, self.output_size, "column-parallel output features")
        size = self.output_size_per_rank
        copy_shard(param.data, loaded.narrow(0, self.tp_rank * size, size), "column shard")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul.

    Used for the MLP's gate and up projections: the checkpoint holds them as two tensors;
    ``weight_loader(param, tensor, shard_id)`` copies each one's rank slice into its place.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, **kw) -> None:
        tp_size = kw.get("tp_size", 1)
        if any(size % tp_size for size in output_sizes):
            raise ValueError(f"output sizes {output_sizes} are not all divisible by {tp_size}")
        super().__init__(input_size, sum(output_sizes), bias=bias, **kw)
        self.output_sizes = output_sizes

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: int | None = None
    ) -> None:
        if shard_id is None:
            raise ValueError("a merged projection is loaded one shard at a time")
        _check_full(loaded, 0, self.output_sizes[shard_id], f"merged projection part {shard_id}")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        copy_shard(
            param.data.narrow(0, offset, size),
            loaded.narrow(0, self.tp_rank * size, size),
            f"merged projection part {shard_id}",
        )


class QKVParallelLinear(ColumnParallelLinear):
    """The fused query/key/value projection; heads are split across ranks.

    Rank r holds query heads ``[r * Hq / tp, (r + 1) * Hq / tp)`` and the KV heads they attend
    to. When there are fewer KV heads than ranks, each KV head is replicated on
    ``tp_size // num_kv_heads`` ranks: rank r holds KV head ``r * Hkv // tp``, which is the
    group of its query heads because query head h reads KV head ``h // (Hq / Hkv)``.
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
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp_size)
        if num_kv_heads >= tp_size:
            self.kv_head_start = tp_rank * self.num_kv_heads
        else:
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
        self, param: nn.Parameter, loaded: Loaded, shard_id: str | None = None
    ) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp_rank * self.q_size
            total = self.total_num_heads * self.head_dim
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start = self.kv_size, self.kv_head_start * self.head_dim
            total = self.total_num_kv_heads * self.head_dim
        else:
            raise ValueError(f"qkv shard must be 'q', 'k' or 'v', got {shard_id!r}")
        _check_full(loaded, 0, total, f"{shard_id} projection")
        copy_shard(
            param.data.narrow(0, offset, size),
            loaded.narrow(0, start, size),
            f"{shard_id} projection",
        )


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
        self.input_size = input_size
        self.input_size_per_rank = input_size // tp_size
        self.all_reduce = all_reduce
        shape = (output_size, self.input_size_per_rank)
        self.weight = _loadable_param(shape, dtype, self.weight_loader)
        # The bias is whole on every rank and added once, after the sum.
        self.bias = _loadable_param((output_size,), dtype, default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Loaded) -> None:
        _check_full(loaded, 1, self.input_size, "row-parallel input features")
        size = self.input_size_per_rank
        copy_shard(param.data, loaded.narrow(1, self.tp_rank * size, size), "row shard")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.tp_size > 1 and self.all_reduce is not None:
            y = self.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias  # added once, after the reduce
        return y


def _check_full(loaded: Loaded, dim: int, expected: int, what: str) -> None:
    """The checkpoint tensor must be whole along the split dimension before a rank narrows it."""
    if loaded.dim() <= dim or loaded.shape[dim] != expected:
        raise ModelLoadError(
            f"checkpoint tensor for the {what} has shape {tuple(loaded.shape)}; expected "
            f"{expected} along dimension {dim}"
        )
