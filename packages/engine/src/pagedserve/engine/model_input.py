"""``ModelInput``: one step's flat batch, the model's inputs as every rank runs them.

Rank 0's runner builds it from the scheduler's step (model_runner.py ``prepare_input``); under
tensor or pipeline parallelism the other ranks receive it whole (distributed/step_channel.py,
which sends its fields by name) and run the same forward on their part of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.models import AttentionMetadata, EncoderAttentionMetadata


@dataclass
class ModelInput:
    """A step's flat batch as every tensor-parallel rank runs it (rank 0 alone keeps the
    ``LogitsLayout`` that says which logits row is what)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata | EncoderAttentionMetadata
    logits_indices: torch.Tensor
    # the decode bucket this batch was padded to (its tensors are views of the runner's
    # persistent buffers); None for an unpadded batch
    padded_batch_size: int | None = None
    # each token's LoRA slot (-1: the base model); None when no row has an adapter
    lora_token_slot: torch.Tensor | None = None
    # each token's segment, for a model that reads them (BERT's sentence pairs); None: all 0
    token_type_ids: torch.Tensor | None = None
    # the rows that hold image placeholders and their image embeddings (encoder_cache.py)
    image_rows: tuple[torch.Tensor, torch.Tensor] | None = None
