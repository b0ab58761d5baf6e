"""GGUF's block types, and the PyTorch decoders that turn their bytes back into fp32.

A GGUF matrix ``[N, K]`` (N output rows, K input features) is stored row by row; each row is
``K / block_size`` blocks laid end to end, so a row is ``row_bytes(qtype, K)`` bytes and the
whole matrix is a ``uint8 [N, row_bytes]`` tensor. Blocks run along the input dimension:
permuting or slicing rows never splits a block, and a slice along K is whole blocks when it
starts and ends on a multiple of the block size.

The layouts (llama.cpp's ``ggml-common.h``; fp16 ``d`` / ``m`` / ``dmin`` are little-endian
halves; "nibbles as Q4_0" means byte ``j`` of 16 holds weight ``j`` in its low nibble and
weight ``j + 16`` in its high nibble):

- ``Q8_0``: 32 weights in 34 bytes: ``d``, then 32 int8 ``q``; ``w = d * q``.
- ``Q4_0``: 32 weights in 18 bytes: ``d``, 16 bytes of nibbles; ``w = d * (q - 8)``.
- ``Q4_1``: 32 weights in 20 bytes: ``d``, ``m``, 16 bytes of nibbles; ``w = d * q + m``.
- ``Q5_0``: 32 weights in 22 bytes: ``d``, a little-endian uint32 ``qh`` whose bit ``j`` is
  weight ``j``'s fifth bit, 16 bytes of nibbles (the low four bits); ``w = d * (q - 16)``.
- ``Q5_1``: 32 weights in 24 bytes: ``d``, ``m``, ``qh``, nibbles as Q5_0; ``w = d * q + m``.
- ``IQ4_NL``: 32 weights in 18 bytes, laid out as Q4_0; a nibble indexes a fixed table of 16
  non-uniform int8 levels (``IQ4_LEVELS``): ``w = d * level[q]``.
- The K-quants hold 256 weights in sub-blocks of 16 or 32, each with a small integer scale
  (and min) under the block's fp16 ``d`` (and ``dmin``). Their quant bits are packed in runs
  of 32 weights, each run one bit field of 32 consecutive bytes, so that consecutive weights
  of a run sit in consecutive bytes.
- ``Q2_K``: 84 bytes: 16 bytes of scales (per 16 weights: the scale in the low nibble, the
  min in the high one), 64 bytes of 2-bit ``q`` (weight ``128 h + 32 s + l`` is bits
  ``2s, 2s + 1`` of byte ``32 h + l``), ``d``, ``dmin``; ``w = d * scale * q - dmin * min``.
- ``Q3_K``: 110 bytes: 32 bytes ``hmask``, 64 bytes of 2-bit low bits (as Q2_K), 12 bytes of
  sixteen 6-bit scales, ``d``. Weight ``e = 32 i + l`` takes bit ``i`` of ``hmask[l]``;
  ``q = low - 4`` when that bit is 0, ``low`` when it is 1. Scale ``j`` (per 16 weights):
  low four bits from the low (``j < 8``) or high nibble of byte ``j % 8``, top two bits
  from bits ``2 (j / 4)`` of byte ``8 + j % 4``, minus 32; ``w = d * scale * q``.
- ``Q4_K``: 256 weights in 144 bytes: ``d``, ``dmin``, 12 bytes holding eight 6-bit scales and
  eight 6-bit mins (one per 32-weight sub-block: sub-blocks 0-3 in the low 6 bits of bytes
  0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in the nibbles of bytes 8-11, low for the scale,
  high for the min, with their top two bits in the top bits of bytes 0-3 (scales) and 4-7
  (mins)), then 128 bytes of nibbles: each 32-byte run holds sub-block ``2c`` in its low
  nibbles and ``2c + 1`` in its high nibbles; ``w = d * scale * q - dmin * min``.
- ``Q5_K``: 176 bytes: ``d``, ``dmin``, the 12 scale bytes of Q4_K, 32 bytes ``qh`` (weight
  ``32 j + l`` takes bit ``j`` of ``qh[l]`` as its fifth bit), the 128 nibble bytes of Q4_K.
- ``Q6_K``: 256 weights in 210 bytes: 128 bytes ``ql`` (low 4 bits), 64 bytes ``qh`` (high 2
  bits), 16 int8 scales (one per 16 weights), ``d``. Each 128-weight half ``h`` uses
  ``ql[64h : 64h + 64]`` and ``qh[32h : 32h + 32]``; its weight ``32g + l`` (``g`` 0..3, ``l``
  0..31) takes the low (g < 2) or high (g >= 2) nibble of ``ql[32 (g % 2) + l]`` and bits
  ``2g, 2g + 1`` of ``qh[l]``; ``w = d * scale[e / 16] * (q - 32)``.
- ``IQ4_XS``: 136 bytes: ``d``, a little-endian uint16 of the eight scales' top two bits
  (bits ``2j, 2j + 1``), 4 bytes of their low nibbles (scale ``j`` in nibble ``j % 2`` of
  byte ``j / 2``), 128 bytes: sub-block ``j``'s 32 weights in bytes ``[16 j, 16 j + 16)``,
  nibbles as Q4_0; ``w = d * (scale - 32) * level[q]``.
- ``F32``, ``F16``, ``BF16``: one weight per 4, 2, 2 bytes.

Each decoder computes in fp32 in the order gguf's own ``dequantize`` does (the scale
products first), so the two agree bit for bit.

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
        GGUFType("Q5_0", 6, 32, 22),
        GGUFType("Q5_1", 7, 32, 24),
        GGUFType("Q8_0", 8, 32, 34),
        GGUFType("Q2_K", 10, 256, 84),
        GGUFType("Q3_K", 11, 256, 110),
        GGUFType("Q4_K", 12, 256, 144),
        GGUFType("Q5_K", 13, 256, 176),
        GGUFType("Q6_K", 14, 256, 210),
        GGUFType("IQ4_NL", 20, 32, 18),
        GGUFType("IQ4_XS", 23, 256, 136),
        GGUFType("BF16", 30, 1, 2),
    )
}
GGUF_TYPE_IDS = {t.name: t.type_id for t in GGUF_TYPES.values()}
# IQ4_NL's and IQ4_XS's 16 levels, indexed by a nibble (ggml's kvalues_iq4nl)
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


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


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """``[blocks, 4]`` bytes of a little-endian uint32 -> ``[blocks, 32]`` bits ``j`` as 16."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh[:, :, None] >> shifts) & 1).reshape(-1, 32) << 4


