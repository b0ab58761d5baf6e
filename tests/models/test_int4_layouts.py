"""AWQ and GPTQ tensors against a plain numpy decoder written from the formats' description.

The decoder below knows only what the formats say (AutoAWQ GEMM: 8 output channels per int32,
nibble ``i`` holding channel ``[0, 2, 4, 6, 1, 3, 5, 7][i]``; GPTQ: 8 input features per
int32 in order, zero points stored minus one in the original format, ``g_idx`` naming each
feature's group). It is checked on hand-made words first; then it must decode what our
quantizer wrote to exactly what the quantizer encoded, and the weights pagedserve's loader
repacks (and its tensor-parallel shards, act-order included) must dequantize to the same.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedserve.kernels.cpu.int4_linear import dequantize_int4_group_rows
from pagedserve.kernels.int4_linear import dequantize_int4
from pagedserve.models import ModelLoadError
from pagedserve.models.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedserve.models.layers.linear_method import linear_methods_for
from pagedserve.models.quantization_int4 import int4_method_factory
from pagedserve.models.testing_quantized import (
    Int4Layout,
    dequantize_rtn,
    int4_tensors,
    rtn_quantize,
)
from pagedserve.models.weights import CheckpointTensor

AWQ_NIBBLE_CHANNEL = [0, 2, 4, 6, 1, 3, 5, 7]


def nibbles(words: np.ndarray) -> np.ndarray:
    """``[..., C]`` int32 -> ``[..., C, 8]``: nibble i is bits 4i..4i+3."""
    w = words.astype(np.int64) & 0xFFFFFFFF
    return np.stack([(w >> (4 * i)) & 0xF for i in range(8)], axis=-1)


def numpy_awq(qweight, qzeros, scales, group_size) -> np.ndarray:
    """AWQ GEMM tensors -> the ``[out, in]`` weight."""

    def channels(words):  # [R, C] -> [R, 8C] in channel order
        n = nibbles(words)
        out = np.empty(n.shape[:-2] + (n.shape[-2] * 8,), dtype=np.int64)
        for i, ch in enumerate(AWQ_NIBBLE_CHANNEL):
            out[:, ch::8] = n[..., i]
        return out

    q, z = channels(qweight), channels(qzeros)
    g = np.arange(q.shape[0]) // group_size
    return ((q - z[g]) * scales.astype(np.float32)[g]).T


def numpy_gptq(qweight, qzeros, scales, g_idx, v1: bool) -> np.ndarray:
    """GPTQ tensors -> the ``[out, in]`` weight."""
    q = nibbles(qweight.T).reshape(qweight.shape[1], -1).T  # [in, out]: feature 8p + j
    z = nibbles(qzeros).reshape(qzeros.shape[0], -1) + (1 if v1 else 0)
    g = g_idx.astype(np.int64)
    return ((q - z[g]) * scales.astype(np.float32)[g]).T


def test_the_numpy_decoder_on_hand_made_words():
    word = np.array([[0x76543210]], dtype=np.int64).astype(np.int32)  # nibble i holds i
    scales = np.ones((1, 8), dtype=np.float16)
    # AWQ: one word is 8 output channels; channel AWQ_NIBBLE_CHANNEL[i] holds nibble i
    awq = numpy_awq(word, np.zeros((1, 1), np.int32), scales, group_size=1)
    assert awq[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    # GPTQ: one word is 8 input features of one channel; v1 zeros 0x1 mean a zero of 2
    words = np.repeat(word, 8, axis=1)
    gptq = numpy_gptq(words, np.array([[0x11111111]], np.int32), scales, np.zeros(8), True)
    assert gptq[3].tolist() == [j - 2 for j in range(8)]
    assert numpy_gptq(words, np.array([[0x11111111]], np.int32), scales, np.zeros(8), False)[
        3
    ].tolist() == [j - 1 for j in range(8)]
    # a top nibble of 0xF (the word is a negative int32) is 15; a v1 zero nibble 0xF is 16
    top = np.full((1, 8), -(2**28), dtype=np.int32)  # 0xF0000000
    decoded = numpy_gptq(top, np.array([[-1]], np.int32), scales, np.zeros(8), True)
    assert decoded[0].tolist() == [-16] * 7 + [-1]


LAYOUTS = [
    Int4Layout("awq", group_size=32),
    Int4Layout("gptq", group_size=32),
    Int4Layout("gptq", group_size=64, sym=True, act_order=True),
    Int4Layout("gptq", group_size=32, act_order=True, v2=True),
    Int4Layout("gptq", group_size=-1, sym=True),
]


def _numpy_decode(layout: Int4Layout, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    t = {k: v.numpy() for k, v in tensors.items()}
    if layout.method == "awq":
        w = numpy_awq(t["qweight"], t["qzeros"], t["scales"], layout.group_size)
    else:
        w = numpy_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], not layout.v2)
    return torch.from_numpy(np.ascontiguousarray(w)).float()


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_what_the_quantizer_wrote_decodes_to_what_it_encoded(layout):
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(1))
    encoding = rtn_quantize(weight, layout.group_size, layout.sym,
                            perm if layout.act_order else None)  # fmt: skip
    tensors = int4_tensors(layout, *encoding)
    q, zeros, scales, g_idx = encoding
    if layout.method == "gptq" and not layout.v2:  # the format's 0 - 1 wraps to 15 -> 16
        zeros = torch.where(zeros == 0, 16, zeros)
    encoded = dequantize_rtn(q, zeros, scales, g_idx)
    torch.testing.assert_close(_numpy_decode(layout, tensors), encoded, atol=0, rtol=0)
    assert (encoded - weight).abs().max() < 0.5  # it is a 4-bit image of the weight


def _loaded_weight(layer) -> torch.Tensor:
    """A loaded layer's ``[out, in]`` weight, in the checkpoint's input order: decoded from the
    rows a CPU holds (kernels/cpu/int4_linear.py), or from the words the reference reads."""
    m = layer.linear_method
    if hasattr(layer, "qrows"):
        k = layer.input_size // (layer.tp_size if isinstance(layer, RowParallelLinear) else 1)
        w_t = dequantize_int4_group_rows(layer.qrows.data, k).t()
    else:
        w_t = dequantize_int4(layer.qweight, layer.scales, layer.zeros, m.group_size, layer.g_idx)
    if layer.input_perm is not None:
        w_t = w_t[torch.argsort(layer.input_perm)]
    return w_t.t()


@pytest.fixture
def stored(tmp_path):
    """Write per-name tensors to safetensors; return lazy handles while the file is open."""
    files = []

    def write(tensors: dict[str, torch.Tensor]):
        path = tmp_path / f"w{len(files)}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)
        f = safe_open(str(path), framework="pt")
        files.append(f)
        return lambda name: CheckpointTensor.open(f.get_slice(name))

    return write


def _quantized_parts(layout, shapes, seed=0):
    """Per part: (stored tensors, numpy-decoded weight); parts share one act-order."""
    k = shapes[0][1]
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed + 7))
    parts = []
    for i, (n, _) in enumerate(shapes):
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed + i))
        enc = rtn_quantize(w, layout.group_size, layout.sym, perm if layout.act_order else None)
        tensors = int4_tensors(layout, *enc)
        parts.append((tensors, _numpy_decode(layout, tensors)))
    return parts


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("tp_size", [1, 2])
def test_loaded_layers_and_their_shards_hold_the_decoded_weight(layout, tp_size, stored):
    """Column-parallel qkv (heads split, every group) and row-parallel o_proj (input features
    split on group boundaries; with act-order every rank keeps every group's scales)."""
    hidden, head_dim, heads, kv_heads = 128, 16, 8, 4
    qkv = _quantized_parts(
        layout, [(heads * head_dim, hidden), *[(kv_heads * head_dim, hidden)] * 2]
    )
    ((o_tensors, o_weight),) = _quantized_parts(layout, [(hidden, heads * head_dim)], seed=5)
    handles = stored({f"{p}.{k}": v for p, (t, _) in zip("qkv", qkv) for k, v in t.items()}
                     | {f"o.{k}": v for k, v in o_tensors.items()})  # fmt: skip
    factory = int4_method_factory(layout.quantization_config())
    for rank in range(tp_size):
        with linear_methods_for(factory):
            layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, False, rank, tp_size)
            row = RowParallelLinear(heads * head_dim, hidden, tp_rank=rank, tp_size=tp_size)
        for part in "qkv":
            for name in qkv[0][0]:
                param = getattr(layer, name)
                param.weight_loader(param, handles(f"{part}.{name}"), part)
        for name in o_tensors:
            getattr(row, name).weight_loader(getattr(row, name), handles(f"o.{name}"))
        layer.linear_method.process_weights_after_loading(layer)
        row.linear_method.process_weights_after_loading(row)
        q_rows = slice(rank * layer.q_size, (rank + 1) * layer.q_size)
        kv_rows = slice(rank * layer.kv_size, (rank + 1) * layer.kv_size)
        expected = torch.cat([qkv[0][1][q_rows], qkv[1][1][kv_rows], qkv[2][1][kv_rows]])
        torch.testing.assert_close(_loaded_weight(layer), expected, atol=0, rtol=0)
        cols = slice(rank * row.input_size_per_rank, (rank + 1) * row.input_size_per_rank)
        torch.testing.assert_close(_loaded_weight(row), o_weight[:, cols], atol=0, rtol=0)
        x = torch.randn(3, row.input_size_per_rank)
        torch.testing.assert_close(row(x), x @ o_weight[:, cols].T, atol=1e-4, rtol=1e-4)


def test_fused_parts_with_different_act_orders_are_refused(stored):
    layout = Int4Layout("gptq", group_size=32, act_order=True)
    (q_part,) = _quantized_parts(layout, [(64, 64)], seed=0)
    (k_part,) = _quantized_parts(layout, [(32, 64)], seed=3)  # another permutation
    handles = stored({f"{p}.{k}": v for p, (t, _) in zip("qk", (q_part, k_part))
                      for k, v in t.items()})  # fmt: skip
    with linear_methods_for(int4_method_factory(layout.quantization_config())):
        layer = QKVParallelLinear(64, 16, 4, 2)
    layer.g_idx.weight_loader(layer.g_idx, handles("q.g_idx"), "q")
    with pytest.raises(ModelLoadError, match="g_idx differ"):
        layer.g_idx.weight_loader(layer.g_idx, handles("k.g_idx"), "k")
