"""Mixture-of-experts MLP: each token through its top-k experts, weighted and summed.

``fused_moe(hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k])``
returns ``sum_j topk_weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t)`` with
``e = topk_ids[t, j]``; ``w13`` holds each expert's gate rows then its up rows (the fused
gate_up layout), ``w2`` its down projection. Routing (softmax, top-k, renormalisation) is the
model's: this op takes the chosen experts and weights.

gpt-oss's experts add two things, as keyword arguments: biases (``w13_bias [E, 2I]`` after the
first projection, ``w2_bias [E, H]`` after the second, before the routing weight), and their
activation, ``activation="swigluoai"``: the clamped SwiGLU of swigluoai_and_mul.py, with its
``swiglu_alpha`` and ``swiglu_limit``, in place of silu_and_mul.

As vLLM's fused MoE: the (token, slot) pairs are sorted by expert and each expert's group
padded to a multiple of ``BLOCK_M`` (``moe_align``, torch ops on the device, no host sync), so
a tile of rows belongs to one expert; one grouped GEMM per projection then runs every expert's
rows against that expert's weights in one launch (gate_up, then silu_and_mul, then down with
the routing weight folded in), and the k slots of each token are summed. An expert that no
token chose gets no tile; padding rows point past the last pair and are neither read nor
written.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import is_cuda, use_triton
from pagedserve.kernels.linear import linear
from pagedserve.kernels.mxfp4 import MXFP4Experts, decode_mxfp4
from pagedserve.kernels.silu_and_mul import silu_and_mul
from pagedserve.kernels.swigluoai_and_mul import swigluoai_and_mul, swigluoai_and_mul_ref


@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(
    a_ptr, w_ptr, scales_ptr, bias_ptr, out_ptr, sorted_pair_ids_ptr, block_expert_ptr,
    pair_weights_ptr, num_pairs, n_out, k_in, a_row_stride, w_expert_stride, w_row_stride,
    scales_expert_stride, scales_row_stride, bias_expert_stride, out_row_stride,
    TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, W_MXFP4: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M sorted (token, slot) pairs of one expert x BLOCK_N outputs.
    ``out[pair] = (A[row] @ W[e]^T (+ bias[e])) (* weight[pair])``; A's row is the pair's
    token (``A_PER_TOKEN``, the first projection) or the pair itself (the second). ``W_MXFP4``:
    W is MXFP4 (mxfp4.py): ``w_ptr`` its code bytes (two a byte along the inputs),
    ``scales_ptr`` a scale byte per 32 inputs, decoded into the tile in registers."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= 0:
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pair_ids_ptr + rows)
        valid = pair < num_pairs
        a_row = (pair // TOP_K) if A_PER_TOKEN else pair
        a_row = tl.where(valid, a_row, 0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_out
        w_base = w_ptr + expert.to(tl.int64) * w_expert_stride
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_in
            a = tl.load(
                a_ptr + a_row[:, None] * a_row_stride + ks[None, :],
                mask=valid[:, None] & k_ok[None, :], other=0.0,
            )  # fmt: skip
            w_ok = col_ok[None, :] & k_ok[:, None]
            if W_MXFP4:
                byte = tl.load(w_base + cols[None, :] * w_row_stride + ks[:, None] // 2, mask=w_ok)
                scale = tl.load(
                    scales_ptr + expert.to(tl.int64) * scales_expert_stride
                    + cols[None, :] * scales_row_stride + ks[:, None] // 32, mask=w_ok,
                )  # fmt: skip
                w = tl.where(w_ok, decode_mxfp4(byte, scale, ks[:, None]), 0.0).to(a.dtype)
            else:
                w = tl.load(
                    w_base + cols[None, :] * w_row_stride + ks[:, None], mask=w_ok, other=0.0
                )
            if DOT_FP32:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert.to(tl.int64) * bias_expert_stride + cols, mask=col_ok)
            acc += bias.to(tl.float32)[None, :]
        if MUL_WEIGHT:
            acc *= tl.load(pair_weights_ptr + tl.where(valid, pair, 0), mask=valid)[:, None]
        out_off = tl.where(valid, pair, 0).to(tl.int64)[:, None] * out_row_stride + cols[None, :]
        tl.store(
            out_ptr + out_off, acc.to(out_ptr.dtype.element_ty),
            mask=valid[:, None] & col_ok[None, :],
        )  # fmt: skip


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pair_ids [P], block_expert [P // block_m]) for ``topk_ids [T, k]``.

    Pair p = t * k + j. Each expert's pairs are contiguous (in pair order) and padded to a
    multiple of ``block_m`` with ``T * k`` (a pair no row reads); block b's expert is
    ``block_expert[b]``, -1 past the last padded group. ``P = T * k + E * (block_m - 1)``, an
    upper bound from shapes alone, so nothing waits for the device."""
    flat = topk_ids.flatten().long()
    num_pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    group_start = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = (
        torch.arange(num_pairs, device=flat.device)
        - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    )
    size = num_pairs + num_experts * (block_m - 1)
    size = triton.cdiv(size, block_m) * block_m
    sorted_pair_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pair_ids[group_start[sorted_experts] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, size, block_m, device=flat.device)
    group_end = torch.cumsum(padded, 0)
    block_expert = torch.searchsorted(group_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pair_ids, block_expert


def _grouped_gemm(a, w, bias, sorted_ids, block_expert, weights, top_k, per_token, block_m):
    num_pairs = weights.numel()
    n_out, k_in = w.shape[1], w.shape[2]
    out = torch.empty(num_pairs, n_out, dtype=a.dtype, device=a.device)
    dot_fp32 = a.dtype == torch.float32 or not is_cuda(a)
    block_n = max(16, min(64, triton.next_power_of_2(n_out)))  # tl.dot needs >= 16
    block_k = max(16, min(32 if dot_fp32 else 64, triton.next_power_of_2(k_in)))
    grid = (block_expert.numel(), triton.cdiv(n_out, block_n))
    mxfp4 = isinstance(w, MXFP4Experts)
    # MXFP4: the code bytes (strides in bytes, two inputs a byte), then the scale bytes;
    # otherwise the weight, and ``out`` standing in for the scales (never read)
    data, scales = (w.blocks, w.scales) if mxfp4 else (w, out)
    _grouped_gemm_kernel[grid](
        a, data, scales, out if bias is None else bias, out, sorted_ids, block_expert, weights,
        num_pairs, n_out, k_in, a.stride(0), data.stride(0), data.stride(1),
        *(scales.stride()[:2] if mxfp4 else (0, 0)),
        0 if bias is None else bias.stride(0), out.stride(0),
        TOP_K=top_k, A_PER_TOKEN=per_token, MUL_WEIGHT=not per_token, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_FP32=dot_fp32, W_MXFP4=mxfp4,
    )  # fmt: skip
    return out


ACTIVATIONS = ("silu", "swigluoai")


def _check(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation) -> None:
    n_experts, two_inter, size = w13.shape
    if hidden.dim() != 2 or hidden.shape[1] != size or two_inter % 2:
        raise ValueError(f"fused_moe: hidden {tuple(hidden.shape)} vs w13 {tuple(w13.shape)}")
    if w2.shape != (n_experts, size, two_inter // 2):
        raise ValueError(
            f"fused_moe: w2 {tuple(w2.shape)}, expected {(n_experts, size, two_inter // 2)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
            f"{tuple(topk_weights.shape)} must both be [T, k] for T = {hidden.shape[0]}"
        )
    for name, bias, shape in (("w13", w13_bias, w13.shape[:2]), ("w2", w2_bias, w2.shape[:2])):
        if bias is not None and bias.shape != shape:
            raise ValueError(f"fused_moe: {name}_bias {tuple(bias.shape)}, expected {tuple(shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: activation {activation!r}, one of {ACTIVATIONS}")


def _activate(gate_up: torch.Tensor, activation: str, alpha: float, limit: float):
    if activation == "swigluoai":
        return swigluoai_and_mul(gate_up, alpha, limit)
    return silu_and_mul(gate_up)


def fused_moe_triton(
    hidden, w13, w2, topk_weights, topk_ids, block_m: int = 16, *, w13_bias=None, w2_bias=None,
    activation: str = "silu", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
    ordered_sum: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Launch wrapper: align, gate_up grouped GEMM, the activation, down grouped GEMM
    (weighted), sum over the k slots (``ordered_sum``: slot after slot, elementwise, not a
    reduction whose order the reduce kernel picks by shape). Weights must be contiguous in
    their last dimension."""
    _check(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    n_tokens, top_k = topk_ids.shape
    if n_tokens == 0:
        return torch.zeros_like(hidden)
    hidden = hidden.contiguous()
    w13, w2 = (w if isinstance(w, MXFP4Experts) else w.contiguous() for w in (w13, w2))
    sorted_ids, block_expert = moe_align(topk_ids, w13.shape[0], block_m)
    weights = topk_weights.flatten().to(torch.float32).contiguous()
    pairs = (sorted_ids, block_expert, weights, top_k)
    gate_up = _grouped_gemm(hidden, w13, w13_bias, *pairs, True, block_m)
    act = _activate(gate_up, activation, swiglu_alpha, swiglu_limit)
    down = _grouped_gemm(act, w2, w2_bias, *pairs, False, block_m)
    slots = down.view(n_tokens, top_k, -1).float()
    if not ordered_sum:
        return slots.sum(1).to(hidden.dtype)
    out = slots[:, 0].clone()
    for j in range(1, top_k):
        out += slots[:, j]
    return out.to(hidden.dtype)


def _experts(hidden, w13, w2, topk_weights, topk_ids, gemm, act, w13_bias, w2_bias):
    """Per expert that some token chose, its rows at once (``gemm(x, w) = x @ w.T`` in fp32,
    the expert's bias added, ``act`` the activation), weighted and added into each token's row
    in expert order; a loop over experts, never over tokens."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.flatten()
    token_of = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(
        topk_ids.shape[1]
    )
    weights = topk_weights.flatten().float()
    for expert in torch.unique(flat_ids).tolist():
        pairs = (flat_ids == expert).nonzero().flatten()
        gate_up = gemm(hidden[token_of[pairs]].float(), w13[expert])
        if w13_bias is not None:
            gate_up += w13_bias[expert].float()
        y = gemm(act(gate_up).to(hidden.dtype).float(), w2[expert])
        if w2_bias is not None:
            y += w2_bias[expert].float()
        out.index_add_(0, token_of[pairs], y * weights[pairs, None])
    return out.to(hidden.dtype)


def _torch_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.float().t()


def _batch_invariant_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return linear(x, w.float().contiguous(), batch_invariant=True)


def _torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    return torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def fused_moe_ref(
    hidden, w13, w2, topk_weights, topk_ids, *, w13_bias=None, w2_bias=None,
    activation: str = "silu", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
) -> torch.Tensor:  # fmt: skip
    """Reference (and CPU path): per expert that some token chose, its rows at once, in fp32;
    a loop over experts, never over tokens."""
    _check(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    if activation == "swigluoai":
        act = partial(swigluoai_and_mul_ref, alpha=swiglu_alpha, limit=swiglu_limit)
    else:
        act = _torch_silu_and_mul
    return _experts(hidden, w13, w2, topk_weights, topk_ids, _torch_gemm, act, w13_bias, w2_bias)


def fused_moe(
    hidden, w13, w2, topk_weights, topk_ids, *, w13_bias=None, w2_bias=None,
    activation: str = "silu", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
    batch_invariant: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The MoE MLP of ``hidden [T, H]`` through the chosen experts; returns ``[T, H]``.
    ``w13_bias``/``w2_bias``/``activation``: gpt-oss's (the module docstring).

    ``batch_invariant``: each token's row the same bits whatever the other tokens. On a GPU
    (and under the interpreter) the grouped GEMMs' tiles already are (a row's sum runs over
    the same K steps in any tile), so only the k slots' sum is made sequential. On a CPU the
    reference's experts loop with kernels.linear's batch-invariant GEMM and the activation
    row by row (the numba silu_and_mul; swigluoai's torch ops, elementwise): an expert's row
    count is the batch's."""
    extra = dict(
        w13_bias=w13_bias, w2_bias=w2_bias, activation=activation, swiglu_alpha=swiglu_alpha,
        swiglu_limit=swiglu_limit,
    )  # fmt: skip
    if use_triton(hidden):
        return fused_moe_triton(
            hidden, w13, w2, topk_weights, topk_ids, **extra, ordered_sum=batch_invariant
        )
    if not batch_invariant:
        return fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids, **extra)
    _check(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    act = partial(_activate, activation=activation, alpha=swiglu_alpha, limit=swiglu_limit)
    gemm = _batch_invariant_gemm
    return _experts(hidden, w13, w2, topk_weights, topk_ids, gemm, act, w13_bias, w2_bias)
