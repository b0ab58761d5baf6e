"""The linear layers hold, load and apply their weights only through their linear method.

A method with a layout of its own (the weight stored transposed, ``[in, out]``, under another
name) is plugged into each parallel layer; each rank's shard must still come out equal to the
unsharded reference. A layer that created, loaded or applied a weight behind its method's back
would have no such parameter, or compute with an unloaded one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.models import ModelLoadError
from pagedserve.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.models.layers.linear_method import (
    LinearMethodBase,
    UnquantizedLinearMethod,
    WeightShard,
    loadable_param,
)
from pagedserve.models.weights import materialize


class TransposedLinearMethod(LinearMethodBase):
    """Stores W^T as ``layer.weight_t``; records the per-part sizes it was asked for."""

    def __init__(self) -> None:
        self.output_sizes: list[int] = []

    def create_weights(self, layer, input_size_per_rank, output_sizes_per_rank, dtype, loader):
        self.output_sizes = list(output_sizes_per_rank)
        shape = (input_size_per_rank, sum(output_sizes_per_rank))
        layer.weight_t = loadable_param(shape, dtype, loader)

    def load_weight(self, param: nn.Parameter, loaded, shard: WeightShard) -> None:
        part = materialize(loaded.narrow(shard.dim, shard.start, shard.size))
        param.data.narrow(1 - shard.dim, shard.param_offset, shard.size).copy_(part.t())

    def apply(self, layer, x, bias=None):
        y = x @ layer.weight_t
        return y if bias is None else y + bias


def load_all(layer: nn.Module, tensors: dict[str, torch.Tensor], shard_ids=None) -> None:
    for name, param in layer.named_parameters():
        if name == "bias":
            param.weight_loader(param, tensors["bias"])
        elif shard_ids is None:
            param.weight_loader(param, tensors["weight"])
        else:
            for shard_id in shard_ids:
                param.weight_loader(param, tensors[shard_id], shard_id)


@pytest.mark.parametrize("rank", [0, 1])
def test_column_and_row_layers_go_through_their_method(rank):
    torch.manual_seed(0)
    w, b, x = torch.randn(8, 6), torch.randn(8), torch.randn(3, 6)
    column = ColumnParallelLinear(
        6, 8, bias=True, tp_rank=rank, tp_size=2, linear_method=TransposedLinearMethod()
    )
    assert not hasattr(column, "weight")
    load_all(column, {"weight": w, "bias": b})
    rows = slice(rank * 4, rank * 4 + 4)
    torch.testing.assert_close(column(x), x @ w[rows].T + b[rows])

    w2, b2, h = torch.randn(6, 8), torch.randn(6), torch.randn(3, 8)
    row = RowParallelLinear(
        8, 6, bias=True, tp_rank=rank, tp_size=2, linear_method=TransposedLinearMethod()
    )
    load_all(row, {"weight": w2, "bias": b2})
    cols = slice(rank * 4, rank * 4 + 4)  # its input shard; a partial sum, bias added once
    torch.testing.assert_close(row(h[:, cols]), h[:, cols] @ w2[:, cols].T + b2)


def test_fused_layers_place_each_part_through_their_method():
    torch.manual_seed(1)
    hidden, head_dim, heads, kv_heads, tp_size, rank = 8, 2, 4, 2, 2, 1
    parts = {
        "q": torch.randn(heads * head_dim, hidden),
        "k": torch.randn(kv_heads * head_dim, hidden),
        "v": torch.randn(kv_heads * head_dim, hidden),
    }
    method = TransposedLinearMethod()
    qkv = QKVParallelLinear(
        hidden, head_dim, heads, kv_heads, False, rank, tp_size, linear_method=method
    )
    assert method.output_sizes == [4, 2, 2]  # this rank's q, k, v features
    load_all(qkv, parts, shard_ids="qkv")
    x = torch.randn(3, hidden)
    expected = torch.cat(
        [x @ parts[p][4:8].T if p == "q" else x @ parts[p][2:4].T for p in "qkv"], -1
    )
    torch.testing.assert_close(qkv(x), expected)

    gate, up = torch.randn(6, hidden), torch.randn(6, hidden)
    method = TransposedLinearMethod()
    gate_up = MergedColumnParallelLinear(hidden, [6, 6], tp_rank=0, tp_size=2, linear_method=method)
    assert method.output_sizes == [3, 3]
    load_all(gate_up, {0: gate, 1: up}, shard_ids=[0, 1])
    torch.testing.assert_close(gate_up(x), torch.cat([x @ gate[:3].T, x @ up[:3].T], -1))


def test_the_default_method_is_unquantized_and_checks_whole_tensors():
    layer = ColumnParallelLinear(6, 8, tp_rank=1, tp_size=2)
    assert isinstance(layer.linear_method, UnquantizedLinearMethod)
    w, x = torch.randn(8, 6), torch.randn(2, 6)
    layer.weight.weight_loader(layer.weight, w)
    torch.testing.assert_close(layer(x), F.linear(x, w[4:]))
    with pytest.raises(ModelLoadError, match="expected 8 along dimension 0"):
        layer.weight.weight_loader(layer.weight, w[:4])  # a shard, not the whole tensor
