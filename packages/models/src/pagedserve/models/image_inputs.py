"""What a vision-language model's image processor made of one image, and how many prompt tokens
it takes: the contract between the engine's prompt processing and the model.

transformers' image processors return one batch for all of a prompt's images, in a shape that
differs by model: LLaVA's ``pixel_values`` is ``[N, 3, S, S]`` (every image resized to one
square, so every image takes the same number of tokens); Qwen2-VL's is ``[patches, C*2*p*p]``
for all images together, with ``image_grid_thw`` ``[N, 3]`` saying how many patches each has
(dynamic resolution: a larger picture takes more tokens). ``processed_images`` cuts the batch
into one ``ProcessedImage`` per picture, with the number of placeholder tokens its embeddings
fill, so the engine can expand each placeholder, hash and cache each image on its own, and
hand the model a list of images to encode (``embed_images(pixel_values, grid_thw)``).
``VisionLanguageModel`` is the part of such a model that is its decoder's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.models.interface import KVCache
from pagedserve.models.layers.attention import AttentionMetadata
from pagedserve.models.pipeline import IntermediateTensors


@dataclass(frozen=True)
class ProcessedImage:
    """One image as its model's processor made it."""

    pixel_values: torch.Tensor  # LLaVA: [3, S, S]; Qwen2-VL: [patches, C*2*p*p]
    # Qwen2-VL: the (temporal, height, width) patch grid; None for a model of fixed-size images
    grid_thw: tuple[int, int, int] | None
    num_tokens: int  # placeholder tokens (decoder rows) it takes


def processed_images(model_config, batch) -> list[ProcessedImage]:
    """The processor's ``batch`` for ``model_config``'s images, one entry per image."""
    if model_config.arch == "qwen2_vl":
        from pagedserve.models.qwen2_vl import qwen2_vl_images

        return qwen2_vl_images(model_config.hf_config, batch)
    from pagedserve.models.llava import llava_images

    return llava_images(model_config.hf_config, batch)


class VisionLanguageModel(nn.Module):
    """What LLaVA and Qwen2-VL share: a text decoder (``self.language_model``, a Llama-family
    causal LM) that embeds the prompt's ids, runs from embeddings with image rows written in,
    and computes the logits. Each subclass adds its vision tower's ``embed_images``."""

    language_model: nn.Module

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, hidden]``: the decoder's token embedding."""
        return self.language_model.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.language_model(
            input_ids, positions, kv_caches, attn_metadata, intermediate, inputs_embeds
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
