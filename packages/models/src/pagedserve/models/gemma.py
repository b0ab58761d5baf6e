"""Gemma 2 and Gemma 3 (text): Llama's skeleton with Gemma's own arithmetic.

What differs from Llama, each as transformers computes it:

- RMSNorm scales by ``1 + weight`` (checkpoints store the offset from one); the loader adds
  the one once, so the layer runs the ordinary ``rms_norm`` kernel;
- the embedding is multiplied by ``sqrt(hidden_size)`` (rounded to the model's dtype first);
- four norms per layer: after attention and after the MLP as well as before each;
- GeGLU MLP: ``gelu_tanh(gate) * up``;
- queries scaled by ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
- alternating local (sliding-window) and global layers, from ``layer_types``;
- Gemma 2: attention scores soft-capped (``attn_logit_softcapping``) and final logits too
  (``final_logit_softcapping``);
- Gemma 3: per-head q/k RMSNorm (``1 + weight`` as well) and a rope base per layer type (the
  local layers' ``rope_local_base_freq``, the global layers' ``rope_theta`` and scaling); one
  cos/sin cache per type, shared by the layers of that type.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.kernels import gelu_tanh
from pagedserve.models.config import ModelConfig
from pagedserve.models.interface import KVCache
from pagedserve.models.layers.attention import AttentionMetadata, PagedAttention
from pagedserve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.models.layers.norm import RMSNorm
from pagedserve.models.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.parallel import ParallelContext
from pagedserve.models.weights import CheckpointTensor, default_weight_loader

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu")  # every Gemma checkpoint means tanh


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight is the offset from one: loaded as ``1 + weight``."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(hidden_size, eps, dtype)
        self.weight.weight_loader = _load_plus_one  # type: ignore[attr-defined]


def _load_plus_one(param: nn.Parameter, loaded: torch.Tensor | CheckpointTensor) -> None:
    default_weight_loader(param, loaded)
    param.data += 1


def gemma_rope_parameters(hf_config: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """A layer type's rope settings: transformers 5's per-type ``rope_parameters``, or the
    older spelling (``rope_local_base_freq`` for local layers, ``rope_theta`` + ``rope_scaling``
    for global ones; Gemma 2 has one base for both)."""
    per_type = hf_config.get("rope_parameters") or {}
    if isinstance(per_type.get(layer_type), dict):
        return rope_parameters({"rope_parameters": per_type[layer_type]})
    if layer_type == "sliding_attention" and "rope_local_base_freq" in hf_config:
        return rope_parameters({"rope_theta": hf_config["rope_local_base_freq"]})
    return rope_parameters(hf_config)


class GemmaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, par: ParallelContext, layer_idx: int, rope: RotaryEmbedding
    ) -> None:
        super().__init__()
        c, dtype, head_dim = config.hf_config, config.torch_dtype, config.head_dim
        bias = bool(c.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads, config.num_kv_heads,
            bias=bias, dtype=dtype, **par.shard_args(),
        )  # fmt: skip
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, bias=bias, dtype=dtype,
            all_reduce=par.all_reduce, **par.shard_args(),
        )  # fmt: skip
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_norm = self.k_norm = None
        if config.architecture == "Gemma3ForCausalLM":
            self.q_norm = GemmaRMSNorm(head_dim, c["rms_norm_eps"], dtype)
            self.k_norm = GemmaRMSNorm(head_dim, c["rms_norm_eps"], dtype)
        self.rotary_emb = rope
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            head_dim,
            float(c.get("query_pre_attn_scalar") or head_dim) ** -0.5,
            sliding_window=config.sliding_windows[layer_idx],
            logits_soft_cap=config.attention_logits_soft_cap,
        )

    def forward(self, positions, hidden, kv_cache: KVCache, meta: AttentionMetadata):
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split_with_sizes(
            [self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous(), kv_cache, meta))


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig, par: ParallelContext) -> None:
        super().__init__()
        c, dtype = config.hf_config, config.torch_dtype
        act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in GELU_TANH:
            raise ValueError(f"unsupported Gemma activation {act!r} (gelu_pytorch_tanh is)")
        inter = c["intermediate_size"]
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], dtype=dtype, **par.shard_args()
        )
        self.down_proj = RowParallelLinear(
            inter, config.hidden_size, dtype=dtype, all_reduce=par.all_reduce, **par.shard_args()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(gelu_tanh(gate) * up)


class GemmaDecoderLayer(nn.Module):
    """Norm, attention, norm; norm, MLP, norm: the residual adds fused into the next norm."""

    def __init__(
        self, config: ModelConfig, par: ParallelContext, layer_idx: int, rope: RotaryEmbedding
    ) -> None:
        super().__init__()
        eps, dtype, size = config.hf_config["rms_norm_eps"], config.torch_dtype, config.hidden_size
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.self_attn = GemmaAttention(config, par, layer_idx, rope)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.mlp = GemmaMLP(config, par)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def forward(self, positions, hidden, residual, kv_cache: KVCache, meta: AttentionMetadata):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, par: ParallelContext) -> None:
        super().__init__()
        c = config.hf_config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, dtype=config.torch_dtype,
            all_reduce=par.all_reduce, **par.shard_args(),
        )  # fmt: skip
        self.register_buffer(
            "normalizer",
            torch.tensor(config.hidden_size**0.5, dtype=config.torch_dtype),
            persistent=False,
        )
        layer_types = config.layer_types  # the rope base follows the kind, window or not
        ropes = {
            kind: RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, gemma_rope_parameters(c, kind)
            )
            for kind in sorted(set(layer_types))
        }
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, par, i, ropes[kind]) for i, kind in enumerate(layer_types)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, c["rms_norm_eps"], config.torch_dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, hidden]``: the token embedding times ``sqrt(hidden_size)``."""
        return self.embed_tokens(input_ids) * self.normalizer

    def forward(
        self,
        input_ids,
        positions,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``inputs_embeds`` [T, H]: rows already embedded (and scaled, as ``embed`` scales
        them: a multimodal model's text embeddings with its image rows in place), used instead
        of embedding ``input_ids``."""
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 and Gemma 3 (text) for causal generation over a paged KV cache; loading and
    the LM head are Llama's, with Gemma 2's final logit soft-capping."""

    def __init__(self, config: ModelConfig, par: ParallelContext | None = None) -> None:
        nn.Module.__init__(self)
        par = par or ParallelContext()
        self.config = config
        self.model = GemmaModel(config, par)
        self.tie_word_embeddings = bool(config.hf_config.get("tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, dtype=config.torch_dtype,
            gather=par.gather, **par.shard_args(),
        )  # fmt: skip
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping = config.hf_config.get("final_logit_softcapping")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The whole stack: Gemma is not cut into pipeline stages (registry.py).
        ``inputs_embeds``: as ``GemmaModel.forward``."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