def _decode_q5_0(raw: torch.Tensor) -> torch.Tensor:
    q = _nibbles(raw[:, 6:]) | _fifth_bits(raw[:, 2:6])
    return _half(raw, 0) * (q.float() - 16.0)


def _decode_q5_1(raw: torch.Tensor) -> torch.Tensor:
    q = _nibbles(raw[:, 8:]) | _fifth_bits(raw[:, 4:8])
    return _half(raw, 0) * q.float() + _half(raw, 2)


def _levels(q: torch.Tensor) -> torch.Tensor:
    return torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=q.device)[q.long()]


def _decode_iq4_nl(raw: torch.Tensor) -> torch.Tensor:
    return _half(raw, 0) * _levels(_nibbles(raw[:, 2:]))


def _crumbs(packed: torch.Tensor) -> torch.Tensor:
    """``[blocks, 64]`` bytes of 2-bit fields -> ``[blocks, 256]`` in the K-quants' order:
    128-weight half ``h``, field ``s`` (bits ``2s, 2s + 1``), byte ``l`` of the half's 32."""
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=packed.device).view(1, 1, 4, 1)
    return ((packed.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 256)


def _decode_q2_k(raw: torch.Tensor) -> torch.Tensor:
    scales = raw[:, :16]
    dl = (_half(raw, 80) * (scales & 0xF).float())[:, :, None]
    ml = (_half(raw, 82) * (scales >> 4).float())[:, :, None]
    q = _crumbs(raw[:, 16:80]).reshape(-1, 16, 16).float()
    return (dl * q - ml).reshape(-1, 256)


def _decode_q3_k(raw: torch.Tensor) -> torch.Tensor:
    s = raw[:, 96:108]
    low = torch.cat([s[:, :8] & 0xF, s[:, :8] >> 4], dim=-1)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=raw.device).view(1, 4, 1)
    high = ((s[:, None, 8:12] >> shifts) & 3).reshape(-1, 16)
    scale = (low | (high << 4)).float() - 32.0
    bits = torch.arange(8, dtype=torch.uint8, device=raw.device).view(1, 8, 1)
    hmask = ((raw[:, None, :32] >> bits) & 1).reshape(-1, 256)
    q = _crumbs(raw[:, 32:96]).float() - 4.0 * (1 - hmask).float()
    return ((_half(raw, 108) * scale)[:, :, None] * q.reshape(-1, 16, 16)).reshape(-1, 256)


