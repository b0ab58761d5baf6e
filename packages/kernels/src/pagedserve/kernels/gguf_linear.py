"""GGUF linear layers: ``y = x W^T + b`` with ``W`` held in its GGUF blocks.

``qweight`` is the matrix exactly as the file stores it, ``uint8 [N, row_bytes]``, and
``qtype`` its ggml type id (gguf_dequant.py has the layouts). The Triton kernel decodes each
weight of a ``[BLOCK_K, BLOCK_N]`` tile from its block in registers (its quant bits, and the
block's fp16 scale / min, and for the K-quants its sub-block's 6- or 8-bit scale), rounds it
to the activations' dtype and accumulates ``x W^T`` in fp32 with ``tl.dot``: only the packed
bytes travel from memory, which is what a memory-bound decode step wants.

Each weight is addressed on its own (byte ``n * row_bytes + (k / block_size) * block_bytes +
offset(k % block_size)``), so the tile's K depth is free of the block size; the scale loads
of the 32 or 256 weights of a block hit the same cache line.

The reference dequantizes the whole matrix to fp32 (``gguf_dequantize_ref``), rounds it to
the activations' dtype (the kernel's operand, so the two agree to accumulation order) and
calls one GEMM. On a CPU the engine multiplies from the blocks with numba instead
(cpu/gguf_linear.py: a decoded weight row dotted against a decode step's rows, decoded tiles
and MKL for a prefill), held to the same reference.
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import torch
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import kernel_path
from pagedserve.kernels.gguf_dequant import GGUF_TYPE_IDS, gguf_dequantize_ref, gguf_type
from pagedserve.kernels.weight_only_linear import tile_shape

F32, F16, BF16 = GGUF_TYPE_IDS["F32"], GGUF_TYPE_IDS["F16"], GGUF_TYPE_IDS["BF16"]


@triton.jit
def _byte(ptr, offset, mask):
    return tl.load(ptr + offset, mask=mask, other=0).to(tl.int32)


@triton.jit
def _half(h_ptr, offset, mask):
    """The fp16 at (even) byte ``offset``, read through the fp16 view of the same bytes."""
    return tl.load(h_ptr + offset // 2, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _signed(byte):
    return tl.where(byte > 127, byte - 256, byte)


@triton.jit
def _iq4_level(q):
    """IQ4_NL's level for nibble ``q`` (gguf_dequant.IQ4_LEVELS): four levels per int32 word,
    each stored + 128 in one byte (Triton has no constant arrays)."""
    word = tl.where(
        q < 4, 1059919873, tl.where(q < 8, 1986682191, tl.where(q < 12, -1499886207, -237386315))
    )
    return ((word >> ((q & 3) * 8)) & 0xFF) - 128


@triton.jit
def _nibble(w_ptr, qs, j, mask):
    """Weight ``j`` (0..31) of 16 bytes of nibbles at ``qs``: low nibbles, then high ones."""
    return (_byte(w_ptr, qs + j % 16, mask) >> ((j // 16) * 4)) & 0xF


@triton.jit
def _decode_32(w_ptr, h_ptr, row, k, mask, QTYPE: tl.constexpr):
    """fp32 weights of the types with 32-weight blocks."""
    j = k % 32
    if QTYPE == 8:  # Q8_0
        base = row + (k // 32) * 34
        w = _half(h_ptr, base, mask) * _signed(_byte(w_ptr, base + 2 + j, mask)).to(tl.float32)
    elif QTYPE == 2 or QTYPE == 20:  # Q4_0, IQ4_NL
        base = row + (k // 32) * 18
        q = _nibble(w_ptr, base + 2, j, mask)
        level = (q - 8) if QTYPE == 2 else _iq4_level(q)
        w = _half(h_ptr, base, mask) * level.to(tl.float32)
    elif QTYPE == 3:  # Q4_1
        base = row + (k // 32) * 20
        q = _nibble(w_ptr, base + 4, j, mask).to(tl.float32)
        w = _half(h_ptr, base, mask) * q + _half(h_ptr, base + 2, mask)
    else:  # Q5_0, Q5_1: the fifth bits in a uint32 after the fp16 fields
        fields = 2 if QTYPE == 6 else 4
        base = row + (k // 32) * (22 if QTYPE == 6 else 24)
        high = (_byte(w_ptr, base + fields + j // 8, mask) >> (j % 8)) & 1
        q = _nibble(w_ptr, base + fields + 4, j, mask) | (high << 4)
        if QTYPE == 6:
            w = _half(h_ptr, base, mask) * (q - 16).to(tl.float32)
        else:
            w = _half(h_ptr, base, mask) * q.to(tl.float32) + _half(h_ptr, base + 2, mask)
    return w


@triton.jit
def _k_scale_min(w_ptr, scales, sub, mask):
    """Q4_K's / Q5_K's 6-bit scale and min of sub-block ``sub`` from the 12 bytes at ``scales``."""
    first = sub < 4
    b1 = _byte(w_ptr, scales + tl.where(first, sub, sub + 4), mask)
    b2 = _byte(w_ptr, scales + tl.where(first, sub + 4, sub - 4), mask)
    b3 = _byte(w_ptr, scales + sub, mask)
    scale = tl.where(first, b1 & 63, (b1 & 0xF) | ((b2 >> 6) << 4)).to(tl.float32)
    minimum = tl.where(first, b2 & 63, (b1 >> 4) | ((b3 >> 6) << 4)).to(tl.float32)
    return scale, minimum


@triton.jit
def _decode_k(w_ptr, h_ptr, row, k, mask, QTYPE: tl.constexpr):
    """fp32 weights of the 256-weight types (the K-quants and IQ4_XS): weight ``e`` of its
    block, ``lane`` its place in its 32-weight run, ``run`` that run's 2-bit field."""
    e = k % 256
    lane = e % 32
    run = (e % 128) // 32
    if QTYPE == 10:  # Q2_K
        base = row + (k // 256) * 84
        q = (_byte(w_ptr, base + 16 + 32 * (e // 128) + lane, mask) >> (2 * run)) & 3
        sm = _byte(w_ptr, base + e // 16, mask)
        d = _half(h_ptr, base + 80, mask) * (sm & 0xF).to(tl.float32)
        w = d * q.to(tl.float32) - _half(h_ptr, base + 82, mask) * (sm >> 4).to(tl.float32)
    elif QTYPE == 11:  # Q3_K
        base = row + (k // 256) * 110
        low = (_byte(w_ptr, base + 32 + 32 * (e // 128) + lane, mask) >> (2 * run)) & 3
        high = (_byte(w_ptr, base + lane, mask) >> (e // 32)) & 1
        s = e // 16
        scale = ((_byte(w_ptr, base + 96 + s % 8, mask) >> (4 * (s // 8))) & 0xF) | (
            ((_byte(w_ptr, base + 104 + s % 4, mask) >> (2 * (s // 4))) & 3) << 4
        )
        d = _half(h_ptr, base + 108, mask) * (scale - 32).to(tl.float32)
        w = d * (low - 4 + 4 * high).to(tl.float32)
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K
        sub = e // 32
        base = row + (k // 256) * (144 if QTYPE == 12 else 176)
        qs = base + (16 if QTYPE == 12 else 48) + (e // 64) * 32 + lane
        q = (_byte(w_ptr, qs, mask) >> ((sub % 2) * 4)) & 0xF
        if QTYPE == 13:
            q = q | (((_byte(w_ptr, base + 16 + lane, mask) >> sub) & 1) << 4)
        scale, minimum = _k_scale_min(w_ptr, base + 4, sub, mask)
        d = _half(h_ptr, base, mask) * scale
        w = d * q.to(tl.float32) - _half(h_ptr, base + 2, mask) * minimum
    elif QTYPE == 14:  # Q6_K
        base = row + (k // 256) * 210
        half = e // 128
        low = (
            _byte(w_ptr, base + 64 * half + 32 * (run % 2) + lane, mask) >> (4 * (run // 2))
        ) & 0xF
        high = (_byte(w_ptr, base + 128 + 32 * half + lane, mask) >> (2 * run)) & 3
        scale = _signed(_byte(w_ptr, base + 192 + e // 16, mask)).to(tl.float32)
        w = (_half(h_ptr, base + 208, mask) * scale) * ((low | (high << 4)) - 32).to(tl.float32)
    else:  # IQ4_XS
        base = row + (k // 256) * 136
        sub = e // 32
        q = _nibble(w_ptr, base + 8 + 16 * sub, lane, mask)
        scale = ((_byte(w_ptr, base + 4 + sub // 2, mask) >> (4 * (sub % 2))) & 0xF) | (
            ((_byte(w_ptr, base + 2 + sub // 4, mask) >> (2 * (sub % 4))) & 3) << 4
        )
        d = _half(h_ptr, base, mask) * (scale - 32).to(tl.float32)
        w = d * _iq4_level(q).to(tl.float32)
    return w


@triton.jit
def _decode_tile(w_ptr, h_ptr, row, k, mask, QTYPE: tl.constexpr):
    """fp32 weights of the tile: ``row`` is each element's row start (bytes, or elements for
    the float types), ``k`` its input feature."""
    if QTYPE == 0:  # F32
        w = tl.load(w_ptr + row + k, mask=mask, other=0.0)
    elif QTYPE == 1:  # F16
        w = tl.load(w_ptr + row + k, mask=mask, other=0.0).to(tl.float32)
    elif QTYPE == 30:  # BF16: the top half of an fp32
        bits = tl.load(w_ptr + row + k, mask=mask, other=0).to(tl.int32) & 0xFFFF
        w = (bits << 16).to(tl.float32, bitcast=True)
    elif QTYPE == 2 or QTYPE == 3 or QTYPE == 6 or QTYPE == 7 or QTYPE == 8 or QTYPE == 20:
        w = _decode_32(w_ptr, h_ptr, row, k, mask, QTYPE)
    else:
        w = _decode_k(w_ptr, h_ptr, row, k, mask, QTYPE)
    return w


@triton.jit(do_not_specialize=["M", "N", "K", "ROW_STRIDE"])
def _gguf_linear_kernel(
    x_ptr, w_ptr, h_ptr, bias_ptr, out_ptr,
    M, N, K, ROW_STRIDE,
    stride_xm, stride_om,
    QTYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program per (BLOCK_M rows of x) x (BLOCK_N output rows of W) tile. ``ROW_STRIDE``
    is a weight row's length in ``w_ptr``'s elements (bytes for the block types). The sizes
    are not specialised: the weight is gathered byte by byte, so their divisibility buys no
    wider loads, and one variant per type, dtype and tile serves every layer."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = cols.to(tl.int64)[None, :] * ROW_STRIDE
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = col_ok[None, :] & k_ok[:, None]
        w = _decode_tile(w_ptr, h_ptr, w_rows, k[:, None], w_mask, QTYPE).to(x.dtype)
        if IEEE_FP32:  # fp32 models get fp32 products, not tf32's 10-bit mantissa
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


_FLOAT_VIEWS = {F32: torch.float32, F16: torch.float16, BF16: torch.int16}


def gguf_tile_shape(m: int, dtype: torch.dtype, qtype: int) -> tuple[int, int, int]:
    """weight_only_linear's tiles, but half as deep along K for the block types in 16-bit:
    decoding a 64 x 64 tile of Q6_K keeps a dozen integers live per weight and spilled
    registers on sm90 (the compile check's table)."""
    block_m, block_n, block_k = tile_shape(m, dtype)
    if qtype not in _FLOAT_VIEWS:
        block_k = min(block_k, 32)
    return block_m, block_n, block_k


def _weight_views(qweight: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The pointers the kernel reads: the rows in their element type (float types) or as
    bytes with an fp16 view of the same bytes beside them (block types; every fp16 in a
    block sits at an even offset of an even-sized block), and a row's length in elements."""
    if qtype in _FLOAT_VIEWS:
        w = qweight.view(_FLOAT_VIEWS[qtype])
        return w, w, w.shape[1]
    return qweight, qweight.view(torch.float16), qweight.shape[1]


def gguf_linear_triton(
    x: torch.Tensor, qweight: torch.Tensor, qtype: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Launch wrapper: ``x`` is ``[..., K]``, ``qweight`` the ``uint8 [N, row_bytes]`` rows."""
    t = gguf_type(qtype)
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.stride(-1) != 1:
        raise ValueError("gguf_linear: qweight must be contiguous uint8 [N, row_bytes] rows")
    n, nbytes = qweight.shape
    k = x.shape[-1]
    if nbytes != k // t.block_size * t.block_bytes or k % t.block_size:
        raise ValueError(f"gguf_linear: {nbytes} bytes of {t.name} per row do not hold {k} inputs")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w, h, row_stride = _weight_views(qweight.contiguous(), qtype)
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if out.numel():
        block_m, block_n, block_k = gguf_tile_shape(m, x.dtype, qtype)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _gguf_linear_kernel[grid](
            x2, w, h, bias if bias is not None else x2, out,
            m, n, k, row_stride, x2.stride(0), out.stride(0),
            QTYPE=qtype, HAS_BIAS=bias is not None, IEEE_FP32=x.dtype == torch.float32,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)


def gguf_linear_ref(
    x: torch.Tensor, qweight: torch.Tensor, qtype: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference: decode every block to fp32, round to the activations' dtype, one fp32 GEMM."""
    weight = gguf_dequantize_ref(qweight, qtype).to(x.dtype).float()
    out = torch.nn.functional.linear(x.float(), weight)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@cache
def _numba_gemm() -> ModuleType:
    """The CPU's GGUF GEMM (cpu/gguf_linear.py), imported on the first CPU call (numba is not
    loaded on a GPU)."""
    from pagedserve.kernels.cpu import gguf_linear as cpu_gguf_linear

    return cpu_gguf_linear


def gguf_linear(
    x: torch.Tensor, qweight: torch.Tensor, qtype: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x W^T + bias`` for GGUF rows: Triton on a GPU; on a CPU the numba GEMM from the blocks
    for fp32 activations (cpu/gguf_linear.py), else the reference."""
    path = kernel_path(x, has_numba=True)
    if path == "triton":
        return gguf_linear_triton(x, qweight, qtype, bias)
    if path == "numba" and x.dtype is torch.float32:
        return _numba_gemm().gguf_linear_numba(x, qweight, qtype, bias)
    return gguf_linear_ref(x, qweight, qtype, bias)
