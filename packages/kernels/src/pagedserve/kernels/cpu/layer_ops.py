"""A decoder layer's small ops on CPU, compiled with numba: RMSNorm (with its residual add),
rotary embedding, the KV-cache store and the gated MLP's SiLU, each one call over the step's
tokens.

At a small decode batch these ops move a few kilobytes, and their PyTorch references pay for
it in op dispatch: RMSNorm is ~10 aten ops (add, pow, mean, rsqrt, mul, casts), rotary ~30
(a gather, chunks, eight multiplies, cats, a write back per tensor), the store a validity
check that syncs (``.all()``) before two indexed copies. Thirty layers at ~0.1 ms per op set
came to a third of a batch-1 step on a 2-core CPU (docs/cpu.md). Each kernel here is one
serial loop nest (no ``prange``: the work is microseconds, a parallel region costs more than
it saves), called once per op, with the same contract as the reference it stands for:

- :func:`rms_norm_numba` as ``rms_norm_ref`` in fp32: the residual sum is stored, then
  normalised; the sum of squares is reassociated (vectorised), so results differ from the
  reference's by float rounding (within the kernel suite's fp32 tolerance), never more;
- :func:`rotary_embedding_numba` as ``rotary_embedding_ref``: in place, neox or GPT-J pairs,
  partial rotary, on strided views (the model hands it views of the fused qkv output);
- :func:`store_kv_numba` as ``store_kv_ref``: slot -1 skipped, caches written in place, fp32
  or 16-bit (rounded to nearest even as torch's ``.to()``: cpu/half.py; ``supports_caches``);
- :func:`silu_and_mul_numba` as ``silu_and_mul_ref`` in fp32: ``gate / (1 + exp(-gate)) * up``
  with the vectorisable ``exp_f32`` (cpu/fast_exp.py; ~1 ulp): a decode row of 1,536 in ~6.5 us
  a call, wrapper included, where the reference's two aten ops take ~16.6 us.

fp32 activations only (what ``supports`` checks): 16-bit activations take the references, whose
rounding these loops would have to reproduce. ``cache=True`` keeps the machine code on disk;
:func:`warm_up` compiles the layouts the models pass at engine start-up.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from pagedserve.kernels.cpu import numba_cache  # noqa: F401  (before any cached @njit)
from pagedserve.kernels.cpu.cache_rows import write_row
from pagedserve.kernels.cpu.fast_exp import exp_f32
from pagedserve.kernels.cpu.half import cache_as_numpy
from pagedserve.kernels.kv_q8 import zeros_cache

_FASTMATH = {"reassoc", "contract", "arcp", "nsz"}


@numba.njit(cache=True, fastmath=_FASTMATH)
def _rms_norm_kernel(x, residual, weight, eps, out, new_residual, has_residual):
    hidden = x.shape[1]
    for t in range(x.shape[0]):
        total = np.float32(0.0)
        if has_residual:
            for j in range(hidden):
                s = x[t, j] + residual[t, j]
                new_residual[t, j] = s
                total += s * s
        else:
            for j in range(hidden):
                total += x[t, j] * x[t, j]
        inv = np.float32(1.0) / np.sqrt(total / np.float32(hidden) + eps)
        if has_residual:
            for j in range(hidden):
                out[t, j] = (new_residual[t, j] * inv) * weight[j]
        else:
            for j in range(hidden):
                out[t, j] = (x[t, j] * inv) * weight[j]


@numba.njit(cache=True, fastmath=_FASTMATH)
def _rotate(x, positions, cos_sin, is_neox):
    """Rotate ``x [T, H, D]`` in place; pairs (i, i + half) (neox) or (2i, 2i + 1)."""
    half = cos_sin.shape[1] // 2
    for t in range(x.shape[0]):
        row = cos_sin[positions[t]]
        for h in range(x.shape[1]):
            head = x[t, h]
            for i in range(half):
                first, second = (i, i + half) if is_neox else (2 * i, 2 * i + 1)
                cos, sin = row[i], row[i + half]
                x1, x2 = head[first], head[second]
                head[first] = x1 * cos - x2 * sin
                head[second] = x2 * cos + x1 * sin


@numba.njit(cache=True)
def _rotary_kernel(positions, query, key, cos_sin, is_neox):
    _rotate(query, positions, cos_sin, is_neox)
    _rotate(key, positions, cos_sin, is_neox)


@numba.njit(cache=True)
def _store_kv_kernel(key, value, k_cache, v_cache, slot_mapping):
    """fp32 ``key``/``value`` rows into the caches' slots, rounded to a narrower cache's element
    (uint16: fp16 bits, int16: bf16 bits, as torch's ``.to()`` rounds; uint8: fp8 e4m3 bits,
    saturated as kv_fp8.py says; int8: q8_0 rows, kv_q8.py)."""
    block_size = k_cache.shape[1]
    for t in range(key.shape[0]):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        keys = k_cache[slot // block_size, slot % block_size]
        values = v_cache[slot // block_size, slot % block_size]
        for h in range(key.shape[1]):
            write_row(keys[h], key[t, h], k_cache)
            write_row(values[h], value[t, h], v_cache)


@numba.njit(cache=True, fastmath=_FASTMATH)
def _silu_and_mul_kernel(x, out):
    """Two passes over a row: exp(-gate) first, then the rest. (LLVM vectorises each loop;
    one loop with both the exp and the division ran scalar, ~5x slower.)"""
    d = out.shape[1]
    for t in range(x.shape[0]):
        for i in range(d):
            out[t, i] = exp_f32(-x[t, i])
        for i in range(d):
            out[t, i] = x[t, i] / (np.float32(1.0) + out[t, i]) * x[t, d + i]


def supports(*tensors: torch.Tensor) -> bool:
    """Whether these operands can take the numba path: CPU fp32 (anything else: reference)."""
    for t in tensors:
        if t.dtype != torch.float32 or t.is_cuda:
            return False
    return True


# what the KV store writes (int8: q8_0 rows, kv_q8.py)
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8)


def supports_caches(*caches: torch.Tensor) -> bool:
    """Whether the KV store can write these caches: CPU, contiguous, of ``CACHE_DTYPES``."""
    return all(c.dtype in CACHE_DTYPES and c.is_cpu and c.is_contiguous() for c in caches)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as contiguous ``[rows, hidden]``: ``t`` itself where it already is (a decode
    step's hidden states), else a reshaped copy. One compiled layout, the one :func:`warm_up`
    compiles, so that no request waits for numba."""
    if t.dim() == 2 and t.is_contiguous():
        return t
    return t.reshape(-1, t.shape[-1]).contiguous()