def _k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 scale bytes -> the eight 6-bit scales and mins, as fp32."""
    s = s.to(torch.int32)
    s_lo, s_mid, s_hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat([s_lo & 63, (s_hi & 0xF) | ((s_lo >> 6) << 4)], dim=-1).float()
    minimum = torch.cat([s_mid & 63, (s_hi >> 4) | ((s_mid >> 6) << 4)], dim=-1).float()
    return scale, minimum


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> ``[blocks, 8, 32]``: run ``c``'s low nibbles are sub-block ``2c``."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat([qs & 0xF, qs >> 4], dim=2).reshape(-1, 8, 32)


def _decode_q4_k(raw: torch.Tensor) -> torch.Tensor:
    scale, minimum = _k_scales_mins(raw[:, 4:16])
    d = (_half(raw, 0) * scale)[:, :, None]
    dm = (_half(raw, 2) * minimum)[:, :, None]
    return (d * _k_nibbles(raw[:, 16:]).float() - dm).reshape(-1, 256)


def _decode_q5_k(raw: torch.Tensor) -> torch.Tensor:
    scale, minimum = _k_scales_mins(raw[:, 4:16])
    bits = torch.arange(8, dtype=torch.uint8, device=raw.device).view(1, 8, 1)
    high = ((raw[:, None, 16:48] >> bits) & 1) << 4  # [blocks, sub-block j, l]
    q = (_k_nibbles(raw[:, 48:]) | high).float()
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


def _decode_iq4_xs(raw: torch.Tensor) -> torch.Tensor:
    high_bits = raw[:, 2:4].contiguous().view(torch.int16).to(torch.int32)[:, :1] & 0xFFFF
    high = (high_bits >> torch.arange(0, 16, 2, device=raw.device)) & 3
    low = torch.stack([raw[:, 4:8] & 0xF, raw[:, 4:8] >> 4], dim=-1).reshape(-1, 8)
    scale = (low.to(torch.int32) | (high << 4)).float() - 32.0
    q = _levels(_nibbles(raw[:, 8:].reshape(-1, 16)).reshape(-1, 8, 32))
    return ((_half(raw, 0) * scale)[:, :, None] * q).reshape(-1, 256)


_DECODERS = {
    "Q8_0": _decode_q8_0,
    "Q4_0": _decode_q4_0,
    "Q4_1": _decode_q4_1,
    "Q5_0": _decode_q5_0,
    "Q5_1": _decode_q5_1,
    "IQ4_NL": _decode_iq4_nl,
    "Q2_K": _decode_q2_k,
    "Q3_K": _decode_q3_k,
    "Q4_K": _decode_q4_k,
    "Q5_K": _decode_q5_k,
    "Q6_K": _decode_q6_k,
    "IQ4_XS": _decode_iq4_xs,
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
