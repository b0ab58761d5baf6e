"""CPUModelRunner: the model runner a CPU gets, picked once when the engine loads.

A CPU server's steps are mostly small: a decode batch of a few rows, where each kernel takes
microseconds and a Llama layer makes some twelve calls through ``nn.Module``, dispatch and
tensor/numpy wrappers. At one row that Python was ~3 ms of a ~21 ms step. So for a step of at
most ``MAX_FUSED_ROWS`` rows this runner runs the model's decoder layers itself, each plain
Llama-family layer as one numba call (kernels/cpu/decoder_layer.py) that calls the very kernels
the modules call on the numba path, in the same order, with the same choices: the same bits,
so a step may switch paths (16 rows fused, 17 not) without changing a token. Every other
layer, and every other step, runs the model's own modules.

What it can stand in for is decided once, here, at load (the model is final by then: loaded,
quantized and LoRA-wrapped), for the architectures whose registry entry declares
``cpu_fused`` (pagedserve.models.registry; the README's table says which): a layer whose
linear layers hold one fp32 weight each, or a GGUF file's rows of blocks each, or 8-bit
weights (``--quantization int8|fp8`` at load, an fp8 checkpoint; no other quantization, no
LoRA, one rank), with no per-head q/k norms (Qwen3), a dense MLP, biases on
the qkv projection only (Qwen2) and no score soft cap. The fused kernel reads numpy views of
the layer's own tensors, so a weight changed in place is seen; a parameter replaced by
another object is not (nothing in pagedserve does that after load).

The step's attention work plan (kernels/cpu/paged_attention_plan.py: tiles, KV splits, the
parallel choice, the rows' key limits) depends on the batch's layout and the layer's window
only, so the runner builds it once per step and window and hands it to each fused layer; under
``--batch-invariant`` it is the batch-invariant plan, as the attention layers' own.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.engine.encoder_cache import embeddings_with_images
from pagedserve.engine.model_runner import ModelInput, ModelRunner
from pagedserve.kernels.dispatch import kernel_path
from pagedserve.models.layers.linear_method import UnquantizedLinearMethod
from pagedserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel
from pagedserve.models.quantization import WeightOnly8BitLinearMethod
from pagedserve.models.quantization_fp8 import Fp8CheckpointLinearMethod
from pagedserve.models.quantization_gguf import GGUFLinearMethod
from pagedserve.models.quantization_int4 import Int4LinearMethod
from pagedserve.models.registry import ARCHITECTURES

MAX_FUSED_ROWS = 16  # the decode GEMM's row limit (kernels/cpu/dense_linear.py MAX_ROWS)
# Linear layers holding 8-bit ``qweight`` rows and fp32 per-feature ``weight_scale``
EIGHT_BIT_METHODS = (WeightOnly8BitLinearMethod, Fp8CheckpointLinearMethod)


class CPUModelRunner(ModelRunner):
    """A ``ModelRunner`` whose small steps run fusable decoder layers as one numba call each."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        fusable = ARCHITECTURES[self.model_config.hf_architecture].cpu_fused
        self.fused_layers = fused_layer_weights(self.model) if fusable else None
        if self.fused_layers and kernel_path(torch.empty(0), True) == "numba":
            reads_blocks = [w is not None and w.reads_blocks for w in self.fused_layers]
            if any(reads_blocks):  # the base runner compiled the fp32 layer only
                from pagedserve.kernels.cpu.decoder_layer import warm_up

                warm_up((self.kv_cache_dtype,), gguf=True)

    def forward(self, model_input: ModelInput) -> torch.Tensor:
        hidden_states = self._forward_fused(model_input) if self.fused_layers else None
        if hidden_states is None:
            return super().forward(model_input)
        return hidden_states

    def _forward_fused(self, model_input: ModelInput) -> torch.Tensor | None:
        """``LlamaModel.forward`` with the fusable layers as one call each; None when the step
        cannot take it (too many rows, a sequence too long for the numba attention, a cache
        dtype it does not store, kernels forced to another path)."""
        input_ids = model_input.input_ids
        if input_ids.shape[0] > MAX_FUSED_ROWS or kernel_path(input_ids, True) != "numba":
            return None
        from pagedserve.kernels.cpu import decoder_layer
        from pagedserve.kernels.cpu.paged_attention import NUMBA_MAX_Q_LEN
        from pagedserve.kernels.cpu.paged_attention_plan import step_plan

        meta, positions = model_input.attn_metadata, model_input.positions
        decoder = decoder_of(self.model)
        plans = {}
        for weights in self.fused_layers:
            if weights is not None and weights.window not in plans:
                plans[weights.window] = step_plan(
                    meta.block_tables, meta.seq_lens, meta.query_start_loc,
                    NUMBA_MAX_Q_LEN, None, weights.window, self.model_config.batch_invariant,
                    meta.key_limits,
                )  # fmt: skip
        if model_input.image_rows is not None:  # a vision model's prompt: image rows written in
            hidden = embeddings_with_images(self.model, input_ids, model_input.image_rows)
        else:
            hidden = decoder.embed_tokens(input_ids)
        if not all(decoder_layer.supports(hidden, self.kv_caches[0], p) for p in plans.values()):
            return None
        residual = None
        for layer, weights, kv_cache in zip(
            decoder.layers, self.fused_layers, self.kv_caches, strict=True
        ):
            if weights is None:
                hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
            else:
                hidden, residual = decoder_layer.decoder_layer_numba(
                    hidden, residual, weights, positions, kv_cache, meta.slot_mapping,
                    plans[weights.window],
                )  # fmt: skip
        hidden, _ = decoder.norm(hidden, residual)
        return hidden


