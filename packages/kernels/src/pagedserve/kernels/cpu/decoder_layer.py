"""A Llama decoder layer over a decode step's few rows on CPU, in one numba call.

At a batch-1 decode on a 2-core CPU the layer's own work is the weights' read (the GEMMs run at
the memory's speed: cpu/dense_linear.py) plus microseconds of small ops; the rest is Python.
The layer as modules is ~12 kernel calls (two RMSNorms, four GEMMs, rotary, the KV store, the
attention, SiLU), each through an ``nn.Module``, the dispatch, a wrapper that turns tensors into
numpy arrays and back, plus the splits and views between them: ~100 us a layer, ~3 ms of a
~21 ms step over SmolLM2's 30 layers, where llama.cpp's whole token takes ~18-20 ms. Here the
same kernels run from one compiled function, so the layer costs one call's dispatch:

    h, r  = rms_norm(x + residual)                      (layer_ops_numba._rms_norm_kernel)
    q,k,v = split(h @ W_qkv.T + b_qkv)                  (dense_linear or gguf_linear kernels)
    q, k  = rms_norm(q), rms_norm(k), per head          (Qwen3's q/k norms, where it has them)
    q, k  = rotary(q, k);  cache[slots] = k, v          (layer_ops_numba)
    a     = paged_attention(q, cache, the step's plan)  (paged_attention_numba kernels)
    h, r  = rms_norm(a @ W_o.T + r)
    out   = (silu(h @ W_gate.T) * (h @ W_up.T)) @ W_down.T

**The same bits as the layer run module by module** on the numba path: every op is the very
kernel the modules call, on the same values, with the same choices (a GEMM's weight shared over
the threads from ``PARALLEL_FROM_WEIGHTS`` on, the attention's work items, KV splits and
parallel flag from the step's plan). Only the glue differs: q, k and v are copied out of the
fused projection's rows instead of viewed, which moves values, not rounding. So switching a
step between the two paths (a batch of 17 rows goes module by module, a batch of 16 here)
changes no output; tests/engine/test_cpu_runner.py holds them equal bit for bit.

The projections are fp32 matrices, or a GGUF file's rows of blocks (each projection as up to
three parts of their own types, as ``GGUFLinearMethod`` holds them), or 8-bit weights
quantized at load (int8, fp8: one-byte rows and their per-feature scales, as
``WeightOnly8BitLinearMethod`` holds them): ``project`` picks the
GEMM by the weights' numba type when the layer compiles, so each kind is its own signature and
a dense model's code is as it was. Only the layer :func:`supports` takes this path: the caller
(the model) checks the rest (fp32, GGUF, 8-bit or 4-bit-group weights without other
quantization or LoRA, one rank). The compiled function
carries the code of every kernel it calls: numba_cache.py stamps the disk cache with all the
package's numba files, so an edit to any of them recompiles this one too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch
from numba.core import types
from numba.extending import overload

from pagedserve.kernels.cpu import numba_cache  # noqa: F401  (before any cached @njit)
from pagedserve.kernels.cpu.dense_linear import MAX_ROWS, dense_linear_compiled
from pagedserve.kernels.cpu.gguf_linear import LANES, PARTS, gguf_parts_compiled
from pagedserve.kernels.cpu.half import cache_as_numpy
from pagedserve.kernels.cpu.layer_ops import (
    CACHE_DTYPES,
    _rms_norm_kernel,
    _rotate,
    _silu_and_mul_kernel,
    _store_kv_kernel,
    supports_caches,
)
from pagedserve.kernels.cpu.paged_attention import NO_SINKS, launch_attention
from pagedserve.kernels.cpu.paged_attention_plan import StepPlan
from pagedserve.kernels.cpu.threads import follow_torch_threads
from pagedserve.kernels.kv_q8 import zeros_cache


def project(x, weight, threads, batch_invariant):  # pragma: no cover - compiled
    """``x @ W.T``: ``weight`` an fp32 ``[out, in]`` matrix (``batch_invariant``: the loop of
    the batch-invariant mode, as the modules' ``linear`` runs it), or a projection of byte rows
    ``(parts, types, scales, lanes)`` (``DecoderLayerWeights.of``)."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(project, inline="always")
def _project_impl(x, weight, threads, batch_invariant):
    if isinstance(weight, types.Array):
        return lambda x, weight, threads, batch_invariant: dense_linear_compiled(
            x, weight, threads, batch_invariant
        )
    return lambda x, weight, threads, batch_invariant: gguf_parts_compiled(
        _in_order(x, weight[4]), weight[0], weight[1], weight[2], weight[3], threads
    )


@numba.njit(cache=True, inline="always")
def _in_order(x, order):  # pragma: no cover - compiled
    """``x``'s features in the weights' ``order`` (a GPTQ act-order layer's columns sorted by
    group, quantization_int4.py), or ``x`` itself for an empty order."""
    if order.shape[0] == 0:
        return x
    return x[:, order]


@numba.njit(cache=True)
def _qkv_heads(qkv, n_heads, n_kv_heads, head_dim):
    """q ``[T, Hq, D]``, k and v ``[T, Hkv, D]``: contiguous copies of the fused projection."""
    t, q_size, kv_size = qkv.shape[0], n_heads * head_dim, n_kv_heads * head_dim
    q = qkv[:, :q_size].copy().reshape(t, n_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].copy().reshape(t, n_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].copy().reshape(t, n_kv_heads, head_dim)
    return q, k, v


@numba.njit(cache=True)
def _head_norm(x, weight, eps):  # pragma: no cover - compiled
    """Each head's row of ``x [T, H, D]`` RMS-normalised (Qwen3's q/k norms): the kernel the
    modules' ``rms_norm`` runs, over the same rows."""
    rows = x.reshape(-1, x.shape[2])
    out = np.empty_like(rows)
    _rms_norm_kernel(rows, rows, weight, eps, out, rows, False)
    return out.reshape(x.shape)


@numba.njit(cache=True)
def _decoder_layer(hidden, residual, has_residual, norms, eps, weights, qkv_bias, heads, rotary,
                   cache, attention, threads, batch_invariant, head_norms):  # fmt: skip  # pragma: no cover
    """One layer (see the module docstring); returns (the MLP's output, the new residual).

    ``norms``: (input, post-attention) RMSNorm weights; ``eps``: theirs; ``weights``: (qkv,
    o, gate_up, down), each for ``project``; ``qkv_bias``: empty for none; ``heads``: (query heads, KV heads, head
    dim); ``rotary``: (positions, cos/sin cache, neox?); ``cache``: (K cache, V cache, slot
    mapping); ``attention``: (layout, work, merges, parallel?, scale, window, soft cap, sinks:
    none, the fused layers are of models without them; the layout carries the step's key
    limits, where it has them, as the modules' attention reads them: ``StepPlan``);
    ``batch_invariant``: the GEMMs' loop
    (``project``); ``head_norms``: (q weight, k weight, q eps, k eps), the weights empty for a
    model without per-head norms."""
    w_qkv, w_o, w_gate_up, w_down = weights
    normed = np.empty_like(hidden)
    if has_residual:
        summed = np.empty_like(hidden)
        _rms_norm_kernel(hidden, residual, norms[0], eps[0], normed, summed, True)
    else:
        summed = hidden
        _rms_norm_kernel(hidden, hidden, norms[0], eps[0], normed, hidden, False)
    qkv = project(normed, w_qkv, threads, batch_invariant)
    if qkv_bias.shape[0]:
        for t in range(qkv.shape[0]):
            qkv[t] += qkv_bias
    q, k, v = _qkv_heads(qkv, heads[0], heads[1], heads[2])
    if head_norms[0].shape[0]:
        q = _head_norm(q, head_norms[0], head_norms[2])
        k = _head_norm(k, head_norms[1], head_norms[3])
    positions, cos_sin, is_neox = rotary
    _rotate(q, positions, cos_sin, is_neox)
    _rotate(k, positions, cos_sin, is_neox)
    _store_kv_kernel(k, v, cache[0], cache[1], cache[2])
    attended = np.empty(q.shape, np.float32)  # every row is some work item's: see supports
    launch_attention(q, cache[0], cache[1], *attention, attended)
    projected = project(attended.reshape(q.shape[0], -1), w_o, threads, batch_invariant)
    normed2, summed2 = np.empty_like(hidden), np.empty_like(hidden)
    _rms_norm_kernel(projected, summed, norms[1], eps[1], normed2, summed2, True)
    gate_up = project(normed2, w_gate_up, threads, batch_invariant)
    activated = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
    _silu_and_mul_kernel(gate_up, activated)
    return project(activated, w_down, threads, batch_invariant), summed2


_NO_NORM = np.empty(0, np.float32)


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One layer's weights and constants as the fused kernel reads them: numpy views of the
    model's own tensors (no copies), converted once (per call they cost ~30 us a layer).

    ``norms``: the input and post-attention RMSNorm weights, ``eps`` theirs; ``linears``: the
    (qkv, o, gate_up, down) weights, ``[out, in]`` contiguous; ``qkv_bias``: empty for none;
    ``heads``: (query heads, KV heads, head dim); ``cos_sin``: the rotary cache; ``window``: the
    sliding window or 0; ``cap``: the scores' soft cap or 0; ``head_norms``: the per-head q and
    k RMSNorm weights and their eps (Qwen3; empty weights for none). A quantized projection is
    ``(rows, types, scales, lanes, order)``: ``PARTS`` uint8 row blocks (empty ones padding),
    their type ids (ggml's, or the rows' pagedserve writes of cpu/gguf_blocks.py), their
    per-feature scales (empty: none), the decoders' ``LANES`` as data (``gguf_parts_compiled``
    says why), and the order the weights take the input features in (empty: as they come).
    ``batch_invariant``: the fp32 projections run the batch-invariant mode's GEMM loop, as the
    modules' do."""

    norms: tuple[np.ndarray, np.ndarray]
    eps: tuple[np.float32, np.float32]
    linears: tuple
    qkv_bias: np.ndarray
    heads: tuple[int, int, int]
    cos_sin: np.ndarray
    is_neox: bool
    scale: np.float32
    window: int
    cap: np.float32
    batch_invariant: bool = False
    head_norms: tuple = (_NO_NORM, _NO_NORM, np.float32(0), np.float32(0))

    @property
    def reads_blocks(self) -> bool:
        """Whether the projections are rows of bytes (a GGUF file's blocks, 8-bit weights), not
        fp32 matrices."""
        return isinstance(self.linears[0], tuple)

    @classmethod
    def of(
        cls,
        norms: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]],
        linears: tuple,
        qkv_bias: torch.Tensor | None,
        heads: tuple[int, int, int],
        rotary: tuple[torch.Tensor, bool],
        attention: tuple[float, int | None, float | None],
        batch_invariant: bool = False,
        head_norms: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]] | None = None,
    ) -> DecoderLayerWeights:
        """From the modules' tensors: ``linears`` fp32 weights, or quantized projections as
        lists of ``(uint8 rows, type id[, scales])`` parts (``_projection``); ``rotary``
        (cos/sin cache, neox?), ``attention`` (scale, sliding window or None, soft cap or
        None), ``head_norms`` ((q weight, eps), (k weight, eps)) or None."""
        (norm_in, eps_in), (norm_post, eps_post) = norms
        scale, window, cap = attention
        return cls(
            (norm_in.detach().numpy(), norm_post.detach().numpy()),
            (np.float32(eps_in), np.float32(eps_post)),
            tuple(_projection(w) for w in linears),
            _NO_BIAS if qkv_bias is None else qkv_bias.detach().numpy(),
            tuple(int(n) for n in heads),
            rotary[0].numpy(),
            bool(rotary[1]),
            np.float32(scale),
            window or 0,
            np.float32(cap or 0.0),
            batch_invariant,
            *(() if head_norms is None else (_head_norm_weights(*head_norms),)),
        )


