"""Weight-only 8-bit linear layers: ``y = x (s * Q)^T + b`` with 8-bit weights ``Q``.

The weight ``Q`` is ``[N, K]`` in int8 (symmetric, -127..127) or in fp8 e4m3 (OCP's
"e4m3fn": no infinities, largest 448), with one fp32 scale per output channel ``s[N]``
(a per-tensor scale is that scale repeated). Activations stay in the model's dtype; the
weight is widened inside the kernel, so the 8-bit bytes are all that is read from memory.
A decode step is memory-bound, so halving (fp16) or quartering (fp32) the bytes read is
where weight-only quantization pays on a GPU.

Because the scale is per output channel it factors out of the dot product:
``sum_k x[m, k] * s[n] * Q[n, k] = s[n] * sum_k x[m, k] * Q[n, k]``. The kernel
accumulates ``x Q^T`` in fp32 and scales each column once at the end.

fp8 weights reach the kernel as their raw bytes (uint8) and are decoded with integer and
float arithmetic (sign, 4 exponent bits with bias 7, 3 mantissa bits, subnormals at exponent
0). That decoding is exact and compiles for every target, including GPUs before sm89 that
have no fp8 conversion instructions, and runs under Triton's interpreter (numpy has no fp8).
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import kernel_path

WeightFormat = Literal["int8", "fp8"]
FP8_MAX = 448.0  # largest finite e4m3fn value
INT8_MAX = 127.0


@triton.jit
def _decode_e4m3(bits):
    """fp8 e4m3fn bytes (as uint8) -> fp32. NaN bytes (0x7f, 0xff) are never written here."""
    bits = bits.to(tl.int32)
    sign = tl.where((bits & 0x80) != 0, -1.0, 1.0)
    exponent = (bits >> 3) & 0xF
    mantissa = (bits & 0x7).to(tl.float32)
    normal = (1.0 + mantissa / 8.0) * tl.exp2((exponent - 7).to(tl.float32))
    subnormal = mantissa / 8.0 * (1.0 / 64.0)  # 2^-6 * m / 8
    return sign * tl.where(exponent == 0, subnormal, normal)


@triton.jit(do_not_specialize=["M"])
def _weight_only_linear_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr,
    FP8: tl.constexpr,
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
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0)
        if FP8:
            w = _decode_e4m3(w)
        # int8 and e4m3 values are exact in fp16, bf16 and fp32: widening loses nothing.
        w = w.to(x.dtype)
        if IEEE_FP32:  # fp32 models get fp32 products, not tf32's 10-bit mantissa
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def weight_format(qweight: torch.Tensor) -> WeightFormat:
    if qweight.dtype == torch.int8:
        return "int8"
    if qweight.dtype == torch.float8_e4m3fn:
        return "fp8"
    raise ValueError(
        f"weight-only linear: weights must be int8 or float8_e4m3fn, not {qweight.dtype}"
    )


def tile_shape(m: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 16 rows (tl.dot's minimum) for decode-sized batches, 64
    for prefill. fp32 multiplies on CUDA cores, not tensor cores, and its operand tiles take
    registers: half the rows and a quarter of the K depth keep it from spilling (the compile
    check's table). With ``M`` unspecialised that is two variants per layer shape and dtype."""
    if dtype == torch.float32:
        return (16 if m <= 16 else 32), 64, 16
    return (16 if m <= 16 else 64), 64, 64


def weight_only_linear_triton(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Launch wrapper: ``x`` is ``[..., K]``, ``qweight`` ``[N, K]``, ``scale`` fp32 ``[N]``."""
    fp8 = weight_format(qweight) == "fp8"
    n, k = qweight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = qweight.view(torch.uint8) if fp8 else qweight
    if w.stride(-1) != 1:
        w = w.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    m = x2.shape[0]
    if out.numel():
        block_m, block_n, block_k = tile_shape(m, x.dtype)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _weight_only_linear_kernel[grid](
            x2, w, scale, bias if bias is not None else scale, out,
            m, n, k, x2.stride(0), w.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, FP8=fp8, IEEE_FP32=x.dtype == torch.float32,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)


def weight_only_linear_ref(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference: widen the weight, multiply in fp32, scale each output channel, add the bias."""
    weight_format(qweight)
    out = torch.nn.functional.linear(x.float(), qweight.float()) * scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def weight_only_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x (scale * qweight)^T + bias``; Triton on a GPU; on a CPU the numba GEMM from the
    8-bit bytes for fp32 activations (cpu/weight_only_linear.py), else the reference."""
    path = kernel_path(x, has_numba=True)
    if path == "triton":
        return weight_only_linear_triton(x, qweight, scale, bias)
    if path == "numba" and x.dtype is torch.float32:
        from pagedserve.kernels.cpu.weight_only_linear import weight_only_linear_numba

        return weight_only_linear_numba(x, qweight, scale, bias)
    return weight_only_linear_ref(x, qweight, scale, bias)


def quantize_per_channel(
    weight: torch.Tensor, fmt: WeightFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization of a ``[N, K]`` weight: the scale maps each
    row's largest magnitude onto the format's largest value. Returns ``(qweight, scale)``."""
    w = weight.float()
    top = INT8_MAX if fmt == "int8" else FP8_MAX
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / top
    scaled = w / scale[:, None]
    if fmt == "int8":
        qweight = scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        qweight = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return qweight, scale
