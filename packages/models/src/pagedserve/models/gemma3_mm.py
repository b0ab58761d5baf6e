"""Gemma 3 (4B, 12B, 27B): images in, text out. A SigLIP vision tower, a projector that pools
its patch grid to a fixed number of rows, and the Gemma 3 text decoder over the paged KV cache.

An image (resized by the processor to the tower's ``image_size`` square) becomes
``mm_tokens_per_image`` rows of the decoder's input (256 for the released models): the
tower's last rows through ``post_layernorm`` (siglip.py), their ``P x P`` patch grid averaged
in ``k x k`` squares down to ``sqrt(mm_tokens_per_image)`` a side, each row normalised by a
Gemma RMSNorm (``mm_soft_emb_norm``, scale ``1 + weight``) and projected by
``mm_input_projection_weight`` (``[vision hidden, text hidden]``, applied as ``x @ W``).

The prompt: where an image goes the text holds ``<start_of_image>`` (``boi_token_index``);
transformers' processor writes, in its place, ``"\\n\\n" <start_of_image>``, then
``mm_tokens_per_image`` ``<image_soft_token>`` placeholders (``image_token_index``, the
``image_token_id`` whose rows the images replace), then ``<end_of_image> "\\n\\n"``.

Two things set it apart from LLaVA (llava.py):

- the text embedding is scaled by ``sqrt(hidden_size)`` (gemma.py), and the image rows are
  not: ``embed_input_ids`` returns the scaled text rows, and ``forward(inputs_embeds=...)``
  runs the decoder from the mixed rows as they are;
- an image's placeholder tokens attend to each other both ways (each image its own block; the
  text stays causal, and a local layer's window still bounds every token): the engine reads
  ``bidirectional_images`` and gives the attention each query's key limit.

Checkpoint namings: transformers 5's state dict (``model.language_model.*``,
``model.vision_tower.*``, ``model.multi_modal_projector.*``, ``lm_head.*``), what its
``save_pretrained`` writes (``language_model.model.*``, ``vision_tower.*``,
``multi_modal_projector.*``) and Google's repositories (``vision_tower.vision_model.*``). The
head is tied to the embedding in every released model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.models.config import ModelConfig
from pagedserve.models.gemma import GemmaForCausalLM, GemmaRMSNorm
from pagedserve.models.image_inputs import ProcessedImage, VisionLanguageModel
from pagedserve.models.interface import KVCache
from pagedserve.models.layers.attention import AttentionMetadata
from pagedserve.models.multimodal_config import (
    language_model_config,
    refuse_what_images_do_not_run_with,
)
from pagedserve.models.parallel import ParallelContext
from pagedserve.models.pipeline import IntermediateTensors
from pagedserve.models.siglip import SiglipVisionTower
from pagedserve.models.weights import CheckpointTensor


def pooled_grid(hf_config: dict[str, Any]) -> tuple[int, int]:
    """``(patches a side, rows a side)``: the tower's patch grid and the projector's pooled
    one; ValueError naming the field when ``mm_tokens_per_image`` is not a square whose side
    divides the patch grid's (the average pool would not tile it)."""
    vision = hf_config["vision_config"]
    patches = vision["image_size"] // vision["patch_size"]
    tokens = int(hf_config.get("mm_tokens_per_image", 256))
    side = round(tokens**0.5)
    if side * side != tokens or patches % side:
        raise ValueError(
            f"mm_tokens_per_image = {tokens} must be a square whose side divides the "
            f"{patches} x {patches} patch grid (vision_config.image_size / patch_size)"
        )
    return patches, side


def gemma3_images(hf_config: dict[str, Any], batch) -> list[ProcessedImage]:
    """The image processor's ``pixel_values [N, 3, S, S]`` as one ``ProcessedImage`` per image,
    each ``mm_tokens_per_image`` tokens. Pan-and-scan (``do_pan_and_scan``: extra crops of a
    wide image, each its own run of tokens after the original's) is refused: its crops come
    back as more ``pixel_values`` than images, counted in ``num_crops``."""
    pixels = batch["pixel_values"]
    crops = batch.get("num_crops")
    if crops is not None and int(torch.as_tensor(crops).sum()) > 0:
        raise ValueError(
            f"the image processor cut {len(crops)} image(s) into {len(pixels)} pan-and-scan "
            "crops (do_pan_and_scan): Gemma 3 is served without pan-and-scan; set "
            "do_pan_and_scan to false in preprocessor_config.json"
        )
    size = hf_config["vision_config"]["image_size"]
    tokens = int(hf_config.get("mm_tokens_per_image", 256))
    images = []
    for image in pixels:
        if tuple(image.shape[-2:]) != (size, size):
            raise ValueError(
                f"a processed image is {size}x{size} pixels (vision_config.image_size); got "
                f"{image.shape[-2]}x{image.shape[-1]}"
            )
        images.append(ProcessedImage(image, None, tokens))
    return images