def _head_norm_weights(q_norm: tuple[torch.Tensor, float], k_norm: tuple[torch.Tensor, float]):
    (q_weight, q_eps), (k_weight, k_eps) = q_norm, k_norm
    return (q_weight.detach().numpy(), k_weight.detach().numpy(), np.float32(q_eps),
            np.float32(k_eps))  # fmt: skip


def supports(
    hidden: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], plan: StepPlan
) -> bool:
    """Whether a step can take this path: fp32 CPU rows (at most the decode GEMM's
    ``MAX_ROWS``), contiguous caches of ``CACHE_DTYPES`` (fp32, fp16, bf16, fp8, q8_0), and every
    sequence in the attention plan's work items (none long enough for SDPA's prefill)."""
    return (
        hidden.dtype is torch.float32
        and hidden.is_cpu
        and 0 < hidden.shape[0] <= MAX_ROWS
        and supports_caches(*kv_cache)
        and not plan.long_seqs
    )


def decoder_layer_numba(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    layer: DecoderLayerWeights,
    positions: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    plan: StepPlan,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer on ``hidden [T, hidden]`` (contiguous fp32; see :func:`supports`); returns
    ``(out, residual)`` as ``LlamaDecoderLayer.forward`` does. ``plan``: the step's attention
    plan for this layer's window (paged_attention_plan.step_plan)."""
    x = hidden.numpy()
    out, summed = _decoder_layer(
        x, x if residual is None else residual.numpy(), residual is not None, layer.norms,
        layer.eps, layer.linears, layer.qkv_bias, layer.heads,
        (_int64(positions), layer.cos_sin, layer.is_neox),
        (cache_as_numpy(kv_cache[0]), cache_as_numpy(kv_cache[1]), _int64(slot_mapping)),
        (plan.layout, plan.work, plan.merges, plan.parallel, layer.scale, layer.window, layer.cap,
         NO_SINKS),
        follow_torch_threads(), layer.batch_invariant, layer.head_norms,
    )  # fmt: skip
    return torch.from_numpy(out), torch.from_numpy(summed)


_NO_BIAS = np.empty(0, np.float32)
_NO_ROWS = np.empty((0, 0), np.uint8)
_NO_ORDER = np.empty(0, np.int64)


def _projection(weight: torch.Tensor | list[tuple]):
    """A projection as ``project`` reads it: an fp32 matrix, or parts of byte rows padded to
    ``PARTS`` (one compiled signature for every layer of a quantized model). A part is
    ``(uint8 rows, type id)`` (a GGUF file's blocks), ``(uint8 rows, type id, fp32 scales)``
    (8-bit weights quantized at load, cpu/weight_only_linear.py), or ``(uint8 rows, type id,
    None, input order)`` (a GPTQ act-order layer of one part, its features sorted by group)."""
    if isinstance(weight, torch.Tensor):
        return weight.detach().numpy()
    pad = PARTS - len(weight)
    rows = tuple(part[0].detach().numpy() for part in weight) + (_NO_ROWS,) * pad
    types_ = tuple(int(part[1]) for part in weight) + (-1,) * pad
    scales = tuple(_numpy_or(part[2] if len(part) > 2 else None, _NO_BIAS) for part in weight)
    order = _numpy_or(weight[0][3] if len(weight[0]) > 3 else None, _NO_ORDER)
    return rows, types_, scales + (_NO_BIAS,) * pad, LANES, order


def _numpy_or(t: torch.Tensor | None, empty: np.ndarray) -> np.ndarray:
    return empty if t is None else t.detach().numpy()


def _int64(t: torch.Tensor) -> np.ndarray:
    """Positions and slots as int64 numpy (the engine's dtype): one compiled signature."""
    return t.numpy() if t.dtype is torch.int64 else t.to(torch.int64).numpy()


def warm_up(cache_dtypes: tuple[torch.dtype, ...] = (torch.float32,), gguf: bool = False) -> None:
    """Compile (or load from numba's disk cache) the fused layer now, not in the first request:
    one signature per cache dtype (fp32 rows, int64 positions and slots) on a one-token layer,
    with fp32 weights or (``gguf``) a GGUF file's rows of blocks. The GEMMs' and the
    attention's serial and parallel kernels sit behind its branches and compile with it."""
    from pagedserve.kernels.cpu.paged_attention_plan import step_plan

    hidden, head_dim = 32, 32  # a head of one q8_0 group
    shapes = (
        (3 * head_dim, hidden),
        (hidden, head_dim),
        (2 * hidden, hidden),
        (hidden, hidden),
    )
    if gguf:  # Q8_0: 34 bytes per 32 weights
        linears = tuple([(torch.zeros(n, k // 32 * 34, dtype=torch.uint8), 8)] for n, k in shapes)
    else:
        linears = tuple(torch.zeros(n, k) for n, k in shapes)
    weights = DecoderLayerWeights.of(
        ((torch.ones(hidden), 1e-6), (torch.ones(hidden), 1e-6)), linears,
        None, (1, 1, head_dim), (torch.zeros(4, head_dim), True), (1.0, None, None),
    )  # fmt: skip
    one = torch.zeros(1, dtype=torch.int64)
    plan = step_plan(
        torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
    )  # fmt: skip
    for dtype in cache_dtypes:
        if dtype in CACHE_DTYPES:
            cache = tuple(zeros_cache((2, 4, 1, head_dim), dtype) for _ in range(2))
            decoder_layer_numba(torch.zeros(1, hidden), None, weights, one, cache, one, plan)
