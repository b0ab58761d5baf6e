"""GPT-2: learned absolute positions, LayerNorm, GELU (tanh), and Conv1D weights.

GPT-2 checkpoints store linear weights as Conv1D, ``[in, out]``: ``load_weights`` transposes them
into our ``[out, in]`` layout. The attention projection ``c_attn`` is already fused q/k/v.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.kernels import gelu_tanh
from pagedserve.models.config import ModelConfig
from pagedserve.models.interface import KVCache
from pagedserve.models.layers.attention import AttentionMetadata, PagedAttention
from pagedserve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.models.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.models.layers.norm import LayerNorm
from pagedserve.models.parallel import ParallelContext
from pagedserve.models.weights import CheckpointTensor, load_stacked_weights

_CONV1D = ("c_attn.weight", "c_proj.weight", "c_fc.weight")


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig, par: ParallelContext) -> None:
        super().__init__()
        c = config.hf_config
        if c.get("scale_attn_by_inverse_layer_idx") or c.get("reorder_and_upcast_attn"):
            raise ValueError(
                "GPT-2 variants with scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn are not supported"
            )
        hidden, heads, dtype = config.hidden_size, config.num_attention_heads, config.torch_dtype
        head_dim = hidden // heads
        self.c_attn = QKVParallelLinear(
            hidden, head_dim, heads, heads, bias=True, dtype=dtype, **par.shard_args()
        )
        self.c_proj = RowParallelLinear(
            hidden, hidden, bias=True, dtype=dtype, all_reduce=par.all_reduce, **par.shard_args()
        )
        self.q_size = self.c_attn.q_size
        scale = head_dim**-0.5 if c.get("scale_attn_weights", True) else 1.0
        self.attn = PagedAttention(self.c_attn.num_heads, self.c_attn.num_kv_heads, head_dim, scale)

    def forward(
        self, hidden: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.c_attn(hidden).split([self.q_size] * 3, dim=-1)
        return self.c_proj(
            self.attn(q.contiguous(), k.contiguous(), v.contiguous(), kv_cache, meta)
        )


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig, par: ParallelContext) -> None:
        super().__init__()
        c, hidden, dtype = config.hf_config, config.hidden_size, config.torch_dtype
        if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported GPT-2 activation {c.get('activation_function')!r}")
        inner = c.get("n_inner") or 4 * hidden
        self.c_fc = ColumnParallelLinear(hidden, inner, bias=True, dtype=dtype, **par.shard_args())
        self.c_proj = RowParallelLinear(
            inner, hidden, bias=True, dtype=dtype, all_reduce=par.all_reduce, **par.shard_args()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(gelu_tanh(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig, par: ParallelContext) -> None:
        super().__init__()
        eps, hidden, dtype = (
            config.hf_config.get("layer_norm_epsilon", 1e-5),
            config.hidden_size,
            config.torch_dtype,
        )
        self.ln_1 = LayerNorm(hidden, eps, dtype)
        self.attn = GPT2Attention(config, par)
        self.ln_2 = LayerNorm(hidden, eps, dtype)
        self.mlp = GPT2MLP(config, par)

    def forward(
        self, hidden: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), kv_cache, meta)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    def __init__(self, config: ModelConfig, par: ParallelContext) -> None:
        super().__init__()
        hidden, dtype = config.hidden_size, config.torch_dtype
        self.wte = VocabParallelEmbedding(
            config.vocab_size, hidden, dtype=dtype, all_reduce=par.all_reduce, **par.shard_args()
        )
        self.wpe = nn.Embedding(config.max_position_embeddings, hidden, dtype=dtype)
        self.wpe.weight.requires_grad_(False)
        self.h = nn.ModuleList(GPT2Block(config, par) for _ in range(config.num_layers))
        self.ln_f = LayerNorm(hidden, config.hf_config.get("layer_norm_epsilon", 1e-5), dtype)

    def forward(
        self, input_ids, positions, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches, strict=True):
            hidden = block(hidden, kv_cache, meta)
        return self.ln_f(hidden)


class GPT2LMHeadModel(nn.Module):
    """GPT-2 for causal generation over a paged KV cache (the LM head is tied to wte)."""

    stacked_params = [
        # c_attn is fused q/k/v in the checkpoint: it is split here and fed to the qkv loader.
        ("c_attn", "c_attn_q", "q"),
        ("c_attn", "c_attn_k", "k"),
        ("c_attn", "c_attn_v", "v"),
    ]

    def __init__(self, config: ModelConfig, par: ParallelContext | None = None) -> None:
        super().__init__()
        par = par or ParallelContext()
        self.config = config
        self.transformer = GPT2Model(config, par)
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            dtype=config.torch_dtype,
            gather=par.gather,
            **par.shard_args(),
        )
        self.lm_head.weight = self.transformer.wte.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.transformer(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]) -> None:
        load_stacked_weights(self, self._normalise(weights), self.stacked_params, lambda n: n)

    def _normalise(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """Prefix names with ``transformer.``, transpose Conv1D weights, split c_attn into q/k/v."""
        for name, tensor in weights:
            if name.startswith("lm_head.") or name.endswith((".attn.bias", ".attn.masked_bias")):
                continue
            if not name.startswith("transformer."):
                name = "transformer." + name
            if name.endswith(_CONV1D):
                tensor = tensor.t()
            if ".c_attn." in name:
                for part, chunk in zip("qkv", tensor.chunk(3, dim=0), strict=True):
                    yield name.replace(".c_attn.", f".c_attn_{part}."), chunk
            else:
                yield name, tensor
