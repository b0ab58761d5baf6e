"""LLaVA-1.5: images in, text out. A CLIP vision tower, a two-layer projector into the decoder's
hidden size, and a Llama-family decoder over the paged KV cache.

An image becomes ``image_tokens_per_image`` rows of the decoder's input: the tower's hidden
states at ``vision_feature_layer`` (without the class row for the ``default`` strategy, with it
for ``full``), through ``linear_2(act(linear_1(x)))``. The prompt holds that many
``image_token_id`` placeholders per image (the processor expands each ``<image>``). The engine
embeds the prompt's ids with ``embed_input_ids``, puts the rows of ``embed_images`` where the
placeholders are, and runs ``forward(..., inputs_embeds=...)``; from there on the model is its
decoder (``language_model``, llama.py), decode steps included.

It loads both checkpoint namings: transformers 5's (``model.language_model.*``,
``model.vision_tower.*``, ``model.multi_modal_projector.*``, ``lm_head.*``) and the llava-hf
repos' (``language_model.model.*``, ``language_model.lm_head.*``,
``vision_tower.vision_model.*``, ``multi_modal_projector.*``), which is also what
``save_pretrained`` writes, less the tower's ``vision_model.``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedserve.models.clip import CLIPVisionTower, activation
from pagedserve.models.config import ModelConfig
from pagedserve.models.image_inputs import ProcessedImage, VisionLanguageModel
from pagedserve.models.layers.linear import ColumnParallelLinear
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.multimodal_config import (
    language_model_config,
    refuse_what_images_do_not_run_with,
)
from pagedserve.models.parallel import ParallelContext
from pagedserve.models.weights import CheckpointTensor

FEATURE_SELECT_STRATEGIES = ("default", "full")  # without / with the class row


def image_tokens_per_image(hf_config: dict[str, Any], height: int, width: int) -> int:
    """The decoder rows (placeholder tokens) one processed image of ``height`` x ``width``
    pixels takes: its patches, plus the class row for the ``full`` strategy. LLaVA-1.5's tower
    reads ``image_size`` squares only (the processor resizes and crops to that)."""
    vision = hf_config["vision_config"]
    size, patch = vision["image_size"], vision["patch_size"]
    if (height, width) != (size, size):
        raise ValueError(
            f"a processed image is {size}x{size} pixels (vision_config.image_size); got "
            f"{height}x{width}"
        )
    full = hf_config.get("vision_feature_select_strategy", "default") == "full"
    return (height // patch) * (width // patch) + int(full)


def llava_images(hf_config: dict[str, Any], batch) -> list[ProcessedImage]:
    """The processor's ``pixel_values [N, 3, S, S]`` as one ``ProcessedImage`` per image."""
    return [
        ProcessedImage(pixels, None, image_tokens_per_image(hf_config, *pixels.shape[-2:]))
        for pixels in batch["pixel_values"]
    ]


def _check_supported(config: ModelConfig, par: ParallelContext) -> None:
    """What this model is not built for, refused at load by the field that asks for it."""
    c = config.hf_config
    refuse_what_images_do_not_run_with(config, par, "LLaVA")
    strategy = c.get("vision_feature_select_strategy", "default")
    if strategy not in FEATURE_SELECT_STRATEGIES:
        raise ValueError(
            f"vision_feature_select_strategy = {strategy!r} is not supported (one of "
            f"{list(FEATURE_SELECT_STRATEGIES)})"
        )
    vision_type = c["vision_config"].get("model_type")
    if vision_type != "clip_vision_model":
        raise ValueError(
            f"vision_config.model_type = {vision_type!r}: LLaVA's tower is clip_vision_model"
        )


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, dtype = config.hf_config, config.torch_dtype
        layers = c.get("vision_feature_layer", -2)
        width = c["vision_config"]["hidden_size"] * (1 if isinstance(layers, int) else len(layers))
        bias = bool(c.get("multimodal_projector_bias", True))
        self.linear_1 = ColumnParallelLinear(width, config.hidden_size, bias=bias, dtype=dtype)
        self.act = activation(c.get("projector_hidden_act", "gelu"), "projector_hidden_act")
        self.linear_2 = ColumnParallelLinear(
            config.hidden_size, config.hidden_size, bias=bias, dtype=dtype
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    """LLaVA-1.5 over the paged KV cache: ``embed_images`` and ``embed_input_ids`` build a
    prompt's input rows, ``forward`` runs the decoder from them (or from ids)."""

    def __init__(self, config: ModelConfig, par: ParallelContext | None = None) -> None:
        super().__init__()
        par = par or ParallelContext()
        _check_supported(config, par)
        c = config.hf_config
        self.config = config
        self.strategy = c.get("vision_feature_select_strategy", "default")
        self.vision_tower = CLIPVisionTower(
            c["vision_config"], c.get("vision_feature_layer", -2), config.torch_dtype
        )
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.language_model = LlamaForCausalLM(
            language_model_config(config, ("llama", "mistral")), par
        )

    def embed_images(
        self, pixel_values: list[torch.Tensor], grid_thw: list | None = None
    ) -> list[torch.Tensor]:
        """Each image's ``[3, S, S]`` processed pixels (on any device) -> its
        ``[tokens_per_image, hidden]`` decoder rows, on the model's device, in its dtype. The
        tower reads all images as one batch (they are all ``S`` x ``S``). ``grid_thw`` is
        Qwen2-VL's; LLaVA's images have none."""
        pixels = self.stacked_pixels(pixel_values, grid_thw, "LLaVA")
        features = self.vision_tower(pixels)
        if self.strategy == "default":
            features = features[:, 1:]
        return list(self.multi_modal_projector(features))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]) -> None:
        """Route each tensor to its part by the checkpoint's prefix (image_inputs.py: every
        naming); the decoder loads as a text checkpoint would, the tower and projector after."""
        self.load_parts(weights, "LLaVA")
