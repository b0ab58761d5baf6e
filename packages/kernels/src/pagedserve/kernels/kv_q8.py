"""q8_0 KV cache rows (``--kv-cache-dtype q8_0``): llama.cpp's 8-bit block format, in place.

Each head's key or value row of D elements is cut into groups of 32; a group keeps its scale
``d = max|x| / 127`` as fp16 and its elements as ``round(x * (1 / d))``, int8, rounded half
away from zero: llama.cpp's ``quantize_row_q8_0`` arithmetic, which gguf's Python ``quants``
reproduces bit for bit and tests/kernels/test_kv_q8_rows.py holds these rows to.
A row of the cache is the D int8 elements followed by the D / 32 scales (two bytes each,
little-endian), ``D + D / 16`` bytes: 1.0625 bytes an element, a quarter of fp32 plus the
scales, as llama.cpp's ``q8_0`` cache type holds it. The cache tensors are ``torch.int8``
``[num_blocks, block_size, Hkv, D + D / 16]``: a block is still a contiguous slab, so block
copies, offloading and transfers move it as they move any other.

Reading widens ``q * d`` exactly (an int8 times an fp16 is exact in fp32). A scale per 32
elements follows each group's own range, where fp8's per-tensor scale leaves small elements
to its subnormals: SmolLM2's greedy tokens under a q8_0 cache stay far closer to the fp32
cache's (docs/cpu.md has the table). Writers (this reference, the Triton kernel, numba)
compute ``d`` and ``1 / d`` in fp32 and round ``x * (1 / d)`` the same way, so they write the
same bytes for finite keys and values (kernels/test_kv_q8.py, tests/kernels/test_kv_q8_rows.py,
kernels/test_numba_layer_ops.py). A NaN makes its group's bytes undefined, and a group whose
largest value passes ~8.3e6 overflows its fp16 scale, as in llama.cpp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

Q8_CACHE_DTYPE = torch.int8
GROUP = 32


def is_q8(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds q8_0 rows."""
    return cache.dtype == Q8_CACHE_DTYPE


def row_width(head_dim: int) -> int:
    """Bytes of one head's q8_0 row: the elements, then a 2-byte scale per 32."""
    if head_dim % GROUP:
        raise ValueError(
            f"a q8_0 KV cache needs a head size that is a multiple of 32, not {head_dim}"
        )
    return head_dim + head_dim // 16


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size a cache holds (its last dimension, less a q8_0 row's scales)."""
    width = cache.shape[-1]
    return width * 16 // 17 if is_q8(cache) else width


def quantize_q8_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference: rows ``x [..., D]`` as q8_0 rows ``int8 [..., D + D / 16]``."""
    head_dim = x.shape[-1]
    groups = x.float().reshape(*x.shape[:-1], head_dim // GROUP, GROUP)
    d = groups.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    scaled = groups * inverse
    magnitude = scaled.abs()  # rounded half away from zero, exactly (ggml's roundf)
    whole = magnitude.floor()
    q = (scaled.sign() * (whole + (2 * (magnitude - whole)).floor())).to(torch.int32)
    scales = d.squeeze(-1).half().view(torch.int8).reshape(*x.shape[:-1], head_dim // 16)
    return torch.cat([q.to(torch.int8).reshape(x.shape), scales], dim=-1)


def dequantize_q8_ref(rows: torch.Tensor) -> torch.Tensor:
    """Reference: q8_0 rows ``int8 [..., W]`` widened to fp32 ``[..., D]``."""
    head_dim = rows.shape[-1] * 16 // 17
    q = rows[..., :head_dim].float().reshape(*rows.shape[:-1], head_dim // GROUP, GROUP)
    d = rows[..., head_dim:].contiguous().view(torch.float16).float()
    return (q * d.unsqueeze(-1)).reshape(*rows.shape[:-1], head_dim)


def widened(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows ``[..., W]`` as fp32 ``[..., D]``: q8_0 rows dequantized, others cast."""
    return dequantize_q8_ref(rows) if is_q8(rows) else rows.float()


def zeros_cache(shape: tuple[int, ...], dtype: torch.dtype, device=None) -> torch.Tensor:
    """A cache of ``shape [..., D]`` elements of ``dtype``, zeroed: q8_0 rows are wider."""
    if dtype == Q8_CACHE_DTYPE:
        shape = (*shape[:-1], row_width(shape[-1]))
    return torch.zeros(shape, dtype=dtype, device=device)


@triton.jit
def q8_scales(scale_ptrs, mask):
    """The fp32 scale of each element of a tile: ``scale_ptrs`` point at the low byte of its
    group's fp16 scale (the row's start + D + 2 * (d // 32)), the high byte after it."""
    low = tl.load(scale_ptrs, mask=mask, other=0).to(tl.int32) & 0xFF
    high = tl.load(scale_ptrs + 1, mask=mask, other=0).to(tl.int32) & 0xFF
    return (low | (high << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def quantize_q8(x, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``x [BLOCK_H, BLOCK_D]`` (padding zero) as q8_0: the int8 elements and each group's
    fp16 scale as int32 bits ``[BLOCK_H, BLOCK_D // 32]``; :func:`quantize_q8_ref`'s arithmetic
    (IEEE divisions: Triton's ``/`` is approximate on a GPU)."""
    groups = tl.reshape(x.to(tl.float32), [BLOCK_H, BLOCK_D // 32, 32])
    scale = tl.math.div_rn(tl.max(tl.abs(groups), axis=2), 127.0)
    nonzero = tl.where(scale > 0, scale, 1.0)  # no 1 / 0 computed, even where unused
    inverse = tl.where(
        scale > 0, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), nonzero), 0.0
    )
    scaled = groups * inverse[:, :, None]
    magnitude = tl.abs(scaled)  # rounded half away from zero, exactly (ggml's roundf)
    whole = tl.floor(magnitude)
    rounded = whole + tl.floor(2 * (magnitude - whole))
    q = tl.where(scaled < 0, -rounded, rounded).to(tl.int8)
    bits = scale.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return tl.reshape(q, [BLOCK_H, BLOCK_D]), bits
