"""q8_0 KV cache rows (kernels/kv_q8.py) against gguf's own Q8_0 quantizer and decoder, which
reproduce llama.cpp's ``quantize_row_q8_0`` bit for bit: the same scales (fp16 bits) and the
same int8 elements, for random rows, rows with halfway points, an all-zero group and values
far apart in size; and the numba KV store writes the reference's bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pagedserve.kernels import store_kv_ref
from pagedserve.kernels.cpu import layer_ops
from pagedserve.kernels.kv_q8 import dequantize_q8_ref, quantize_q8_ref, row_width
from pagedserve.kernels.testing import e4m3_rounding_inputs


def _rows(head_dim: int) -> torch.Tensor:
    x = e4m3_rounding_inputs(n_random=1 << 14)
    x = x[x.isfinite() & (x.abs() < 1e4)]  # fp16 scales: max|x| / 127 below 65504
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]
    rows = x[: x.numel() // head_dim * head_dim].view(-1, head_dim).clone()
    rows[0, :32] = 0.0  # a group of zeros: scale 0, elements 0
    rows[1, :32] = torch.arange(32) * 0.5 - 8  # halfway points after scaling
    return rows


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rows_are_ggufs_q8_0_blocks_rearranged(head_dim):
    x = _rows(head_dim)
    ours = quantize_q8_ref(x)
    assert ours.shape == (x.shape[0], row_width(head_dim)) and ours.dtype == torch.int8
    blocks = quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0).reshape(-1, 34)
    groups = ours.numpy().view(np.uint8)[:, :head_dim].reshape(-1, 32)
    scales = ours.numpy().view(np.uint8)[:, head_dim:].reshape(-1, 2)
    assert np.array_equal(groups, blocks[:, 2:]) and np.array_equal(scales, blocks[:, :2])
    want = quants.dequantize(blocks.reshape(x.shape[0], -1), GGMLQuantizationType.Q8_0)
    assert np.array_equal(dequantize_q8_ref(ours).numpy(), want)


def test_rows_keep_each_group_within_half_a_step_of_its_own_scale():
    """Half a step of the group's own ``d``, plus the scale's rounding to fp16 (a relative
    2^-11, times up to 127 steps): a group of small values is not held to a large one's."""
    x = torch.randn(50, 4, 64) * torch.logspace(-2, 2, 64)  # ranges differ along the row
    error = (dequantize_q8_ref(quantize_q8_ref(x)) - x).abs().view(50, 4, 2, 32)
    step = x.abs().view(50, 4, 2, 32).amax(-1, keepdim=True) / 127
    assert (error <= step * (0.5 + 127 * 2.0**-11)).all()
    assert (error[..., 0, :] < step[..., 1, :] / 8).all()  # the small group's own scale


def test_the_numba_store_writes_the_references_bytes():
    x = _rows(128).view(-1, 2, 64)
    slots = torch.randperm(x.shape[0] + 3, generator=torch.Generator().manual_seed(1))[: x.shape[0]]
    slots[::5] = -1
    caches = [torch.zeros(x.shape[0] + 3, 1, 2, row_width(64), dtype=torch.int8) for _ in range(4)]
    layer_ops.store_kv_numba(x, x.flip(0), caches[0], caches[1], slots)
    store_kv_ref(x, x.flip(0), caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
