"""The interface a model architecture implements to run in pagedserve.

A new architecture is an ``nn.Module`` with these three methods, registered in
``loader.MODEL_CLASSES``; the model runner relies on nothing else:

- ``forward(input_ids, positions, kv_caches, attn_metadata)``: the new tokens of every scheduled
  sequence, flattened (``[T]`` ids and positions), through the layers over the paged KV cache
  (one ``(k_cache, v_cache)`` pair per layer, written by ``store_kv`` and read by
  ``paged_attention`` as ``attn_metadata`` describes; or, for multi-head latent attention, one
  ``(latent_cache,)``: kv_cache_spec.py); returns the hidden states ``[T, H]``.
- ``compute_logits(hidden)``: the LM head over the rows the runner picked, gathered across
  tensor-parallel ranks, as float32 ``[N, vocab_size]`` (the sampler's precision, whatever the
  model's dtype).
- ``load_weights(weights)``: (checkpoint name, tensor) pairs, each tensor possibly a lazy
  ``CheckpointTensor``; every parameter loaded exactly once, this rank's shard only.

The constructor takes ``(config: ModelConfig, par: ParallelContext | None)``.

A model that can be cut into pipeline stages (its registry entry says ``pipeline_parallel``)
builds only its stage's layers (``par.stage``, pipeline.py) and its ``forward`` takes a fifth,
optional argument, ``intermediate``: what the previous stage sent (None on the first stage); a
stage before the last returns ``IntermediateTensors`` instead of hidden states. A decoder that
can start from embeddings (the Llama family's) takes, after it, ``inputs_embeds`` ``[T, H]``:
the first stage's input rows, used instead of embedding ``input_ids``.

A model whose prompts take images (its registry entry says ``images``: LLaVA, llava.py;
Qwen2-VL, qwen2_vl.py) has two more methods: ``embed_input_ids(input_ids) -> [T, H]``, its text
embedding, and ``embed_images(pixel_values, grid_thw) -> [rows_i, H] per image``: a list of
each image's processed pixels (image_inputs.py: ``processed_images`` cuts the processor's
batch) and, for a model of dynamic resolution, each one's patch grid (else None). The runner
puts an image's rows in place of its ``config.image_token_id`` placeholders in the prompt's
embedded ids and passes the result as ``inputs_embeds``; its ``forward`` takes
``intermediate`` and ``inputs_embeds`` as a staged decoder's does, though it runs on one
stage. A model with M-RoPE (Qwen2-VL) also has ``mrope_positions(positions, images) -> [3,
n]`` and takes ``[3, T]`` positions in a step that holds images.

A pooling model (``ModelForPooling``) has the same ``forward`` and ``load_weights`` and, instead
of ``compute_logits``, a ``pooler`` (pooling.py) that says which rows make a sequence's vector
and turns it into the output. An encoder's ``kv_caches`` is empty and its ``attn_metadata`` an
``EncoderAttentionMetadata`` (whole sequences, no cache); a model that reads token types
(BERT's sentence pairs) says so with ``uses_token_type_ids`` and takes ``token_type_ids``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

from pagedserve.models.layers.attention import AttentionMetadata
from pagedserve.models.pooling import Pooler
from pagedserve.models.weights import CheckpointTensor

KVCache = tuple[torch.Tensor, ...]  # (k_cache, v_cache), or MLA's (latent_cache,)


@runtime_checkable
class ModelForCausalLM(Protocol):
    """A decoder-only language model over the paged KV cache."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``nn.Module.__call__``: runs ``forward`` (the runner calls the model this way)."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]
    ) -> None: ...


@runtime_checkable
class ModelForPooling(Protocol):
    """A model whose output is one vector per sequence (an embedding, class scores)."""

    pooler: Pooler

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata,
    ) -> torch.Tensor: ...

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]
    ) -> None: ...
