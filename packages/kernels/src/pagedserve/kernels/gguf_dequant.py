"""GGUF's block types, and the PyTorch decoders that turn their bytes back into fp32.

A GGUF matrix ``[N, K]`` (N output rows, K input features) is stored row by row; each row is
``K / block_size`` blocks laid end to end, so a row is ``row_bytes(qtype, K)`` bytes and the
whole matrix is a ``uint8 [N, row_bytes]`` tensor. Blocks run along the input dimension:
permuting or slicing rows never splits a block, and a slice along K is whole blocks when it
starts and ends on a multiple of the block size.

The layouts (llama.cpp's ``ggml-common.h``; fp16 ``d`` / ``m`` are little-endian halves):

- ``Q8_0``: 32 weights in 34 bytes: ``d``, then 32 int8 ``q``; ``w = d * q``.
- ``Q4_0``: 32 weights in 18 bytes: ``d``, then 16 bytes of nibbles; byte ``j`` holds weight
  ``j`` in its low nibble and weight ``j + 16`` in its high nibble; ``w = d * (q - 8)``.
- ``Q4_1``: 32 weights in 20 bytes: ``d``, ``m``, 16 bytes of nibbles as Q4_0;
  ``w = d * q + m``.
- ``Q4_K``: 256 weights in 144 bytes: ``d``, ``dmin``, 12 bytes holding eight 6-bit scales and
  eight 6-bit mins (one per 32-weight sub-block: sub-blocks 0-3 in the low 6 bits of bytes
  0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in the nibbles of bytes 8-11, low for the scale,
  high for the min, with their top two bits in the top bits of bytes 0-3 (scales) and 4-7
  (mins)), then 128 bytes of nibbles: each 32-byte run holds sub-block ``2c`` in its low
  nibbles and ``2c + 1`` in its high nibbles; ``w = d * scale * q - dmin * min``.
- ``Q6_K``: 256 weights in 210 bytes: 128 bytes ``ql`` (low 4 bits), 64 bytes ``qh`` (high 2
  bits), 16 int8 scales (one per 16 weights), ``d``. Each 128-weight half ``h`` uses
  ``ql[64h : 64h + 64]`` and ``qh[32h : 32h + 32]``; its weight ``32g + l`` (``g`` 0..3, ``l``
  0..31) takes the low (g < 2) or high (g >= 2) nibble of ``ql[32 (g % 2) + l]`` and bits
  ``2g, 2g + 1`` of ``qh[l]``; ``w = d * scale[e / 16] * (q - 32)``.
- ``F32``, ``F16``, ``BF16``: one weight per 4, 2, 2 bytes.

Type ids are ggml's (``GGMLQuantizationType``), so a tensor's type from the file is used as
it is; this package never imports ``gguf`` (kernels import only torch and triton).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GGUFType:
    name: str
    type_id: int  # ggml's GGMLQuantizationType value
    block_size: int  # weights per block
    block_bytes: int  # bytes per block


GGUF_TYPES = {
    t.type_id: t
    for t in (
        GGUFType("F32", 0, 1, 4),
        GGUFType("F16", 1, 1, 2),
        GGUFType("Q4_0", 2, 32, 18),
        GGUFType("Q4_1", 3, 32, 20),
        GGUFType("Q8_0", 8, 32, 34),
        GGUFType("Q4_K", 12, 256, 144),
        GGUFType("Q6_K", 14, 256, 210),
        GGUFType("BF16", 30, 1, 2),
    )
}
GGUF_TYPE_IDS = {t.name: t.type_id for t in GGUF_TYPES.values()}


def gguf_type(qtype: int) -> GGUFType:
    if qtype not in GGUF_TYPES:
        names = ", ".join(t.name for t in GGUF_TYPES.values())
        raise ValueError(f"GGUF tensor type {qtype} is not supported; supported: {names}")
    return GGUF_TYPES[qtype]


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of ``k`` weights; ``k`` must be whole blocks."""
    t = gguf_type(qtype)
    if k % t.block_size:
        raise ValueError(f"a {t.name} row needs a multiple of {t.block_size} weights, not {k}")
    return k // t.block_size * t.block_bytes


def _half(raw: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte ``offset`` of each block (``raw`` is ``[blocks, block_bytes]``), as fp32."""
    return raw[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[blocks, 16]`` bytes -> ``[blocks, 32]``: the low nibbles, then the high ones."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _decode_q8_0(raw: torch.Tensor) -> torch.Tensor:
    return _half(raw, 0) * raw[:, 2:].view(torch.int8).float()


def _decode_q4_0(raw: torch.Tensor) -> torch.Tensor:
    return _half(raw, 0) * (_nibbles(raw[:, 2:]).float() - 8.0)


def _decode_q4_1(raw: torch.Tensor) -> torch.Tensor:
    return _half(raw, 0) * _nibbles(raw[:, 4:]).float() + _half(raw, 2)


def _decode_q4_k(raw: torch.Tensor) -> torch.Tensor:
    s = raw[:, 4:16].to(torch.int32)
    s_lo, s_mid, s_hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat([s_lo & 63, (s_hi & 0xF) | ((s_lo >> 6) << 4)], dim=-1).float()
    minimum = torch.cat([s_mid & 63, (s_hi >> 4) | ((s_mid >> 6) << 4)], dim=-1).float()
    qs = raw[:, 16:].reshape(-1, 4, 1, 32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=2).reshape(-1, 8, 32).float()  # sub-block 2c + hi
    d = (_half(raw, 0) * scale)[:, :, None]
    dm = (_half(raw, 2) * minimum)[:, :, None]
    return (d * q - dm).reshape(-1, 256)


def _decode_q6_k(raw: torch.Tensor) -> torch.Tensor:
    ql = raw[:, :128].reshape(-1, 2, 1, 2, 32)  # [half, nibble, a/b run, l]
    low = torch.cat([ql & 0xF, ql >> 4], dim=2).reshape(-1, 2, 4, 32)  # g = 2 * nibble + run
    qh = raw[:, 128:192].reshape(-1, 2, 1, 32).to(torch.int32)
    shifts = torch.arange(0, 8, 2, dtype=torch.int32, device=raw.device).view(1, 1, 4, 1)
    high = (qh >> shifts) & 3
    q = ((low.to(torch.int32) | (high << 4)) - 32).reshape(-1, 16, 16).float()
    scale = raw[:, 192:208].contiguous().view(torch.int8).float()
    d = (_half(raw, 208) * scale)[:, :, None]
    return (d * q).reshape(-1, 256)


_DECODERS = {
    "Q8_0": _decode_q8_0,
    "Q4_0": _decode_q4_0,
    "Q4_1": _decode_q4_1,
    "Q4_K": _decode_q4_k,
    "Q6_K": _decode_q6_k,
}
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def gguf_dequantize_ref(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """``uint8 [N, row_bytes]`` GGUF rows -> fp32 ``[N, K]``, vectorised over every block."""
    t = gguf_type(qtype)
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(
            f"GGUF rows must be a 2-D uint8 tensor, got {qweight.dtype} {qweight.dim()}-D"
        )
    n, nbytes = qweight.shape
    if nbytes % t.block_bytes:
        raise ValueError(f"{nbytes} bytes per row is not whole {t.name} blocks of {t.block_bytes}")
    k = nbytes // t.block_bytes * t.block_size
    raw = qweight.contiguous()
    if t.name in _FLOAT_DTYPES:
        return raw.view(_FLOAT_DTYPES[t.name]).float().reshape(n, k)
    return _DECODERS[t.name](raw.reshape(-1, t.block_bytes)).reshape(n, k)
