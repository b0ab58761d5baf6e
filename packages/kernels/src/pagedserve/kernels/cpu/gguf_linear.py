"""``x @ W.T`` on CPU with ``W`` in its GGUF blocks, compiled with numba: the blocks are read
once per call, and no fp32 copy of the matrix is ever made.

Same contract as :func:`pagedserve.kernels.gguf_linear.gguf_linear` for fp32 activations
(``qweight`` the file's ``uint8 [N, row_bytes]`` rows, ``qtype`` their ggml type id). Two
paths, by the number of rows, as the dense layer has (cpu/dense_linear.py, then MKL):

- **Decode (up to ``MAX_ROWS`` rows).** Blocks of sixteen output features are shared out over
  the threads (``prange``); for the integer types each weight row is dotted with every row
  of ``x`` in integers (below); for the others a task decodes four weight rows at a time
  into an fp32 buffer (cpu/gguf_blocks.py: a few vector instructions per 8 or 16 weights;
  the buffer stays in L1 or L2) and dots each row of ``x`` against the four in one loop,
  where one load of ``x`` feeds four FMAs. So each block is read from memory once per step
  whatever the batch, and a step's bytes shrink with the type: Q4_0 is 18 bytes per 32
  weights against fp32's 128.
  (The fp32 kernel dots one weight row against four rows of ``x`` instead, repeating the last
  row of a short batch: at one row that is four FMAs for one result, which a memory-bound
  fp32 step can afford and a decoding one cannot.)
- **Prefill (more rows).** A tile of output features is decoded into a buffer of about
  ``TILE_BYTES`` (in parallel over its rows) and multiplied by MKL (``torch.mm`` into the
  tile's columns of the output): the GEMM's cost grows with the rows and the decode's does
  not, so from a few dozen rows on this runs at the dense GEMM's speed.

**Integer dots where the weights are integers.** For ``INTEGER_TYPES`` (Q4_0, Q4_1, Q8_0, Q4_K,
Q5_K, Q6_K: every quantized type in the 1B Llama's Q4_K_M and Q8_0 files, and the shipped
Q4_1; and int8 rows quantized at load, cpu/weight_only_linear.py) the decode rows dot the
blocks with activations rounded to 16 bits per block (cpu/integer_dot.py): no weight is
decoded to fp32. (Q5_0 and Q5_1, most of SmolLM2's Q4_K_M and Q5_K_M, were tried: 1.2x faster
at one row, 1.8x slower at sixteen on its 3072 x 576 projection, and a sixteen-stream step 1.4x
slower; they stay decoded.) On the 1B Llama a one-stream decode step went from 1.33x to 2.10x
fp32's speed in Q8_0, and from 1.57x to 2.34x in Q4_K_M (docs/benchmarks.md; the AVX-512 EPYC
VM only, quiet or nearly: not measured on the Intel VM, the AVX2 EPYC or beside a busy
neighbour). The other types decode to fp32 as above, and the prefill path decodes every type
into MKL's tiles, as before. The integer dots cost in proportion to the rows; against the
tiles, 2 threads, the AVX-512 EPYC VM only: on the 1B's 8192 x 2048 Q4_K projection 9.2 against 13.7 ms at 32 rows, even
at 64, 1.3x slower at 128; Q8_0 even at 32 rows; SmolLM2's 1536 x 576 Q4_0 / Q4_1 already
slower at 24-32 (so ``MAX_ROWS`` stays 16 for all). A 1B prefill runs at MKL's fp32 speed,
about 160 GFLOP/s here: only arithmetic faster than fp32 FMAs, an integer GEMM, would make it
faster.

**Batch invariance.** A row's result does not depend on the other rows or the thread count:
the integer dots' operations per row are the same in any call (cpu/integer_dot.py); the
decoded weights are exact (bit for bit the reference's), and every output element comes
out of ``_dot_four_weights`` for one row of ``x``, output feature ``o`` always in slot
``o % 4`` of its group of four (tasks start on multiples of sixteen; a short last group
repeats its last weight row and does not write the repeats), with the same summation order
in a batch of one or of sixteen, on one thread or two (kernels/test_gguf_linear_numba.py).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from pagedserve.kernels.cpu import numba_cache  # noqa: F401  (before any cached @njit)
from pagedserve.kernels.cpu.dense_linear import PARALLEL_FROM_WEIGHTS, dense_linear_compiled
from pagedserve.kernels.cpu.gguf_blocks import decode_row
from pagedserve.kernels.cpu.integer_dot import (
    activation_group,
    has_integer_dot,
    integer_dot_rows,
    round_activations,
)
from pagedserve.kernels.cpu.threads import follow_torch_threads
from pagedserve.kernels.gguf_dequant import GGUF_TYPE_IDS, gguf_type
from pagedserve.kernels.linear import linear

MAX_ROWS = 16  # as the fp32 decode GEMM: above it the decoded tiles go to MKL
TILE_BYTES = 1 << 20  # a prefill tile of decoded weights: about 1 MiB, in L2 for MKL
LANES = 16  # the decoders' inner loop count, passed at run time (cpu/gguf_blocks.py)
F32 = GGUF_TYPE_IDS["F32"]
_FASTMATH = {"reassoc", "contract", "arcp", "nsz"}  # the fp32 decode GEMM's
PARTS = 3  # the most parts of different types a fused projection holds (q, k, v)
_W = 4  # weight rows decoded together and dotted in one loop
_BLOCK = 16  # output features per task shared out over the threads


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _dot_four_weights(xr, w, out, r, o, last):  # pragma: no cover - compiled
    """``out[r, o:o + 4] = w @ xr``: one row of ``x`` against four decoded weight rows in one
    loop (one load of ``x`` feeds four FMAs). Output features past ``last`` are not written:
    their weight rows repeat the last one (module doc, batch invariance)."""
    w0, w1, w2, w3 = w[0], w[1], w[2], w[3]
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for j in range(xr.shape[0]):
        v = xr[j]
        a0 += v * w0[j]
        a1 += v * w1[j]
        a2 += v * w2[j]
        a3 += v * w3[j]
    out[r, min(o + 3, last)] = a3
    out[r, min(o + 2, last)] = a2
    out[r, min(o + 1, last)] = a1
    out[r, o] = a0


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _features(x, qweight, qtype, lanes, out, first, stop):  # pragma: no cover - compiled
    """Output features ``first:stop`` for every row of ``x``: four weight rows decoded at a
    time into one buffer (the last group repeats row ``stop - 1``), then dotted against each
    row of ``x`` in turn."""
    w = np.empty((_W, x.shape[1]), np.float32)
    for o in range(first, stop, _W):
        for i in range(_W):
            decode_row(qweight[min(o + i, stop - 1)], qtype, w[i], lanes)
        for r in range(x.shape[0]):
            _dot_four_weights(x[r], w, out, r, o, stop - 1)


@numba.njit(cache=True, fastmath=_FASTMATH, parallel=True)
def _decoded_parallel(x, qweight, qtype, lanes, out):  # pragma: no cover - compiled
    blocks = qweight.shape[0] // _BLOCK
    for block in numba.prange(blocks):
        _features(x, qweight, qtype, lanes, out, block * _BLOCK, block * _BLOCK + _BLOCK)
    _features(x, qweight, qtype, lanes, out, blocks * _BLOCK, qweight.shape[0])


@numba.njit(cache=True, fastmath=_FASTMATH)
def _decoded_serial(x, qweight, qtype, lanes, out):  # pragma: no cover - compiled
    _features(x, qweight, qtype, lanes, out, 0, qweight.shape[0])


@numba.njit(cache=True, inline="always")
def _integer_features(rounded, qweight, qtype, out, first, stop):  # pragma: no cover
    xq, dx, sums = rounded
    for o in range(first, stop):
        integer_dot_rows(qweight[o], qtype, xq, dx, sums, out, o)


@numba.njit(cache=True, parallel=True)
def _integer_parallel(x, qweight, qtype, out):  # pragma: no cover - compiled
    rounded = round_activations(x, activation_group(qtype))
    blocks = qweight.shape[0] // _BLOCK
    for block in numba.prange(blocks):
        first = block * _BLOCK
        _integer_features(rounded, qweight, qtype, out, first, first + _BLOCK)
    _integer_features(rounded, qweight, qtype, out, blocks * _BLOCK, qweight.shape[0])


@numba.njit(cache=True)
def _integer_serial(x, qweight, qtype, out):  # pragma: no cover - compiled
    rounded = round_activations(x, activation_group(qtype))
    _integer_features(rounded, qweight, qtype, out, 0, qweight.shape[0])


@numba.njit(cache=True)
def gguf_linear_parallel(x, qweight, qtype, lanes, out):  # pragma: no cover - compiled
    """``out = x @ W.T`` over the threads: the integer dots for ``INTEGER_TYPES``, else the
    decoded rows. Neither this function nor the integer path is compiled with fast-math: in
    a fast-math function LLVM contracted the integer path's multiplies and adds into FMAs
    where it could, and where it could depended on the code around a row (its result then
    depended on its batch)."""
    if has_integer_dot(qtype, x.shape[1]):
        _integer_parallel(x, qweight, qtype, out)
    else:
        _decoded_parallel(x, qweight, qtype, lanes, out)


@numba.njit(cache=True)
def gguf_linear_serial(x, qweight, qtype, lanes, out):  # pragma: no cover - compiled
    """``gguf_linear_parallel`` in this thread."""
    if has_integer_dot(qtype, x.shape[1]):
        _integer_serial(x, qweight, qtype, out)
    else:
        _decoded_serial(x, qweight, qtype, lanes, out)


@numba.njit(cache=True)
def gguf_linear_compiled(x, qweight, qtype, lanes, threads):  # pragma: no cover - compiled
    """``x @ W.T`` into a new array, ``W`` the rows of blocks: shared out over the threads for a
    matrix of ``PARALLEL_FROM_WEIGHTS`` weights or more, else in this thread (the fp32 GEMM's
    rule)."""
    out = np.empty((x.shape[0], qweight.shape[0]), np.float32)
    if threads > 1 and qweight.shape[0] * x.shape[1] >= PARALLEL_FROM_WEIGHTS:
        gguf_linear_parallel(x, qweight, qtype, lanes, out)
    else:
        gguf_linear_serial(x, qweight, qtype, lanes, out)
    return out


@numba.njit(cache=True)
def gguf_parts_compiled(x, parts, qtypes, scales, lanes, threads):  # pragma: no cover - compiled
    """``x @ W.T`` for a fused projection whose row blocks ``parts`` (``PARTS`` of them, empty
    ones unused) have their own types ``qtypes``: each part's product in its columns, side by
    side, as the modules concatenate them; F32 parts through the fp32 decode GEMM, as
    :func:`gguf_linear_numba` sends them; a part with a non-empty ``scales`` entry (8-bit
    weights quantized at load: one scale per output feature) has its columns scaled after, as
    cpu/weight_only_linear.py scales them. For the fused decoder layer (cpu/decoder_layer.py).
    ``lanes`` (``LANES``) comes in as an argument, never as the global: a compiled caller
    would fold the constant into the decoders, and LLVM would unroll their loops to scalar
    code (three times slower, measured)."""
    n = 0
    for i in range(len(parts)):
        n += parts[i].shape[0]
    out = np.empty((x.shape[0], n), np.float32)
    first = 0
    for i in range(len(parts)):
        rows = parts[i]
        if rows.shape[0] == 0:
            continue
        if qtypes[i] == F32:
            part = dense_linear_compiled(x, rows.view(np.float32), threads, False)
        else:
            part = gguf_linear_compiled(x, rows, qtypes[i], lanes, threads)
        if scales[i].shape[0]:
            for r in range(part.shape[0]):
                part[r] *= scales[i]
        out[:, first : first + rows.shape[0]] = part
        first += rows.shape[0]
    return out


@numba.njit(cache=True, parallel=True)
def decode_rows_parallel(qweight, qtype, lanes, first, out):  # pragma: no cover - compiled
    """``out[i] =`` the fp32 weights of row ``first + i`` (a prefill tile), over the threads."""
    for i in numba.prange(out.shape[0]):
        decode_row(qweight[first + i], qtype, out[i], lanes)


@numba.njit(cache=True)
def decode_rows_serial(qweight, qtype, lanes, first, out):  # pragma: no cover - compiled
    for i in range(out.shape[0]):
        decode_row(qweight[first + i], qtype, out[i], lanes)


def _prefill(x: torch.Tensor, qweight: np.ndarray, qtype: int, threads: int) -> torch.Tensor:
    """``x @ W.T`` for many rows: tiles of decoded rows, each multiplied by MKL into its columns."""
    n, k = qweight.shape[0], x.shape[1]
    out = torch.empty(x.shape[0], n)
    tile_rows = max(_BLOCK, TILE_BYTES // (4 * k) // _BLOCK * _BLOCK)
    tile = np.empty((min(tile_rows, n), k), np.float32)
    decode = decode_rows_parallel if threads > 1 else decode_rows_serial
    for first in range(0, n, tile_rows):
        part = tile[: min(tile_rows, n - first)]
        decode(qweight, qtype, LANES, first, part)
        torch.mm(x, torch.from_numpy(part).T, out=out[:, first : first + part.shape[0]])
    return out


def multiply_rows(x2: torch.Tensor, rows: torch.Tensor, qtype: int) -> torch.Tensor:
    """``x2 @ W.T`` for fp32 ``x2 [M, K]`` and ``W``'s ``uint8`` rows of ``qtype`` (any decoder
    of cpu/gguf_blocks.py), both made contiguous here: the decode GEMM up to ``MAX_ROWS`` rows,
    decoded tiles and MKL above."""
    x2 = x2 if x2.is_contiguous() else x2.contiguous()
    rows = rows if rows.is_contiguous() else rows.contiguous()
    threads = follow_torch_threads()
    if x2.shape[0] <= MAX_ROWS:
        return torch.from_numpy(
            gguf_linear_compiled(x2.numpy(), rows.numpy(), qtype, LANES, threads)
        )
    return _prefill(x2, rows.numpy(), qtype, threads)


def gguf_linear_numba(
    x: torch.Tensor, qweight: torch.Tensor, qtype: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x W^T + bias`` for fp32 ``x [..., K]`` on CPU and ``qweight`` the ``uint8 [N,
    row_bytes]`` rows of any GGUF type (F32 rows are read as the fp32 matrix they are)."""
    t = gguf_type(qtype)
    n, k = qweight.shape[0], x.shape[-1]
    if qweight.shape[1] != k // t.block_size * t.block_bytes or k % t.block_size:
        raise ValueError(f"gguf_linear: {qweight.shape[1]} bytes of {t.name} do not hold {k}")
    if x.dtype is not torch.float32 or qweight.dtype is not torch.uint8:
        raise ValueError(f"gguf_linear on CPU: fp32 inputs and uint8 rows, not {x.dtype}")
    x2 = x.reshape(-1, k)
    if qtype == F32:
        rows = qweight if qweight.is_contiguous() else qweight.contiguous()
        out = linear(x2, rows.view(torch.float32))
    else:
        out = multiply_rows(x2, qweight, qtype)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], n)


def warm_up() -> None:
    """Compile (or load from numba's disk cache) both paths now, at model load: one signature
    each (fp32 rows, uint8 blocks), every type's decoder inside it."""
    x = torch.zeros(MAX_ROWS + 1, 32)
    qweight = torch.zeros(2 * _BLOCK + 1, 34, dtype=torch.uint8)  # Q8_0
    for rows in (1, MAX_ROWS + 1):
        gguf_linear_numba(x[:rows], qweight, GGUF_TYPE_IDS["Q8_0"])
