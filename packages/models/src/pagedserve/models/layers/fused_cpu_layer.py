"""When a Llama decoder layer runs as one numba call on CPU (kernels/decoder_layer_numba.py).

The fused call does what the layer's modules do on the numba path, with the same kernels and
the same bits, minus ~100 us of Python a layer. It can only stand in for modules it knows: a
plain Llama layer whose linear layers hold one fp32 weight each (no quantization, no LoRA,
one rank), no per-head q/k norms (Qwen3), a dense MLP, biases on the qkv projection only
(Qwen2), no score soft cap, an fp32, fp16 or bf16 KV cache, and a step of at most ``MAX_ROWS`` rows whose
every sequence the numba attention covers. Anything else returns None and the caller runs the
modules, so this is purely a shortcut: it never decides what a layer computes.

What the layer hands the kernel (its weights as numpy views, its constants) is gathered at
its first small CPU step and kept on the layer (``fused_cpu``): by then the model is final.
The runner loads, quantizes and LoRA-wraps it before it runs anything, and nothing in
pagedserve swaps a layer's weights or linear method afterwards; code that does must call
:func:`forget_fused_layers`.
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace

import torch
from torch import nn

from pagedserve.kernels.dispatch import kernel_path
from pagedserve.models.interface import KVCache
from pagedserve.models.layers.attention import AttentionMetadata
from pagedserve.models.layers.linear_method import UnquantizedLinearMethod

MAX_FUSED_ROWS = 16  # dense_linear_numba.MAX_ROWS (not imported: numba loads on first use)


def _dense_weight(linear: nn.Module, bias_allowed: bool = False) -> torch.Tensor | None:
    """The layer's fp32 weight when it is a plain single-rank linear layer, else None."""
    if type(linear.linear_method) is not UnquantizedLinearMethod or linear.tp_size != 1:
        return None
    if linear.bias is not None and not bias_allowed:
        return None
    weight = linear.weight
    if weight.dtype is not torch.float32 or not weight.is_contiguous() or not weight.is_cpu:
        return None
    return weight


def _prepare(layer: nn.Module):
    """The layer's ``DecoderLayerWeights``, or False where the kernel cannot stand in for it."""
    attn, mlp = layer.self_attn, layer.mlp
    if not layer.dense_mlp or attn.q_norm is not None or attn.attn.logits_soft_cap is not None:
        return False
    linears = (
        _dense_weight(attn.qkv_proj, bias_allowed=True),
        _dense_weight(attn.o_proj),
        _dense_weight(mlp.gate_up_proj),
        _dense_weight(mlp.down_proj),
    )
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    cos_sin = attn.rotary_emb.cos_sin_cache
    tensors = (*(n.weight for n in norms), cos_sin, attn.qkv_proj.bias)
    if any(w is None for w in linears) or any(
        t is not None and (t.dtype is not torch.float32 or not t.is_cpu) for t in tensors
    ):
        return False
    from pagedserve.kernels.decoder_layer_numba import DecoderLayerWeights

    return DecoderLayerWeights.of(
        tuple((n.weight, n.eps) for n in norms),
        linears,
        attn.qkv_proj.bias,
        (attn.num_heads, attn.num_kv_heads, attn.head_dim),
        (cos_sin, attn.rotary_emb.is_neox),
        (attn.attn.scale, attn.attn.sliding_window, None),
    )


@cache
def _kernels() -> SimpleNamespace:
    """The fused kernel and the attention's planner, imported on the first CPU step (numba is
    not loaded on a GPU)."""
    from pagedserve.kernels import decoder_layer_numba
    from pagedserve.kernels.paged_attention_numba import NUMBA_MAX_Q_LEN
    from pagedserve.kernels.paged_attention_plan import step_plan

    return SimpleNamespace(
        fused=decoder_layer_numba, step_plan=step_plan, max_q_len=NUMBA_MAX_Q_LEN
    )


def forget_fused_layers(model: nn.Module) -> None:
    """Drop every layer's gathered weights (after replacing weights or linear methods)."""
    for module in model.modules():
        if hasattr(module, "fused_cpu"):
            module.fused_cpu = None


def fused_decoder_layer(
    layer: nn.Module,
    positions: torch.Tensor,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    kv_cache: KVCache,
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``layer(positions, hidden, residual, kv_cache, meta)`` as one numba call, or None where
    that cannot stand in for the modules (see the module docstring). The cheap checks come
    first: they are asked at every layer of every step, on every device."""
    if not (
        hidden.is_cpu
        and hidden.dtype is torch.float32
        and hidden.dim() == 2
        and hidden.shape[0] <= MAX_FUSED_ROWS
        and hidden.is_contiguous()
        and (residual is None or residual.is_contiguous())
        and layer.fused_cpu is not False
        and kernel_path(hidden, has_numba=True) == "numba"
    ):
        return None
    if layer.fused_cpu is None:
        layer.fused_cpu = _prepare(layer)
        if layer.fused_cpu is False:
            return None
    kernels, weights = _kernels(), layer.fused_cpu
    plan = kernels.step_plan(
        meta.block_tables, meta.seq_lens, meta.query_start_loc, kernels.max_q_len, None,
        weights.window, meta.kernel_plans,
    )  # fmt: skip
    if not kernels.fused.supports(hidden, kv_cache, plan):
        return None
    return kernels.fused.decoder_layer_numba(
        hidden, residual, weights, positions, kv_cache, meta.slot_mapping, plan
    )