def rms_norm_numba(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm_ref``'s contract for fp32 CPU tensors (see the module docstring). (Outputs
    are allocated by numpy and handed to torch without a copy: ~1 us less each than
    ``torch.empty_like``, at 60 calls a step.)"""
    x2 = _rows(x)
    xa = x2.numpy()
    out = np.empty_like(xa)
    if residual is None:
        _rms_norm_kernel(xa, xa, weight.numpy(), np.float32(eps), out, xa, False)
        result = torch.from_numpy(out)
        return result if x2 is x else result.view(x.shape)
    new_residual = np.empty_like(xa)
    _rms_norm_kernel(
        xa, _rows(residual).numpy(), weight.numpy(), np.float32(eps), out, new_residual, True
    )
    if x2 is x:
        return torch.from_numpy(out), torch.from_numpy(new_residual)
    return torch.from_numpy(out).view(x.shape), torch.from_numpy(new_residual).view(x.shape)


def rotary_embedding_numba(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_embedding_ref``'s contract for fp32 CPU tensors: rotated in place."""
    _rotary_kernel(positions.numpy(), query.numpy(), key.numpy(), cos_sin_cache.numpy(), is_neox)
    return query, key


def store_kv_numba(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``store_kv_ref``'s contract for fp32 CPU keys and values into contiguous fp32, fp16 or
    bf16 caches (16-bit: the same bits as the reference's ``.to(cache dtype)``)."""
    _store_kv_kernel(
        key.numpy(), value.numpy(), cache_as_numpy(k_cache), cache_as_numpy(v_cache),
        slot_mapping.numpy(),
    )  # fmt: skip


def silu_and_mul_numba(x: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul_ref``'s contract for an fp32 CPU ``x = [gate | up]``."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim must be even, got {x.shape[-1]}")
    d = x.shape[-1] // 2
    x2 = _rows(x)
    out = np.empty((x2.shape[0], d), np.float32)
    _silu_and_mul_kernel(x2.numpy(), out)
    result = torch.from_numpy(out)
    return result if x.dim() == 2 else result.view(*x.shape[:-1], d)


def warm_up(cache_dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
    """Compile (or load from disk) each kernel for the layouts a decoder layer passes: rows
    and views of a fused qkv output, int64 and int32 positions and slots, caches of these
    dtypes."""
    d = 32  # a head: one q8_0 group
    x = torch.zeros(2, d)
    silu_and_mul_numba(x)
    rms_norm_numba(x, torch.ones(d), 1e-6)
    rms_norm_numba(x, torch.ones(d), 1e-6, x.clone())
    qkv = torch.zeros(2, 4 * d)
    q, k, v = qkv.split([2 * d, d, d], dim=-1)
    q, k, v = q.view(2, 2, d), k.view(2, 1, d), v.contiguous().view(2, 1, d)
    for index in (torch.int64, torch.int32):
        positions = torch.tensor([0, 1], dtype=index)
        rotary_embedding_numba(positions, q, k, torch.zeros(4, d))
        rotary_embedding_numba(positions, q.contiguous(), k.contiguous(), torch.zeros(4, d))
        for dtype in cache_dtypes:
            cache = zeros_cache((2, 4, 1, d), dtype)
            store_kv_numba(k, v, cache, cache.clone(), positions)
            store_kv_numba(k.contiguous(), v, cache, cache.clone(), positions)