def _check_supported(config: ModelConfig, par: ParallelContext) -> None:
    """What this model is not built for, refused at load by the field that asks for it."""
    c = config.hf_config
    refuse_what_images_do_not_run_with(config, par, "Gemma 3")
    vision_type = c["vision_config"].get("model_type")
    if vision_type != "siglip_vision_model":
        raise ValueError(
            f"vision_config.model_type = {vision_type!r}: Gemma 3's tower is siglip_vision_model"
        )
    pooled_grid(c)


class Gemma3MultiModalProjector(nn.Module):
    """Average-pool the patch grid to ``mm_tokens_per_image`` rows, RMSNorm, project."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, dtype = config.hf_config, config.torch_dtype
        vision = c["vision_config"]
        self.patches_per_side, side = pooled_grid(c)
        self.kernel_size = self.patches_per_side // side
        self.mm_soft_emb_norm = GemmaRMSNorm(
            vision["hidden_size"], vision.get("layer_norm_eps", 1e-6), dtype
        )
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(vision["hidden_size"], config.hidden_size, dtype=dtype),
            requires_grad=False,
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``[N, patches, vision hidden]`` -> ``[N, mm_tokens_per_image, text hidden]``."""
        n, _, hidden = features.shape
        p = self.patches_per_side
        grid = features.transpose(1, 2).reshape(n, hidden, p, p)
        pooled = F.avg_pool2d(grid, self.kernel_size).flatten(2).transpose(1, 2)
        rows = pooled.shape[1]
        normed = self.mm_soft_emb_norm(pooled.reshape(n * rows, hidden))
        return (normed @ self.mm_input_projection_weight).view(n, rows, -1)


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    """Gemma 3 over the paged KV cache: ``embed_images`` and ``embed_input_ids`` build a
    prompt's input rows, ``forward`` runs the decoder from them (or from ids)."""

    # an image's placeholder tokens attend to each other both ways (the engine reads this)
    bidirectional_images = True

    def __init__(self, config: ModelConfig, par: ParallelContext | None = None) -> None:
        super().__init__()
        par = par or ParallelContext()
        _check_supported(config, par)
        self.config = config
        self.vision_tower = SiglipVisionTower(config.hf_config["vision_config"], config.torch_dtype)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.language_model = GemmaForCausalLM(
            language_model_config(config, ("gemma3_text",), "gemma"), par
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, hidden]``: the text embedding scaled by ``sqrt(hidden_size)``,
        as the decoder embeds ids itself (image rows, written over placeholders, are not)."""
        return self.language_model.model.embed(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder from ``inputs_embeds`` (already scaled: ``embed_input_ids``) or from
        ids. Gemma is not cut into pipeline stages, so ``intermediate`` is always None."""
        if intermediate is not None:
            raise ValueError("Gemma 3 runs on one pipeline stage: it takes no intermediate tensors")
        return self.language_model(
            input_ids, positions, kv_caches, attn_metadata, inputs_embeds=inputs_embeds
        )

    def embed_images(
        self, pixel_values: list[torch.Tensor], grid_thw: list | None = None
    ) -> list[torch.Tensor]:
        """Each image's ``[3, S, S]`` processed pixels (on any device) -> its
        ``[mm_tokens_per_image, hidden]`` decoder rows, on the model's device, in its dtype,
        all images in one batch through the tower. ``grid_thw`` is Qwen2-VL's; Gemma 3's
        images have none."""
        pixels = self.stacked_pixels(pixel_values, grid_thw, "Gemma 3")
        return list(self.multi_modal_projector(self.vision_tower(pixels)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]) -> None:
        """Route each tensor to its part by the checkpoint's prefix (image_inputs.py: every
        naming); the decoder loads as a text checkpoint would, the tower and projector after."""
        self.load_parts(weights, "Gemma 3")
