"""fp8 e4m3 cache elements in numba-compiled code (cpu/half.py) against torch's conversions,
bit for bit: writing saturates at ±448 and rounds to nearest even as
``clamp(x, -448, 448).to(torch.float8_e4m3fn)`` does (every halfway point, subnormals, the
saturation edge, random fp32 patterns); reading widens each of the 256 bytes as ``.float()``."""

from __future__ import annotations

import numba
import numpy as np
import torch

from pagedserve.kernels.cpu.half import float32_to_e4m3_bits, to_float32
from pagedserve.kernels.kv_fp8 import float32_to_e4m3_ref
from pagedserve.kernels.testing import e4m3_rounding_inputs


@numba.njit
def _narrow_all(x, out):
    for i in range(x.shape[0]):
        out[i] = float32_to_e4m3_bits(x[i])


@numba.njit
def _widen_all(bits, out):
    for i in range(bits.shape[0]):
        out[i] = to_float32(bits[i])


def test_writing_matches_torch_saturated_bit_for_bit():
    x = e4m3_rounding_inputs()
    got = np.empty(x.shape, np.uint8)
    _narrow_all(x.numpy(), got)
    want = float32_to_e4m3_ref(x).numpy()
    finite = ~x.isnan().numpy()
    assert np.array_equal(got[finite], want[finite])
    assert (got[~finite] & 0x7F == 0x7F).all()  # NaN stays NaN
    assert got[x.numpy() == 1e6][0] == 0x7E and got[x.numpy() == -np.inf][0] == 0xFE


def test_reading_widens_every_byte_as_torch():
    bits = np.arange(256, dtype=np.uint8)
    got = np.empty(256, np.float32)
    _widen_all(bits, got)
    want = torch.from_numpy(bits).view(torch.float8_e4m3fn).float().numpy()
    nan = np.isnan(want)
    assert nan.sum() == 2 and np.isnan(got[nan]).all()
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # -0.0 too
