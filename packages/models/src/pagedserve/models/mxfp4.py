"""MXFP4 weights (the OCP microscaling 4-bit float format), as gpt-oss's checkpoints store their
experts; dequantized at load, or held packed on a GPU.

A block of 32 consecutive weights along a row's input features shares one scale, an E8M0
byte: the power of two ``2 ** (byte - 127)``. Each weight is an FP4 E2M1 code (a sign, two
exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two to a
byte, the low nibble first. gpt-oss stores, per projection of every expert, ``<name>_blocks
[E, out, in / 32, 16]`` (uint8: 32 codes in 16 bytes) and ``<name>_scales [E, out, in / 32]``
(uint8), its quantization_config naming ``quant_method: "mxfp4"``; transformers dequantizes
them the same way when it runs without the MXFP4 kernels (``Mxfp4Dequantize``).

On the Triton kernels (a GPU) and one rank, pagedserve keeps the experts as stored and
fused_moe decodes each tile in registers (kernels/mxfp4.py; gpt_oss.holds_mxfp4): gpt-oss-120b's
experts take ~61 GB. Elsewhere (a CPU, several ranks, a GGUF's experts) it dequantizes to the
model's dtype at load (here): gpt-oss-20b's experts take ~38 GB in bf16, 120b's ~229 GB.

llama.cpp's GGUF files hold the same format as ggml's type ``MXFP4`` (``dequantize_gguf_mxfp4``):
each 32-weight block is 17 bytes, the scale byte first, then 16 bytes whose byte ``j`` holds
weight ``j`` in its low nibble and weight ``j + 16`` in its high one (Q4_0's order, not the
checkpoint's pairs). llama.cpp's converter moves the checkpoint's bits into that layout without
rounding anything again, so a GGUF's experts decode to the very weights of the release.

``quantize_mxfp4`` is the inverse, for tests and tools that write such checkpoints.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.mxfp4 import FP4_E2M1_VALUES, MXFP4_BLOCK, dequantize_mxfp4_ref
from pagedserve.models.config import ModelLoadError

GGML_MXFP4 = 39  # ggml's type id for MXFP4 (gguf's GGMLQuantizationType.MXFP4)
GGML_MXFP4_BLOCK_BYTES = 1 + MXFP4_BLOCK // 2  # the scale, then 32 codes in 16 bytes


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``blocks [..., G, 16]`` (uint8, two FP4 codes a byte, low nibble first) and ``scales
    [..., G]`` (uint8 E8M0) -> ``[..., G * 32]`` weights in ``dtype``: each code's value times
    its block's power of two."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ModelLoadError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: "
            f"expected blocks [..., G, {MXFP4_BLOCK // 2}] beside scales [..., G]"
        )
    return dequantize_mxfp4_ref(blocks, scales, dtype)


def dequantize_gguf_mxfp4(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """GGUF rows of ggml MXFP4 blocks, ``uint8 [N, G * 17]``, -> ``[N, G * 32]`` in ``dtype``.

    Each block's codes are put back in the checkpoint's pairs (code ``2j`` low, ``2j + 1``
    high) and decoded by ``dequantize_mxfp4``: one definition of the values for both layouts.
    """
    n, row_bytes = rows.shape
    if rows.dtype != torch.uint8 or row_bytes % GGML_MXFP4_BLOCK_BYTES:
        raise ModelLoadError(
            f"GGUF MXFP4 rows must be uint8 blocks of {GGML_MXFP4_BLOCK_BYTES} bytes, got "
            f"{rows.dtype} rows of {row_bytes} bytes"
        )
    blocks = rows.reshape(n, -1, GGML_MXFP4_BLOCK_BYTES)
    scales, packed = blocks[..., 0], blocks[..., 1:]
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1)  # [N, G, 32], in weight order
    paired = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return dequantize_mxfp4(paired, scales, dtype).reshape(n, -1)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., K]`` (K a multiple of 32) -> (``blocks [..., K / 32, 16]``, ``scales
    [..., K / 32]``): each block's scale the smallest power of two that brings its largest
    magnitude within 6 (E2M1's largest), each weight the nearest code (ties to the first)."""
    if weight.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs input features in blocks of {MXFP4_BLOCK}: {weight.shape}")
    w = weight.float().unflatten(-1, (-1, MXFP4_BLOCK))  # [..., G, 32]
    amax = w.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponents = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = torch.ldexp(w, -exponents.to(torch.int32)[..., None])
    lut = torch.tensor(FP4_E2M1_VALUES[:8], dtype=torch.float32)
    magnitude = (scaled.abs()[..., None] - lut).abs().argmin(dim=-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)  # sign bit: 8
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponents + 127).to(torch.uint8)
