"""fp8 e4m3 KV cache elements (``--kv-cache-dtype fp8``): one byte a key or value element.

An e4m3fn byte is a sign bit, 4 exponent bits (bias 7) and 3 mantissa bits: magnitudes from
2^-9 (subnormal) to 448, no infinity, ``0x7f`` / ``0xff`` NaN. A cache of them holds four times
the tokens of an fp32 cache in the same memory, at a relative rounding error of up to 1/16.

The cache tensors are ``torch.float8_e4m3fn``, so the block size in bytes, the transfer
records and ``.float()`` in the references see what they hold. Kernels read and write them as
their bytes (:func:`cache_bits`): torch has no fp8 ``index_copy_`` on a CPU, numba has no fp8
type, and Triton converts fp8 in hardware only from sm89 on, so the Triton kernels here encode
and decode the bits with integer arithmetic, on every GPU (the numba path does the same in
cpu/half.py).

Writing rounds to nearest even and **saturates** at ±448, as vLLM's fp8 KV cache does; the
per-tensor scale is 1.0, vLLM's when a checkpoint carries no calibrated ``k_scale`` /
``v_scale``. Reading widens the byte to fp32 exactly; attention computes in fp32. All three
writers (the reference, Triton, numba) give torch's bits for the saturated value
(``torch.clamp(x, -448, 448).to(torch.float8_e4m3fn)``): kernels/test_kv_fp8.py and
tests/kernels/test_numba_fp8_elements.py hold them to it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_CACHE_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds fp8 e4m3 elements."""
    return cache.dtype == FP8_CACHE_DTYPE


def cache_bits(cache: torch.Tensor) -> torch.Tensor:
    """The cache as its bytes (a view) when it holds fp8, else the cache itself."""
    return cache.view(torch.uint8) if is_fp8(cache) else cache


def float32_to_e4m3_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference: ``x`` rounded to e4m3 (saturated at ±448), as uint8 bytes."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(FP8_CACHE_DTYPE).view(torch.uint8)


@triton.jit
def e4m3_to_float32(bits):
    """e4m3fn bytes (uint8) as fp32, exactly. A normal byte's exponent and mantissa, moved to
    fp32's places, need the bias 127 - 7 = 120 added to the exponent (``+ (120 << 3)`` before
    the shift); a subnormal one is its mantissa times 2^-9."""
    b = bits.to(tl.int32)
    magnitude = b & 0x7F
    normal = ((magnitude + (120 << 3)) << 20).to(tl.float32, bitcast=True)
    subnormal = (magnitude & 7).to(tl.float32) * 0.001953125
    value = tl.where(magnitude < 8, subnormal, normal)
    value = tl.where(magnitude == 0x7F, float("nan"), value)
    return tl.where((b & 0x80) != 0, -value, value)


@triton.jit
def e4m3_to_float16(bits):
    """e4m3fn bytes (uint8) as fp16, exactly, for the tensor-core dots of a 16-bit query: the
    byte's exponent and mantissa moved up 7 bits are an fp16 whose exponent is biased by 15
    instead of 7, so times 2^8 it is the byte's value, subnormals included (fp16's subnormal
    scaled up). Fewer registers than widening a tile to fp32 first (llama's head_dim 128
    spilled on sm80 that way). NaN bytes read as ±480: never written (the writer saturates)."""
    b = bits.to(tl.int16)
    half = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True)
    return half * 256.0


@triton.jit
def float32_to_e4m3(x):
    """fp32 as e4m3fn bytes (uint8): saturated at ±448, rounded to nearest even, NaN to NaN.
    Integer arithmetic on the fp32 bits (int32 throughout, no shift past 30)."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    sign = tl.where(bits < 0, 0x80, 0)
    a = bits & 0x7FFFFFFF
    is_nan = a > 0x7F800000
    a = tl.minimum(a, 0x43E00000)  # 448's bits: fp32 bits order as magnitudes do
    # Normal (|x| >= 2^-6): round away 20 mantissa bits, then rebias the exponent.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal: |x| * 2^9, rounded to an integer (8 is the smallest normal, 0x08).
    mantissa = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - (a >> 23), 21), 30)  # the normal range's is unused
    kept = mantissa >> shift
    rest = mantissa & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    subnormal = kept + ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int32)
    magnitude = tl.where(a >= 0x3C800000, normal, subnormal)
    magnitude = tl.where(is_nan, 0x7F, magnitude)
    return (sign | magnitude).to(tl.uint8)
