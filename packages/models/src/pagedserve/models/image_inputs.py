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


@dataclass(frozen=True)
class ImagePromptFormat:
    """How a model's prompt holds an image. A prompt writes ``marker`` where an image goes;
    the engine expands it to ``before``, one ``row`` token per embedding row, ``after``.
    LLaVA and Qwen2-VL: the marker is the row token itself (``<image>``, ``<|image_pad|>``),
    nothing around it (Qwen2-VL's chat template writes its vision markers itself). Gemma 3:
    ``<start_of_image>`` becomes ``"\n\n" <start_of_image> rows <end_of_image> "\n\n"``, as
    its processor expands it in text; ``newlines`` (count -> token id of that many newlines)
    lets the engine merge the newlines at each seam into the one token the tokenizer would
    have made of the text."""

    marker: int
    row: int
    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()
    newlines: dict[int, int] | None = None


def image_prompt_format(model_config, tokenizer) -> ImagePromptFormat:
    """``model_config``'s image prompt format, its token ids from ``tokenizer``."""
    row = model_config.image_token_id
    if model_config.arch != "gemma3_mm":
        return ImagePromptFormat(row, row)
    c = model_config.hf_config
    newlines = _newline_tokens(tokenizer)
    two = newlines.get(2)
    if two is None:
        raise ValueError("the tokenizer has no token for two newlines, which Gemma 3's images need")
    begin, end = int(c["boi_token_index"]), int(c["eoi_token_index"])
    return ImagePromptFormat(begin, row, (two, begin), (end, two), newlines)


def _newline_tokens(tokenizer) -> dict[int, int]:
    """Newline count -> the token id of exactly that many newlines, for the counts the vocab
    holds as one token."""
    found: dict[int, int] = {}
    for count in range(1, 33):
        ids = tokenizer.encode("\n" * count, add_special_tokens=False)
        if len(ids) == 1:
            found[count] = ids[0]
    return found


def processed_images(model_config, batch) -> list[ProcessedImage]:
    """The processor's ``batch`` for ``model_config``'s images, one entry per image."""
    if model_config.arch == "qwen2_vl":
        from pagedserve.models.qwen2_vl import qwen2_vl_images

        return qwen2_vl_images(model_config.hf_config, batch)
    if model_config.arch == "gemma3_mm":
        from pagedserve.models.gemma3_mm import gemma3_images

        return gemma3_images(model_config.hf_config, batch)
    from pagedserve.models.llava import llava_images

    return llava_images(model_config.hf_config, batch)


# LLaVA's and Gemma 3's checkpoints: (checkpoint prefix, our part, the name's prefix inside the
# part), first match wins, after a leading ``model.`` is dropped: what save_pretrained writes
# (and the llava-hf / Google repositories hold), then transformers 5's state dict.
CHECKPOINT_PARTS = [
    ("language_model.model.", "language_model", "model."),
    ("language_model.lm_head.", "language_model", "lm_head."),
    ("language_model.", "language_model", "model."),
    ("lm_head.", "language_model", "lm_head."),
    ("vision_tower.vision_model.", "vision_tower", ""),
    ("vision_tower.", "vision_tower", ""),
    ("multi_modal_projector.", "multi_modal_projector", ""),
]


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

    def stacked_pixels(self, pixel_values, grid_thw, name: str) -> torch.Tensor:
        """A fixed-size tower's images (LLaVA's, Gemma 3's: each ``[3, S, S]``) as one batch on
        the model's device, in its dtype; a ``grid_thw`` (Qwen2-VL's) is refused."""
        if grid_thw is not None:
            raise ValueError(f"{name}'s images are fixed-size: they have no grid_thw")
        config = self.config
        return torch.stack(list(pixel_values)).to(config.torch_device, config.torch_dtype)

    def load_parts(self, weights, name: str) -> None:
        """Load a checkpoint whose tensors belong to ``language_model``, ``vision_tower`` and
        ``multi_modal_projector`` (LLaVA's and Gemma 3's layout), each routed by its prefix
        (``CHECKPOINT_PARTS``). The decoder loads as a text model's checkpoint would; the tower (with its
        ``stacked_params`` and the tensors it ``skips_weight``) and the projector after it."""
        from pagedserve.models.config import ModelLoadError
        from pagedserve.models.weights import load_stacked_weights

        others: dict[str, list] = {"vision_tower": [], "multi_modal_projector": []}

        def split(tensor_name: str) -> tuple[str, str]:
            bare = tensor_name.removeprefix("model.")
            for prefix, part, inner in CHECKPOINT_PARTS:
                if bare.startswith(prefix):
                    return part, inner + bare[len(prefix) :]
            raise ModelLoadError(
                f"checkpoint tensor {tensor_name!r} belongs to no part of a {name} model "
                "(language_model, vision_tower, multi_modal_projector, lm_head)"
            )

        def decoder_weights():
            for tensor_name, tensor in weights:
                part, inner = split(tensor_name)
                if part == "language_model":
                    yield inner, tensor
                else:
                    others[part].append((inner, tensor))

        self.language_model.load_weights(decoder_weights())
        tower = self.vision_tower

        def tower_name(weight: str) -> str | None:  # None: a tensor the tower does not build
            return None if tower.skips_weight(weight) else weight

        load_stacked_weights(tower, others["vision_tower"], tower.stacked_params, tower_name)
        load_stacked_weights(self.multi_modal_projector, others["multi_modal_projector"], [], str)
