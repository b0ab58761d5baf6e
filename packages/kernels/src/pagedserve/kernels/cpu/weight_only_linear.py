"""8-bit weights quantized at load (int8, fp8 e4m3) multiplied on CPU from their bytes, compiled
with numba: one byte a weight read per step, never an fp32 copy of the matrix.

Same contract as :func:`pagedserve.kernels.weight_only_linear.weight_only_linear` for fp32
activations: ``x (scale * Q)^T + bias`` with ``Q`` ``[N, K]`` and one fp32 scale per output
channel. The reference widens the whole weight to fp32 on every call and multiplies: a decode
step then reads the 8-bit matrix, writes and reads back a 4-byte one, which made int8 decode
no faster than fp32 (docs/benchmarks.md, "Every weight format"). Here the rows go through the
GGUF GEMM (cpu/gguf_linear.py ``multiply_rows``) as row types of their own:

- ``INT8_ROWS`` (the signed byte): for a decode step's rows, the integer dots
  (cpu/integer_dot.py: the bytes times activations rounded to 16 bits per 32, summed in
  integers; ``K`` a multiple of 32, else decoded as below), as a Q8_0 block is dotted. On the
  1B Llama this made one stream's decode step 1.9x faster (95.9 -> 51.2 ms; fp32 107 ms; the
  AVX-512 EPYC VM only, nearly quiet: not measured on the Intel VM, the AVX2 EPYC or beside a
  busy neighbour).
- ``E4M3_ROWS`` (the fp8 byte's bits moved into fp32's places, exact, by cpu/gguf_blocks.py):
  four rows decoded at a time into an fp32 buffer in L1 and dotted against each row of ``x``.
- A prefill: decoded tiles and MKL, for both.

The scale factors out of each output channel's sum, so it is applied once per output, as the
reference applies it: the result is the reference's up to summation order (and, for int8's
integer dots, the activations' rounding), and a row's result depends neither on the batch nor
on the thread count (the GGUF GEMM's batch invariance).
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu.gguf_blocks import E4M3_ROWS, INT8_ROWS
from pagedserve.kernels.cpu.gguf_linear import multiply_rows

# The row type each 8-bit weight dtype is decoded as (the CPU runner's fused layer reads it too)
ROW_TYPES = {torch.int8: INT8_ROWS, torch.float8_e4m3fn: E4M3_ROWS}


def weight_only_linear_numba(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x (scale * qweight)^T + bias`` for fp32 ``x [..., K]``, ``qweight`` int8 or
    float8_e4m3fn ``[N, K]``, ``scale`` fp32 ``[N]``."""
    if qweight.dtype not in ROW_TYPES or x.dtype is not torch.float32:
        raise ValueError(
            f"weight-only linear on CPU: fp32 x and int8 / fp8 e4m3 weights, not {x.dtype} "
            f"and {qweight.dtype}"
        )
    n, k = qweight.shape
    out = multiply_rows(x.reshape(-1, k), qweight.view(torch.uint8), ROW_TYPES[qweight.dtype])
    out *= scale
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], n)
