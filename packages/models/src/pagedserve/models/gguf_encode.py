"""fp32 matrices -> GGUF blocks of any type pagedserve serves, for test files: no download.

The types the ``gguf`` package can encode (the float types, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)
are encoded by ``gguf.quants.quantize``. The K-quants and IQ4_NL / IQ4_XS it only decodes:
the encoders here round each weight to the nearest level under scales taken from the
block's range (llama.cpp searches for better scales; any valid blocks do for a test). Each
writes the layout pagedserve.kernels.gguf_dequant describes, and the tests read the files
back through transformers, i.e. through gguf's own decoders, so these layouts are checked
against an independent implementation.
"""

from __future__ import annotations

import numpy as np

IQ4_LEVELS = np.array(
    (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), np.float32
)


def _fp16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to fp16 (the value a block's scale field will hold), kept as fp32."""
    return x.astype(np.float16).astype(np.float32)


def _halves(*fields: np.ndarray) -> list[np.ndarray]:
    """Each ``[blocks]`` fp32 field as its ``[blocks, 2]`` fp16 bytes."""
    return [f.astype(np.float16).view(np.uint8).reshape(-1, 2) for f in fields]


def _crumbs(q: np.ndarray) -> np.ndarray:
    """``[blocks, 256]`` 2-bit values -> 64 bytes: weight ``128 h + 32 s + l`` in bits
    ``2s, 2s + 1`` of byte ``32 h + l``."""
    q = q.reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _bit_planes(bits: np.ndarray) -> np.ndarray:
    """``[blocks, 8, 32]`` bits -> 32 bytes: bit ``i`` of byte ``l`` is ``bits[i, l]``."""
    return (bits << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """``[..., 32]`` nibbles -> ``[..., 16]`` bytes: ``j`` low, ``j + 16`` high (Q4_0's order)."""
    return q[..., :16] | (q[..., 16:] << 4)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block -> Q4_K's / Q5_K's 12 bytes."""
    return np.concatenate(
        [sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
         (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)], axis=-1,
    )  # fmt: skip


def _scale_min_quants(x: np.ndarray, levels: int, scale_max: int):
    """Per sub-block (``x`` is ``[blocks, subs, n]``) ``x ~ d * sc * q - dmin * mn``: ``q`` in
    ``0..levels``, ``sc`` and ``mn`` in ``0..scale_max`` under fp16 ``d`` and ``dmin``."""
    lo, hi = np.minimum(x.min(-1), 0.0), x.max(-1)
    d = _fp16(np.maximum((hi - lo).max(-1) / levels / scale_max, 1e-8))
    dmin = _fp16(np.maximum((-lo).max(-1) / scale_max, 1e-8))
    sc = np.clip(np.round((hi - lo) / levels / d[:, None]), 1, scale_max).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin[:, None]), 0, scale_max).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.round((x + (dmin[:, None] * mn)[..., None]) / step), 0, levels)
    return d, dmin, sc, mn, q.astype(np.uint8)


def quantize_q2_k(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` -> Q2_K rows: per 16 weights a 4-bit scale and min, 2-bit ``q``."""
    d, dmin, sc, mn, q = _scale_min_quants(w.astype(np.float32).reshape(-1, 16, 16), 3, 15)
    out = [sc | (mn << 4), _crumbs(q.reshape(-1, 256)), *_halves(d, dmin)]
    return np.concatenate(out, -1).reshape(w.shape[0], -1)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` -> Q3_K rows: per 16 weights a signed 6-bit scale, ``q`` in -4..3 as two
    low bits and a high bit (set when ``q >= 0``)."""
    x = w.astype(np.float32).reshape(-1, 16, 16)
    amax = np.abs(x).max(-1) / 4
    d = _fp16(np.maximum(amax.max(-1) / 31, 1e-8))
    sc = np.clip(np.round(amax / d[:, None]), 1, 31)
    u = (np.clip(np.round(x / (d[:, None] * sc)[..., None]), -4, 3) + 4).astype(np.uint8)
    u = u.reshape(-1, 256)
    s6 = (sc + 32).astype(np.uint8)
    low = (s6[:, :8] & 0xF) | ((s6[:, 8:] & 0xF) << 4)
    top = (s6 >> 4).reshape(-1, 4, 4)  # [blocks, j // 4, j % 4]
    high = top[:, 0] | (top[:, 1] << 2) | (top[:, 2] << 4) | (top[:, 3] << 6)
    hmask = _bit_planes((u >> 2).reshape(-1, 8, 32))
    out = [hmask, _crumbs(u & 3), low, high, *_halves(d)]
    return np.concatenate(out, -1).reshape(w.shape[0], -1)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` -> Q4_K rows: per 32-weight sub-block ``w ~ scale * q - min`` (q 0..15,
    min >= 0), the eight scales and mins in 6 bits under the super-block's fp16 ``d``/``dmin``."""
    d, dmin, sc, mn, q = _scale_min_quants(w.astype(np.float32).reshape(-1, 8, 32), 15, 63)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    out = [*_halves(d, dmin), _k_scale_bytes(sc, mn), qs]
    return np.concatenate(out, -1).reshape(w.shape[0], -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` -> Q5_K rows: Q4_K's scales and mins, 5-bit ``q`` (a fifth-bit plane)."""
    d, dmin, sc, mn, q = _scale_min_quants(w.astype(np.float32).reshape(-1, 8, 32), 31, 63)
    low = q & 0xF
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    out = [*_halves(d, dmin), _k_scale_bytes(sc, mn), _bit_planes(q >> 4), qs]
    return np.concatenate(out, -1).reshape(w.shape[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` fp32 -> Q6_K rows: per 16 weights an int8 scale under the block's fp16 ``d``,
    6-bit ``q - 32`` split into 4 low bits (ql) and 2 high bits (qh)."""
    x = w.astype(np.float32).reshape(-1, 16, 16)
    d = _fp16(np.maximum(np.abs(x).max((-1, -2)) / 31 / 127, 1e-8))
    sc = np.clip(np.round(np.abs(x).max(-1) / 31 / d[:, None]), 1, 127).astype(np.int8)
    step = (d[:, None] * sc)[..., None]
    u = (np.clip(np.round(x / step), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    low, high = u & 0xF, u >> 4  # [block, half, g, lane]
    ql = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], -1
    )
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    out = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), *_halves(d)]
    return np.concatenate(out, -1).reshape(w.shape[0], -1)


def _nearest_level(x: np.ndarray) -> np.ndarray:
    """The index of the IQ4 level nearest to each of ``x`` (in level units)."""
    return np.abs(x[..., None] - IQ4_LEVELS).argmin(-1).astype(np.uint8)


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` -> IQ4_NL rows: per 32 weights an fp16 ``d`` and a level index each."""
    x = w.astype(np.float32).reshape(-1, 32)
    d = _fp16(np.maximum(np.abs(x).max(-1) / 127, 1e-8))
    q = _nearest_level(x / d[:, None])
    return np.concatenate([*_halves(d), _nibble_pairs(q)], -1).reshape(w.shape[0], -1)


def quantize_iq4_xs(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` -> IQ4_XS rows: per 32 weights a 6-bit scale (stored + 32) under the
    block's fp16 ``d``, a level index per weight."""
    x = w.astype(np.float32).reshape(-1, 8, 32)
    amax = np.abs(x).max(-1) / 127
    d = _fp16(np.maximum(amax.max(-1) / 31, 1e-8))
    sc = np.clip(np.round(amax / d[:, None]), 1, 31)
    q = _nearest_level(x / (d[:, None] * sc)[..., None])
    s6 = (sc + 32).astype(np.uint16)
    high = ((s6 >> 4) << np.arange(0, 16, 2, dtype=np.uint16)).sum(-1, dtype=np.uint16)
    low = (s6[:, 0::2] & 0xF) | ((s6[:, 1::2] & 0xF) << 4)
    out = [*_halves(d), high.view(np.uint8).reshape(-1, 2), low.astype(np.uint8)]
    out.append(_nibble_pairs(q).reshape(-1, 128))
    return np.concatenate(out, -1).reshape(w.shape[0], -1)


_ENCODERS = {
    "Q2_K": quantize_q2_k,
    "Q3_K": quantize_q3_k,
    "Q4_K": quantize_q4_k,
    "Q5_K": quantize_q5_k,
    "Q6_K": quantize_q6_k,
    "IQ4_NL": quantize_iq4_nl,
    "IQ4_XS": quantize_iq4_xs,
}


def encode(w: np.ndarray, type_name: str) -> tuple[np.ndarray, object]:
    """(data for GGUFWriter.add_tensor, raw_dtype) of ``w`` in ``type_name``."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[type_name]
    if type_name == "F32":
        return w.astype(np.float32), None
    if type_name in _ENCODERS:
        return _ENCODERS[type_name](w), qtype
    return quants.quantize(w.astype(np.float32), qtype), qtype