def decoder_of(model: nn.Module) -> LlamaModel | None:
    """The model's Llama decoder stack: its own, or a vision-language model's language
    model's (llava.py)."""
    decoder = getattr(getattr(model, "language_model", model), "model", None)
    return decoder if type(decoder) is LlamaModel else None


def fused_layer_weights(model: nn.Module) -> list | None:
    """Per decoder layer, what the fused kernel reads (``DecoderLayerWeights``) or None where
    it cannot stand in for the layer; None when no layer of the model can be fused."""
    decoder = decoder_of(model)
    if decoder is None:
        return None
    weights = [_layer_weights(layer) for layer in decoder.layers]
    return weights if any(w is not None for w in weights) else None


def _layer_weights(layer: nn.Module):
    if type(layer) is not LlamaDecoderLayer:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if (
        type(attn) is not LlamaAttention
        or type(mlp) is not LlamaMLP
        or attn.attn.logits_soft_cap is not None
    ):
        return None
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    linears = tuple(_dense_weight(p, bias_allowed=p is attn.qkv_proj) for p in projections)
    if any(w is None for w in linears):  # GGUF, 8-bit or 4-bit group layers: byte rows
        linears = tuple(_byte_rows(p, bias_allowed=p is attn.qkv_proj) for p in projections)
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    head_norms = () if attn.q_norm is None else (attn.q_norm, attn.k_norm)  # Qwen3's
    cos_sin = attn.rotary_emb.cos_sin_cache
    tensors = (*(n.weight for n in (*norms, *head_norms)), cos_sin, attn.qkv_proj.bias)
    if any(w is None for w in linears) or any(
        t is not None and (t.dtype is not torch.float32 or not t.is_cpu) for t in tensors
    ):
        return None
    from pagedserve.kernels.cpu.decoder_layer import DecoderLayerWeights

    return DecoderLayerWeights.of(
        tuple((n.weight, n.eps) for n in norms),
        linears,
        attn.qkv_proj.bias,
        (attn.num_heads, attn.num_kv_heads, attn.head_dim),
        (cos_sin, attn.rotary_emb.is_neox),
        (attn.attn.scale, attn.attn.sliding_window, None),
        getattr(attn.qkv_proj.linear_method, "batch_invariant", False),
        tuple((n.weight, n.eps) for n in head_norms) or None,
    )


def _byte_rows(linear: nn.Module, bias_allowed: bool = False) -> list | None:
    """The layer's parts of byte rows when it is a single-rank GGUF linear layer
    (quantization_gguf.py: ``[(uint8 rows, type id), ...]``), an 8-bit one quantized at load
    or stored as fp8 (quantization.py, quantization_fp8.py: ``[(uint8 rows, INT8_ROWS or
    E4M3_ROWS, per-feature scales)]``) or an AWQ / GPTQ one held as rows of 4-bit groups
    (quantization_int4.py: ``[(uint8 rows, INT4_GROUPS, None, input order or None)]``), else
    None."""
    method = type(linear.linear_method)
    if method not in (GGUFLinearMethod, Int4LinearMethod, *EIGHT_BIT_METHODS):
        return None
    if linear.tp_size != 1 or (linear.bias is not None and not bias_allowed):
        return None
    if method is Int4LinearMethod:
        if not linear.linear_method.cpu_rows:
            return None
        from pagedserve.kernels.cpu.gguf_blocks import INT4_GROUPS

        return [(linear.qrows, INT4_GROUPS, None, linear.input_perm)]
    if method in EIGHT_BIT_METHODS:
        from pagedserve.kernels.cpu.weight_only_linear import ROW_TYPES

        kind = ROW_TYPES[linear.qweight.dtype]
        return [(linear.qweight.view(torch.uint8), kind, linear.weight_scale)]
    if linear.weight_parts is None:
        return [(linear.weight, linear.weight_type)]
    return list(zip(linear.weight_parts, linear.weight_part_types, strict=True))


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
