"""BERT-family encoders: BertModel, RoBERTa / XLM-RoBERTa (the same code with other names), as
embedding models and as sequence classifiers (cross-encoders).

An encoder reads a whole sequence at once with bidirectional attention (every token sees every
other), so it has no KV cache and no block table: each step is whole sequences end to end,
described by an ``EncoderAttentionMetadata`` (layers/attention.py). Layers are post-norm:
``LayerNorm(x + attention(x))``, then ``LayerNorm(x + down(gelu(up(x))))``.

RoBERTa differs from BERT in names only, for what pagedserve runs: its checkpoints say
``roberta.`` where BERT's say ``bert.``, its positions start at ``pad_token_id + 1``, and its
classifier head is ``classifier.dense`` / ``classifier.out_proj`` where BERT's is
``bert.pooler.dense`` / ``classifier``. Both heads are dense -> tanh -> linear over the [CLS]
row, so both load into one ``ClassifierHead``.

Module names follow transformers' where they can; ``_rename`` maps the rest (the fused q/k/v,
``attention.output`` -> ``o_proj``...).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.kernels import gelu
from pagedserve.models.config import ModelConfig, ModelLoadError
from pagedserve.models.interface import KVCache
from pagedserve.models.layers.attention import EncoderAttention, EncoderAttentionMetadata
from pagedserve.models.layers.embedding import VocabParallelEmbedding
from pagedserve.models.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.models.layers.norm import LayerNorm
from pagedserve.models.parallel import ParallelContext
from pagedserve.models.pooling import (
    Pooler,
    PoolerConfig,
    PoolingType,
    id2label_of,
    num_labels_of,
    read_pooler_config,
)
from pagedserve.models.weights import CheckpointTensor, load_stacked_weights

ROBERTA_ARCHITECTURES = (
    "RobertaModel",
    "XLMRobertaModel",
    "RobertaForSequenceClassification",
    "XLMRobertaForSequenceClassification",
)


def position_offset(config: ModelConfig) -> int:
    """Where positions start in the position table: 0 for BERT, ``pad_token_id + 1`` for
    RoBERTa (its table's first rows belong to padding)."""
    if config.hf_architecture in ROBERTA_ARCHITECTURES:
        return int(config.hf_config.get("pad_token_id", 1)) + 1
    return 0


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, hidden, dtype = config.hf_config, config.hidden_size, config.torch_dtype
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden, dtype=dtype)
        self.position_embeddings = nn.Embedding(c["max_position_embeddings"], hidden, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(c.get("type_vocab_size", 2), hidden, dtype=dtype)
        for table in (self.position_embeddings, self.token_type_embeddings):
            table.weight.requires_grad_(False)
        self.LayerNorm = LayerNorm(hidden, c.get("layer_norm_eps", 1e-12), dtype)
        self.position_offset = position_offset(config)

    def forward(self, input_ids, positions, token_type_ids=None) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids)
        hidden = hidden + self.position_embeddings(positions + self.position_offset)
        if token_type_ids is None:  # every token of type 0 (no sentence pair)
            hidden = hidden + self.token_type_embeddings.weight[0]
        else:
            hidden = hidden + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(hidden)


class BertAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, heads, dtype = config.hidden_size, config.num_attention_heads, config.torch_dtype
        head_dim = hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, heads, bias=True, dtype=dtype)
        self.o_proj = RowParallelLinear(hidden, hidden, bias=True, dtype=dtype)
        self.attn = EncoderAttention(heads, heads, head_dim, head_dim**-0.5)
        self.q_size = self.qkv_proj.q_size

    def forward(self, hidden: torch.Tensor, meta: EncoderAttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split_with_sizes([self.q_size] * 3, dim=-1)
        return self.o_proj(self.attn(q, k, v, meta))


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, hidden, dtype = config.hf_config, config.hidden_size, config.torch_dtype
        if c.get("hidden_act", "gelu") != "gelu":
            raise ModelLoadError(
                f"unsupported encoder activation {c.get('hidden_act')!r} (gelu is)"
            )
        if c.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(
                f"position_embedding_type {c['position_embedding_type']!r} is not supported "
                "(absolute is)"
            )
        eps = c.get("layer_norm_eps", 1e-12)
        self.attention = BertAttention(config)
        self.attention_norm = LayerNorm(hidden, eps, dtype)
        self.up_proj = ColumnParallelLinear(hidden, c["intermediate_size"], bias=True, dtype=dtype)
        self.down_proj = RowParallelLinear(c["intermediate_size"], hidden, bias=True, dtype=dtype)
        self.output_norm = LayerNorm(hidden, eps, dtype)

    def forward(self, hidden: torch.Tensor, meta: EncoderAttentionMetadata) -> torch.Tensor:
        hidden = self.attention_norm(hidden + self.attention(hidden, meta))
        return self.output_norm(hidden + self.down_proj(gelu(self.up_proj(hidden))))


class BertEncoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))


