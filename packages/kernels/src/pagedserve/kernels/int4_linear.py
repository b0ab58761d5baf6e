"""4-bit group-quantized linear layers (AWQ, GPTQ): ``y = x W^T + b`` with ``W`` stored as
4-bit integers, a zero point and a scale per group of input features.

One internal layout serves both checkpoint formats (the models' loaders repack into it):

- ``qweight`` int32 ``[K / 8, N]``: bits ``4j .. 4j + 3`` of ``qweight[p, n]`` hold the 4-bit
  value ``q[8p + j, n]`` (GPTQ's order along the input features, not AWQ's interleave).
- ``scales`` fp32 ``[G, N]`` and ``zeros`` uint8 ``[G, N]``: group ``g``'s scale and zero
  point for each output channel. A zero point is 0..16 (GPTQ's old format stores ``z - 1``
  in 4 bits, so a decoded 16 is a legal value there).
- the group of input feature ``k``: ``k // group_size``, or ``g_idx[k]`` (int32 ``[K]``) when
  the groups are not contiguous runs (GPTQ's act-order, on a tensor-parallel shard).

``W[n, k] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n]``. The Triton kernel unpacks and
dequantizes a ``[BLOCK_K, BLOCK_N]`` tile in registers and accumulates ``x W^T`` in fp32, so
only the 4-bit words (an eighth of fp32's bytes) are read from memory: that is what a
memory-bound decode step wants. The reference dequantizes the whole layer into a reusable
fp32 buffer (:class:`Int4Workspace`) and calls one fp32 GEMM. A CPU engine holds its layers
in another layout, rows of 4-bit groups one output feature a row, which the CPU's GGUF GEMM
decodes in place (cpu/int4_linear.py; the model's method picks it at load): what a CPU runs
here is the reference, for a layer whose groups are not contiguous runs (act-order on a
tensor-parallel shard) or when the reference is forced.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import kernel_path

PACK = 8  # 4-bit values per int32 word
_SHIFTS = tuple(range(0, 32, 4))


@triton.jit(do_not_specialize=["M"])
def _int4_linear_kernel(
    x_ptr, qw_ptr, scale_ptr, zero_ptr, g_idx_ptr, bias_ptr, out_ptr,
    M, N, K, group_size,
    stride_xm, stride_qk, stride_om,
    HAS_G_IDX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program per (BLOCK_M rows of x) x (BLOCK_N output channels) tile."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        w_ok = k_ok[:, None] & col_ok[None, :]
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        # each word is loaded for its 8 rows (the cache serves the repeats) and shifted
        word = tl.load(qw_ptr + (k // 8).to(tl.int64)[:, None] * stride_qk + cols[None, :],
                       mask=w_ok, other=0)  # fmt: skip
        q = (word >> ((k % 8) * 4)[:, None]) & 0xF
        if HAS_G_IDX:
            g = tl.load(g_idx_ptr + k, mask=k_ok, other=0)
        else:
            g = k // group_size
        at = g.to(tl.int64)[:, None] * N + cols[None, :]
        zero = tl.load(zero_ptr + at, mask=w_ok, other=0).to(tl.int32)
        scale = tl.load(scale_ptr + at, mask=w_ok, other=0.0)
        w = ((q - zero).to(tl.float32) * scale).to(x.dtype)
        if IEEE_FP32:  # fp32 models get fp32 products, not tf32's 10-bit mantissa
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def check_int4_layout(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None,
) -> tuple[int, int]:
    """``(K, N)`` of a weight in the internal layout, or a ValueError saying what disagrees."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"int4 linear: qweight must be 2-D int32, got {qweight.dtype}")
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    groups = -(-k // group_size) if g_idx is None else scales.shape[0]
    if scales.shape != (groups, n) or scales.dtype != torch.float32:
        raise ValueError(f"int4 linear: scales must be fp32 {(groups, n)}, got {scales.shape}")
    if zeros.shape != scales.shape or zeros.dtype != torch.uint8:
        raise ValueError(f"int4 linear: zeros must be uint8 {tuple(scales.shape)}")
    if g_idx is not None and (g_idx.shape != (k,) or g_idx.dtype != torch.int32):
        raise ValueError(f"int4 linear: g_idx must be int32 [{k}], got {g_idx.shape}")
    return k, n


def tile_shape(m: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) as for the 8-bit kernel: 16 rows for decode, 64 for
    prefill; fp32 operand tiles take twice the registers, so half the rows and K depth."""
    if dtype == torch.float32:
        return (16 if m <= 16 else 32), 64, 32
    return (16 if m <= 16 else 64), 64, 64


def int4_linear_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch wrapper: ``x`` ``[..., K]``; the weight in the internal layout (module doc)."""
    k, n = check_int4_layout(qweight, scales, zeros, group_size, g_idx)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if out.numel():
        block_m, block_n, block_k = tile_shape(m, x.dtype)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _int4_linear_kernel[grid](
            x2, qweight, scales, zeros, g_idx if g_idx is not None else scales,
            bias if bias is not None else scales, out,
            m, n, k, group_size, x2.stride(0), qweight.stride(0), out.stride(0),
            HAS_G_IDX=g_idx is not None, HAS_BIAS=bias is not None,
            IEEE_FP32=x.dtype == torch.float32,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)


class Int4Workspace:
    """One fp32 buffer (and one int32 buffer for the unpacking) that every layer of a model
    dequantizes into, grown to the largest layer: the CPU path holds one layer's fp32 weight
    at a time instead of the whole model's. Not shared between threads."""

    def __init__(self) -> None:
        self._float = torch.empty(0)
        self._int = torch.empty(0, dtype=torch.int32)

    def buffers(self, numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._float.numel() < numel or self._float.device != device:
            self._float = torch.empty(numel, device=device)
            self._int = torch.empty(numel, dtype=torch.int32, device=device)
        return self._float[:numel], self._int[:numel]


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    workspace: Int4Workspace | None = None,
) -> torch.Tensor:
    """The fp32 ``[K, N]`` weight (``W^T``) of a layer in the internal layout; in the
    workspace's buffer when one is given (valid until the next call), else a new tensor."""
    k, n = check_int4_layout(qweight, scales, zeros, group_size, g_idx)
    work = workspace or Int4Workspace()
    out, unpacked = work.buffers(k * n, qweight.device)
    out, unpacked = out.view(k, n), unpacked.view(k // PACK, PACK, n)
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=qweight.device)[None, :, None]
    torch.bitwise_right_shift(qweight[:, None, :], shifts, out=unpacked)
    unpacked.bitwise_and_(0xF)
    out.copy_(unpacked.view(k, n))
    if g_idx is None:
        full, rest = divmod(k, group_size)
        head = out[: full * group_size].view(full, group_size, n)
        head.sub_(zeros[:full, None, :]).mul_(scales[:full, None, :])
        if rest:
            out[full * group_size :].sub_(zeros[full]).mul_(scales[full])
    else:
        rows = g_idx.long()
        out.sub_(zeros.index_select(0, rows)).mul_(scales.index_select(0, rows))
    return out if workspace is not None else out.clone()


def int4_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    workspace: Int4Workspace | None = None,
) -> torch.Tensor:
    """Reference: dequantize the layer to fp32 (into ``workspace``), one fp32 GEMM, the bias."""
    weight_t = dequantize_int4(qweight, scales, zeros, group_size, g_idx, workspace)
    out = x.float() @ weight_t
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    workspace: Int4Workspace | None = None,
) -> torch.Tensor:
    """``x W^T + bias`` for a 4-bit group-quantized ``W`` in the internal layout; Triton on a
    GPU, else the reference (``workspace``: its reusable buffer; module doc for the CPU)."""
    if kernel_path(x) == "triton":
        return int4_linear_triton(x, qweight, scales, zeros, group_size, g_idx, bias)
    return int4_linear_ref(x, qweight, scales, zeros, group_size, g_idx, bias, workspace)


def pack_int4_rows(values: torch.Tensor) -> torch.Tensor:
    """``[K, N]`` integers 0..15 -> the internal ``[K / 8, N]`` int32 words (``K % 8 == 0``)."""
    k, n = values.shape
    if k % PACK:
        raise ValueError(f"int4 packing needs input features divisible by 8, got {k}")
    return pack_int4(values.view(k // PACK, PACK, n), dim=1)


def pack_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Pack the 8 entries of ``values`` along ``dim`` (size 8, integers 0..15) into one int32
    each, entry ``j`` in bits ``4j .. 4j + 3``; ``dim`` is dropped."""
    shape = [1] * values.dim()
    shape[dim] = PACK
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=values.device).view(shape)
    words = (values.to(torch.int64) << shifts).sum(dim=dim)
    # a word with its top bit set is stored as the negative int32 of the same bits
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4_rows(qweight: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4_rows`: ``[K / 8, N]`` words -> ``[K, N]`` int32 0..15."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=qweight.device)[None, :, None]
    q = (qweight[:, None, :] >> shifts) & 0xF
    return q.reshape(-1, qweight.shape[1])
