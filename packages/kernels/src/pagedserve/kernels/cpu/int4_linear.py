"""4-bit group linear layers (AWQ, GPTQ) on CPU: the weights held as rows of 4-bit groups and
multiplied by the GGUF GEMM, which decodes them in L1 and never makes an fp32 matrix.

The internal layout (kernels/int4_linear.py: ``[K / 8, N]`` int32 words, per-group scales and
zero points) runs along the input features, as a GPU tile reads it. A CPU's decode GEMM wants
the other way round: one output feature's weights in a row of bytes, so four rows can be
decoded into a buffer and dotted against the activations (cpu/gguf_linear.py). So at load a
CPU layer writes its unpacked 4-bit values once into ``INT4_GROUPS`` rows (cpu/gguf_blocks.py has the row
layout: the group size, the groups' scales and zero points, the nibbles), the same half byte a
weight; the words are not kept. Every call then reads the 4-bit rows in place: a decode step's
bytes are an eighth of fp32's, and a prefill decodes tiles for MKL
(``multiply_rows``). Groups must be contiguous runs (no ``g_idx``: an act-order layer whose
groups are not ``group_size`` long after sorting keeps the words and the reference).

The decoded weights are the reference's bit for bit (``(q - zero) * scale`` in fp32), so the
result is the reference's up to summation order, and a row's result depends neither on the
batch nor on the thread count (the GGUF GEMM's batch invariance).
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu.gguf_blocks import INT4_GROUPS
from pagedserve.kernels.cpu.gguf_linear import LANES, decode_rows_serial, multiply_rows


def int4_group_rows(
    values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """A layer's 4-bit values ``[K, N]`` (0..15, contiguous groups of ``group_size`` input
    features; the words of the internal layout unpacked) and its ``[G, N]`` scales and zero
    points -> its ``uint8 [N, 4 + 5 G + K / 2]`` ``INT4_GROUPS`` rows: per output feature, the
    group size, ``G`` fp32 scales, ``G`` zero points, then each group's nibbles, weight ``j``
    and ``j + n / 2`` of a group of ``n`` in one byte."""
    k, n = values.shape
    groups = -(-k // group_size)
    if k % 8 or scales.shape != (groups, n) or zeros.shape != (groups, n):
        raise ValueError(
            f"int4 rows: {k} x {n} values (k a multiple of 8) need [{groups}, {n}] scales and "
            f"zeros for groups of {group_size}, got {tuple(scales.shape)}, {tuple(zeros.shape)}"
        )
    q = values.t().to(torch.uint8)  # [N, K]
    full, rest = divmod(k, group_size)
    nibbles = torch.empty(n, k // 2, dtype=torch.uint8)
    if full:
        halves = q[:, : full * group_size].reshape(n, full, 2, group_size // 2)
        nibbles[:, : full * group_size // 2] = (halves[:, :, 0] | (halves[:, :, 1] << 4)).view(
            n, -1
        )
    if rest:
        tail = q[:, full * group_size :]
        nibbles[:, full * group_size // 2 :] = tail[:, : rest // 2] | (tail[:, rest // 2 :] << 4)
    size = torch.tensor([group_size], dtype=torch.int32).view(torch.uint8).expand(n, 4)
    scale_bytes = scales.t().contiguous().view(-1).view(torch.uint8).view(n, -1)
    columns = (size, scale_bytes, zeros.t(), nibbles)
    return torch.cat(columns, dim=1).contiguous()


def int4_rows_linear(
    x: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x W^T + bias`` for ``x [..., K]`` and ``W``'s ``INT4_GROUPS`` rows; fp32 arithmetic
    (other dtypes are widened and the result narrowed back, as the reference does)."""
    k = x.shape[-1]
    out = multiply_rows(x.reshape(-1, k).float(), rows, INT4_GROUPS)
    if bias is not None:
        out += bias
    return out.to(x.dtype).view(*x.shape[:-1], rows.shape[0])


def dequantize_int4_group_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The fp32 ``[N, K]`` weight the rows hold (what the GEMM decodes, for checks)."""
    out = torch.empty(rows.shape[0], k)
    decode_rows_serial(rows.numpy(), INT4_GROUPS, LANES, 0, out.numpy())
    return out
