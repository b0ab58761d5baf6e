"""The Llama family: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

Module names follow transformers' so checkpoint names map on directly; the only renames are the
fused projections (q/k/v -> qkv_proj, gate/up -> gate_up_proj), which ``load_weights`` handles.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.kernels import silu_and_mul
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
from pagedserve.models.parallel import ParallelContext
from pagedserve.models.pipeline import IntermediateTensors, MissingLayer
from pagedserve.models.weights import CheckpointTensor, load_stacked_weights


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, par: ParallelContext, layer_idx: int) -> None:
        super().__init__()
        c, dtype = config.hf_config, config.torch_dtype
        arch = config.architecture
        head_dim = config.head_dim
        qkv_bias = bool(c.get("attention_bias", False)) or arch == "Qwen2ForCausalLM"
        o_bias = bool(c.get("attention_bias", False)) and arch != "Qwen2ForCausalLM"
        if arch == "Qwen2MoeForCausalLM":  # its config says (``qkv_bias``, on by default)
            qkv_bias, o_bias = bool(c.get("qkv_bias", True)), False
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_kv_heads,
            bias=qkv_bias,
            dtype=dtype,
            **par.shard_args(),
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            bias=o_bias,
            dtype=dtype,
            all_reduce=par.all_reduce,
            **par.shard_args(),
        )
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_norm = self.k_norm = None
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            self.q_norm = RMSNorm(head_dim, c["rms_norm_eps"], dtype)
            self.k_norm = RMSNorm(head_dim, c["rms_norm_eps"], dtype)
        self.rotary_emb = RotaryEmbedding(
            head_dim, config.max_position_embeddings, rope_parameters(c)
        )
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            head_dim,
            head_dim**-0.5,
            sliding_window=config.sliding_windows[layer_idx],
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ):
        num_tokens = hidden.shape[0]
        # split_with_sizes: Tensor.split's Python wrapper costs ~2 us more, 30 times a step
        q, k, v = self.qkv_proj(hidden).split_with_sizes(
            [self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v.contiguous(), kv_cache, meta)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """The gated SiLU MLP; ``intermediate_size`` other than the config's for the shared
    experts of MoE blocks (Qwen2-MoE, DeepSeek)."""

    def __init__(
        self, config: ModelConfig, par: ParallelContext, intermediate_size: int | None = None
    ) -> None:
        super().__init__()
        c = config.hf_config
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {c.get('hidden_act')!r} (silu is)")
        bias = bool(c.get("mlp_bias", False))
        inter = intermediate_size or c["intermediate_size"]
        dtype = config.torch_dtype
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], bias=bias, dtype=dtype, **par.shard_args()
        )
        self.down_proj = RowParallelLinear(
            inter,
            config.hidden_size,
            bias=bias,
            dtype=dtype,
            all_reduce=par.all_reduce,
            **par.shard_args(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        par: ParallelContext,
        layer_idx: int,
        mlp_factory=None,
        attention_factory=None,
    ) -> None:
        super().__init__()
        eps, dtype = config.hf_config["rms_norm_eps"], config.torch_dtype
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        # Llama's attention, or what the model's attention_factory builds (DeepSeek's MLA)
        if attention_factory is None:
            self.self_attn = LlamaAttention(config, par, layer_idx)
        else:
            self.self_attn = attention_factory(layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        # a dense MLP, or what the model's mlp_factory builds for this layer (MoE blocks)
        self.mlp = LlamaMLP(config, par) if mlp_factory is None else mlp_factory(layer_idx)

    def forward(self, positions, hidden, residual, kv_cache: KVCache, meta: AttentionMetadata):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """The decoder stack, or one pipeline stage of it (models/pipeline.py): the embedding on
    the first stage, the stage's layers, the final norm on the last."""

    def __init__(
        self, config: ModelConfig, par: ParallelContext, mlp_factory=None, attention_factory=None
    ) -> None:
        super().__init__()
        stage = self.stage = par.stage
        self.stage_layers = stage.layer_range(config.num_layers)
        self.embed_tokens = (
            VocabParallelEmbedding(
                config.vocab_size,
                config.hidden_size,
                dtype=config.torch_dtype,
                all_reduce=par.all_reduce,
                **par.shard_args(),
            )
            if stage.is_first
            else MissingLayer()
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, par, i, mlp_factory, attention_factory)
            if i in self.stage_layers
            else MissingLayer()
            for i in range(config.num_layers)
        )
        self.norm = (
            RMSNorm(config.hidden_size, config.hf_config["rms_norm_eps"], config.torch_dtype)
            if stage.is_last
            else MissingLayer()
        )

    def forward(
        self,
        input_ids,
        positions,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """The last stage's normalised hidden states; an earlier stage's ``IntermediateTensors``
        for the next. ``intermediate``: what the previous stage sent (None on the first).
        ``inputs_embeds`` [T, H]: the first stage starts from these rows instead of embedding
        ``input_ids`` (a multimodal model's text embeddings with its image rows in place)."""
        if intermediate is not None:
            hidden, residual = intermediate.hidden, intermediate.residual
        elif inputs_embeds is not None:
            hidden, residual = inputs_embeds, None
        else:
            hidden, residual = self.embed_tokens(input_ids), None
        own_layers = self.layers[self.stage_layers.start : self.stage_layers.stop]
        for layer, kv_cache in zip(own_layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        if not self.stage.is_last:
            return IntermediateTensors(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Llama, Mistral, Qwen2 and Qwen3 for causal generation over a paged KV cache."""

    stacked_params = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, config: ModelConfig, par: ParallelContext | None = None) -> None:
        super().__init__()
        par = par or ParallelContext()
        self.config = config
        self.model = LlamaModel(
            config, par, self.mlp_factory(config, par), self.attention_factory(config, par)
        )
        self.tie_word_embeddings = bool(config.hf_config.get("tie_word_embeddings", False))
        self.lm_head = (
            ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                dtype=config.torch_dtype,
                gather=par.gather,
                **par.shard_args(),
            )
            if par.stage.is_last
            else MissingLayer()
        )
        # tied: one tensor when one stage holds both; a last stage without the embedding loads
        # the embedding's tensor as its head (load_weights)
        if self.tie_word_embeddings and par.stage.count == 1:
            self.lm_head.weight = self.model.embed_tokens.weight

    def mlp_factory(self, config: ModelConfig, par: ParallelContext):
        """None: every layer's MLP is dense. A sparse model returns ``layer_idx -> module``."""
        return None

    def attention_factory(self, config: ModelConfig, par: ParallelContext):
        """None: Llama's attention. Another kind (DeepSeek's MLA) returns ``layer_idx ->
        module``."""
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(
            input_ids, positions, kv_caches, attn_metadata, intermediate, inputs_embeds
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]) -> None:
        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name:
                return None
            if self.tie_word_embeddings and name == "lm_head.weight":
                return None
            if name == "model.embed_tokens.weight" and isinstance(
                self.model.embed_tokens, MissingLayer
            ):  # a later pipeline stage: the tied head's tensor, or another stage's
                return "lm_head.weight" if self.tie_word_embeddings else None
            return name

        load_stacked_weights(self, weights, self.stacked_params, rename)
