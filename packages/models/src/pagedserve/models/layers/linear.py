"""Linear layers written to be sharded by tensor parallelism (Megatron style).

A column-parallel layer splits its *output* features across ranks: each rank computes a slice,
no communication. A row-parallel layer splits its *input* features: each rank computes a partial
sum, and an all-reduce adds them. Attention puts qkv (column) before o_proj (row) and the MLP puts
gate_up (column) before down (row), so each block needs one all-reduce.

With ``tp_size == 1`` these are plain linear layers. Each parameter carries a ``weight_loader``
that takes the whole checkpoint tensor (a lazy ``CheckpointTensor`` handle when loading from
disk): the layer works out this rank's rows or columns (a ``WeightShard``) and its linear method
(linear_method.py; ``linear_method=None`` means the build's default, unquantized unless the
loader builds the model inside ``linear_methods_for``) creates the weights, reads only
that shard into them, and applies them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedserve.models.layers.linear_method import (
    LinearMethodBase,
    Loaded,
    WeightShard,
    load_shard,
    loadable_param,
    new_linear_method,
)
from pagedserve.models.parallel import kv_heads_per_rank
from pagedserve.models.weights import default_weight_loader


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
        linear_method: LinearMethodBase | None = None,
        output_sizes: list[int] | None = None,
    ) -> None:
        super().__init__()
        if output_size % tp_size:
            raise ValueError(f"output size {output_size} is not divisible by tp_size {tp_size}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_rank = output_size // tp_size
        self.linear_method = linear_method or new_linear_method()
        parts = [size // tp_size for size in output_sizes or [output_size]]
        self.linear_method.create_weights(self, input_size, parts, dtype, self.weight_loader)
        size = self.output_size_per_rank
        self.bias = loadable_param((size,), dtype, self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Loaded) -> None:
        size = self.output_size_per_rank
        shard = WeightShard(0, self.tp_rank * size, size, self.output_size, "column shard")
        self._load(param, loaded, shard)

    def _load(self, param: nn.Parameter, loaded: Loaded, shard: WeightShard) -> None:
        """The bias is plain; every other parameter is the linear method's."""
        if param is self.bias:
            load_shard(param, loaded, shard)
        else:
            self.linear_method.load_weight(param, loaded, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul.

    Used for the MLP's gate and up projections: the checkpoint holds them as two tensors;
    ``weight_loader(param, tensor, shard_id)`` copies each one's rank slice into its place.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, **kw) -> None:
        tp_size = kw.get("tp_size", 1)
        if any(size % tp_size for size in output_sizes):
            raise ValueError(f"output sizes {output_sizes} are not all divisible by {tp_size}")
        super().__init__(input_size, sum(output_sizes), bias=bias, output_sizes=output_sizes, **kw)
        self.output_sizes = output_sizes

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: int | None = None
    ) -> None:
        if shard_id is None:
            raise ValueError("a merged projection is loaded one shard at a time")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        what = f"merged projection part {shard_id}"
        total = self.output_sizes[shard_id]
        self._load(param, loaded, WeightShard(0, self.tp_rank * size, size, total, what, offset))


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
        linear_method: LinearMethodBase | None = None,
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
        parts = [n * head_dim * tp_size for n in (self.num_heads, *[self.num_kv_heads] * 2)]
        super().__init__(
            hidden_size,
            sum(parts),
            bias=bias,
            dtype=dtype,
            tp_rank=tp_rank,
            tp_size=tp_size,
            linear_method=linear_method,
            output_sizes=parts,
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
        what = f"{shard_id} projection"
        self._load(param, loaded, WeightShard(0, start, size, total, what, offset))


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
        linear_method: LinearMethodBase | None = None,
    ) -> None:
        super().__init__()
        if input_size % tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tp_size {tp_size}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size = input_size
        self.input_size_per_rank = input_size // tp_size
        self.output_size = output_size
        self.all_reduce = all_reduce
        self.linear_method = linear_method or new_linear_method()
        self.linear_method.create_weights(
            self, self.input_size_per_rank, [output_size], dtype, self.weight_loader
        )
        # The bias is whole on every rank and added once, after the sum.
        self.bias = loadable_param((output_size,), dtype, default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Loaded) -> None:
        size = self.input_size_per_rank
        shard = WeightShard(1, self.tp_rank * size, size, self.input_size, "row shard")
        self.linear_method.load_weight(param, loaded, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_method.apply(self, x)
        if self.tp_size > 1 and self.all_reduce is not None:
            y = self.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias  # added once, after the reduce
        return y
