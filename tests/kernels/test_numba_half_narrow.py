"""fp32 rounded to fp16 and bf16 bits in numba-compiled code (cpu/half.py) against torch's own
conversion, bit for bit: random fp32 patterns over the whole range, and every value near each
fp16 rounding boundary (halfway points, subnormals, the overflow edge)."""

from __future__ import annotations

import numba
import numpy as np
import torch

from pagedserve.kernels.cpu.half import float32_to_bf16_bits, float32_to_fp16_bits


@numba.njit
def _narrow_all(x, fp16, bf16):
    for i in range(x.shape[0]):
        fp16[i] = float32_to_fp16_bits(x[i])
        bf16[i] = float32_to_bf16_bits(x[i])


def _inputs() -> np.ndarray:
    rng = np.random.default_rng(0)
    random = rng.integers(0, 2**32, 1 << 22, dtype=np.uint64).astype(np.uint32)
    # around every fp16 value: its fp32 pattern +- up to half an fp16 step (2**12 fp32 ulps)
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    centres = halves[np.isfinite(halves)].view(np.uint32).astype(np.int64)
    offsets = np.array([-4097, -4096, -4095, -1, 0, 1, 4095, 4096, 4097], dtype=np.int64)
    near = (centres[:, None] + offsets[None, :]).ravel() % (1 << 32)
    edges = np.array([0x477FEFFF, 0x477FF000, 0x477FF001, 0x33000000, 0x33000001, 0x32FFFFFF])
    bits = np.concatenate([random, near.astype(np.uint32), edges.astype(np.uint32)])
    return bits.view(np.float32)


def test_narrowing_matches_torch_bit_for_bit():
    x = _inputs()
    fp16, bf16 = np.empty(x.shape, np.uint16), np.empty(x.shape, np.int16)
    _narrow_all(x, fp16, bf16)
    finite_or_inf = ~np.isnan(x)
    want_fp16 = torch.from_numpy(x).half().view(torch.int16).numpy().view(np.uint16)
    want_bf16 = torch.from_numpy(x).bfloat16().view(torch.int16).numpy()
    assert np.array_equal(fp16[finite_or_inf], want_fp16[finite_or_inf])
    assert np.array_equal(bf16[finite_or_inf], want_bf16[finite_or_inf])
    # NaN stays NaN (torch's payload bits are its own)
    assert np.isnan(fp16[~finite_or_inf].view(np.float16)).all()
    nan_bf16 = torch.from_numpy(bf16[~finite_or_inf]).view(torch.bfloat16)
    assert nan_bf16.isnan().all()
