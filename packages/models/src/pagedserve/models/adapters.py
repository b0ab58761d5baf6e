"""Decoder models as pooling models (vLLM's ``--convert embed|classify``): the same layers over
the same paged KV cache, with the LM head replaced by a pooling head.

- ``embed``: the last token's hidden state (it has seen the whole prompt), L2-normalised:
  what Qwen3-Embedding and gte-Qwen2 serve (a sentence-transformers config in the folder
  overrides either choice);
- ``classify``: the last token's hidden state through the checkpoint's ``score`` layer
  (``*ForSequenceClassification`` checkpoints, reward models with one label).

The converted class is a subclass of the family's causal-LM class built at load time (as
vLLM's ``as_embedding_model`` does): its layers, its weight names and its loading stay the
family's; only the LM head goes (it is never loaded) and the pooler comes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.models.config import ModelConfig, ModelLoadError
from pagedserve.models.layers.linear import ColumnParallelLinear
from pagedserve.models.parallel import ParallelContext
from pagedserve.models.pooling import (
    Pooler,
    PoolerConfig,
    PoolingType,
    id2label_of,
    num_labels_of,
    read_pooler_config,
)
from pagedserve.models.weights import CheckpointTensor


def as_pooling_model(cls: type[nn.Module], task: str) -> type[nn.Module]:
    """``cls`` (a causal LM with a ``model`` body and an ``lm_head``) as a ``task`` model."""
    if task not in ("embed", "classify"):
        raise ModelLoadError(f"--convert {task!r}: embed or classify")

    class DecoderForPooling(cls):
        def __init__(self, config: ModelConfig, par: ParallelContext | None = None) -> None:
            if par is not None and par.tp_size > 1:
                raise ModelLoadError("pooling models run on one device (tensor_parallel_size 1)")
            super().__init__(config, par)
            del self.lm_head  # never loaded: a pooling model has no logits
            self.pooler = _decoder_pooler(config, task)

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            raise TypeError(f"{type(self).__name__} is a pooling model: it has no logits")

        def load_weights(
            self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]
        ) -> None:
            super().load_weights(_pooling_weights(weights))

    suffix = "ForEmbedding" if task == "embed" else "ForSequenceClassification"
    DecoderForPooling.__name__ = DecoderForPooling.__qualname__ = cls.__name__ + suffix
    return DecoderForPooling


def _decoder_pooler(config: ModelConfig, task: str) -> Pooler:
    if task == "embed":
        pooling = read_pooler_config(config.model, PoolerConfig(PoolingType.LAST, normalize=True))
        return Pooler("embed", pooling.pooling_type, pooling.normalize)
    num_labels = num_labels_of(config.hf_config)
    head = ColumnParallelLinear(
        config.hidden_size, num_labels, bias=False, dtype=config.torch_dtype
    )
    labels = id2label_of(config.hf_config, num_labels)
    return Pooler("classify", PoolingType.LAST, head=head, num_labels=num_labels, id2label=labels)


def _pooling_weights(weights):
    """The checkpoint without its LM head; its ``score`` layer (a classifier's) as the
    pooler's head."""
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue
        if name.startswith("score."):
            name = "pooler.head." + name.removeprefix("score.")
        yield name, tensor