class ClassifierHead(nn.Module):
    """dense -> tanh -> out_proj over the [CLS] row: BERT's pooler + classifier, RoBERTa's
    classification head."""

    def __init__(self, config: ModelConfig, num_labels: int) -> None:
        super().__init__()
        hidden, dtype = config.hidden_size, config.torch_dtype
        self.dense = ColumnParallelLinear(hidden, hidden, bias=True, dtype=dtype)
        self.out_proj = ColumnParallelLinear(hidden, num_labels, bias=True, dtype=dtype)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(pooled)))


class BertModel(nn.Module):
    """An encoder embedding model: its pooling as its sentence-transformers config says
    (default: the [CLS] row, unnormalised, as transformers' BertModel gives it)."""

    uses_token_type_ids = True  # the runner passes each token's segment (sentence pairs)

    def __init__(self, config: ModelConfig, par: ParallelContext | None = None) -> None:
        super().__init__()
        if par is not None and par.tp_size > 1:
            raise ModelLoadError("encoder models run on one device (tensor_parallel_size 1)")
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = self._pooler(config)

    def _pooler(self, config: ModelConfig) -> Pooler:
        default = PoolerConfig(PoolingType.CLS, normalize=False)
        pooling = read_pooler_config(config.model, default)
        return Pooler("embed", pooling.pooling_type, pooling.normalize)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: EncoderAttentionMetadata,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last layer's hidden states ``[T, H]`` (``kv_caches`` is empty: no cache)."""
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, attn_metadata)
        return hidden

    stacked_params = [
        ("qkv_proj", "query", "q"),
        ("qkv_proj", "key", "k"),
        ("qkv_proj", "value", "v"),
    ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]) -> None:
        load_stacked_weights(self, weights, self.stacked_params, self._rename)

    def _rename(self, name: str) -> str | None:
        """A checkpoint name -> ours; None for what an embedding model does not use (BERT's
        pooler dense layer: sentence-transformers pools the hidden states themselves)."""
        for prefix in ("bert.", "roberta."):
            name = name.removeprefix(prefix)
        if name.startswith(("pooler.", "classifier.", "lm_head.", "cls.")):
            return self._rename_head(name)
        if name.endswith("position_ids"):
            return None
        for old, new in _LAYER_NAMES:
            name = name.replace(old, new)
        return name

    def _rename_head(self, name: str) -> str | None:
        return None


# transformers' layer names -> ours (attention.output.* before output.*: order matters)
_LAYER_NAMES = (
    (".attention.self.", ".attention."),
    (".attention.output.dense.", ".attention.o_proj."),
    (".attention.output.LayerNorm.", ".attention_norm."),
    (".intermediate.dense.", ".up_proj."),
    (".output.dense.", ".down_proj."),
    (".output.LayerNorm.", ".output_norm."),
)


class BertForSequenceClassification(BertModel):
    """A cross-encoder / classifier: the [CLS] row through ``ClassifierHead``; its scores go
    through softmax (sigmoid for one label, a relevance score) unless a request says not."""

    def _pooler(self, config: ModelConfig) -> Pooler:
        num_labels = num_labels_of(config.hf_config)
        head = ClassifierHead(config, num_labels)
        labels = id2label_of(config.hf_config, num_labels)
        return Pooler(
            "classify", PoolingType.CLS, head=head, num_labels=num_labels, id2label=labels
        )

    def _rename_head(self, name: str) -> str | None:
        heads = {
            "pooler.dense.": "pooler.head.dense.",  # BERT
            "classifier.dense.": "pooler.head.dense.",  # RoBERTa
            "classifier.out_proj.": "pooler.head.out_proj.",
            "classifier.": "pooler.head.out_proj.",  # BERT's classifier (after RoBERTa's)
        }
        for old, new in heads.items():
            if name.startswith(old):
                return new + name.removeprefix(old)
        return None
