"""Qwen2-VL and Qwen2.5-VL: images at their own resolution, placed in the text by M-RoPE.

Two ideas separate these models from LLaVA (llava.py):

- **Dynamic resolution.** The processor resizes a picture only to a multiple of the patch
  size (within ``min_pixels`` / ``max_pixels``), cuts it into ``h x w`` patches of ``p x p``
  pixels, and the tower (qwen2_vl_vision.py) merges each 2 x 2 group of neighbouring patches
  into one decoder row: a picture takes ``h * w / 4`` tokens, so a larger one takes more.
  ``qwen2_vl_images`` cuts the processor's one batch into the images it holds by their grids.
- **M-RoPE.** Every token has three positions (temporal, height, width) instead of one, and
  the decoder's rotary pairs are cut into three sections (``mrope_section``), each turned by
  its own position. A text token has its three equal, as plain RoPE; an image's rows sit on a
  grid: the same temporal position, the row index added to the height position, the column
  index to the width position, all from the position where the image starts. The text after
  an image goes on from that start plus the grid's longer side, not plus the number of image
  tokens, so an image of ``h x w`` rows uses ``max(h, w)`` positions, not ``h * w``.
  ``mrope_positions`` computes this for any run of a request's sequence positions (a prefill
  chunk, a decode step, proposals to verify), from where its images sit; a position past the
  last image is its sequence position plus the prompt's constant shift (transformers'
  ``rope_deltas``), so nothing per request is kept between steps.

The decoder is Qwen2's (llama.py, with ``qkv`` bias) with an M-RoPE rotary; the runner passes
``[3, T]`` positions when a step holds images and ``[T]`` otherwise (taken as text).
Checkpoints in both namings load: transformers 5's (``model.language_model.*``,
``model.visual.*``, ``lm_head.*``) and the earlier one of the Qwen repositories (``model.*``
for the decoder, ``visual.*``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from pagedserve.models.config import ModelConfig
from pagedserve.models.image_inputs import ProcessedImage, VisionLanguageModel
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.multimodal_config import (
    language_model_config,
    refuse_what_images_do_not_run_with,
)
from pagedserve.models.parallel import ParallelContext
from pagedserve.models.qwen2_vl_vision import Qwen2VisionTransformer
from pagedserve.models.weights import CheckpointTensor


def qwen2_vl_images(hf_config: dict[str, Any], batch) -> list[ProcessedImage]:
    """The processor's ``pixel_values [all patches, C*2*p*p]`` cut into each image's patches by
    ``image_grid_thw``; each image's tokens are its patches over the 2 x 2 merge."""
    merge = int(hf_config["vision_config"].get("spatial_merge_size", 2))
    images, first = [], 0
    for grid in batch["image_grid_thw"].tolist():
        t, h, w = (int(n) for n in grid)
        patches = t * h * w
        rows = batch["pixel_values"][first : first + patches]
        images.append(ProcessedImage(rows, (t, h, w), patches // merge**2))
        first += patches
    if first != len(batch["pixel_values"]):
        raise ValueError(
            f"image_grid_thw covers {first} patches; pixel_values has {len(batch['pixel_values'])}"
        )
    return images


def mrope_positions(positions: np.ndarray, images: Sequence, spatial_merge_size: int) -> np.ndarray:
    """``[3, n]`` M-RoPE positions (temporal, height, width) of a request's tokens at the
    consecutive sequence ``positions [n]`` (a chunk, a decode step, proposals). ``images``: the
    request's images in prompt order, each with ``offset`` and ``length`` (its placeholder run)
    and ``grid_thw`` (its patch grid). Images wholly before the run only shift it (a decode
    step costs a few scalar operations per image); those it overlaps place their rows."""
    positions = np.asarray(positions, dtype=np.int64)
    if not len(positions):
        return np.zeros((3, 0), dtype=np.int64)
    shift, overlapped = 0, []  # shift: how far M-RoPE runs behind sequence positions
    for image in images:
        _, h, w = image.grid_thw
        rows, cols = h // spatial_merge_size, w // spatial_merge_size
        if image.offset + image.length <= positions[0]:
            shift += max(rows, cols) - image.length  # text goes on from start + longer side
        elif image.offset <= positions[-1]:
            overlapped.append((image, rows, cols))
    out = np.broadcast_to(positions + shift, (3, len(positions))).copy()
    for image, rows, cols in overlapped:
        start = image.offset + shift  # every position of the image counts from here
        inside = (positions >= image.offset) & (positions < image.offset + image.length)
        index = positions[inside] - image.offset
        out[0, inside] = start + index // (rows * cols)
        out[1, inside] = start + (index % (rows * cols)) // cols
        out[2, inside] = start + index % cols
        step = max(rows, cols) - image.length
        out[:, positions >= image.offset + image.length] += step
        shift += step
    return out


def _split_name(name: str) -> tuple[str, str]:
    """``(part, name inside it)`` of a checkpoint tensor in either naming."""
    if name.startswith("lm_head."):
        return "language_model", name
    bare = name.removeprefix("model.")
    if bare.startswith("visual."):
        return "visual", bare.removeprefix("visual.")
    return "language_model", "model." + bare.removeprefix("language_model.")


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    """Qwen2-VL / Qwen2.5-VL over the paged KV cache: ``embed_images`` and ``embed_input_ids``
    build a prompt's input rows, ``forward`` runs the decoder from them (or from ids) with
    M-RoPE positions."""

    def __init__(self, config: ModelConfig, par: ParallelContext | None = None) -> None:
        super().__init__()
        par = par or ParallelContext()
        refuse_what_images_do_not_run_with(config, par, config.hf_architecture)
        self.config = config
        vision = config.hf_config["vision_config"]
        self.spatial_merge_size = int(vision.get("spatial_merge_size", 2))
        self.visual = Qwen2VisionTransformer(vision, config.torch_dtype)
        self.language_model = LlamaForCausalLM(
            language_model_config(config, ("qwen2_vl_text", "qwen2_5_vl_text")), par
        )

    def embed_images(
        self, pixel_values: list[torch.Tensor], grid_thw: list[tuple[int, int, int]] | None = None
    ) -> list[torch.Tensor]:
        """Each image's patches ``[patches, C*2*p*p]`` (on any device) and patch grid -> its
        ``[patches / 4, hidden]`` decoder rows, in the model's dtype. The tower reads all of
        them in one call (each image attends only to itself)."""
        if grid_thw is None or len(grid_thw) != len(pixel_values):
            raise ValueError("Qwen2-VL's images need one grid_thw each")
        config = self.config
        pixels = torch.cat(list(pixel_values)).to(config.torch_device, config.torch_dtype)
        grids = torch.tensor(grid_thw, dtype=torch.int64)
        rows = self.visual(pixels, grids)
        counts = [t * h * w // self.spatial_merge_size**2 for t, h, w in grid_thw]
        return list(rows.split(counts))

    def mrope_positions(self, positions: np.ndarray, images: Sequence) -> np.ndarray:
        """``[3, n]`` positions of one request's tokens at sequence ``positions`` (see
        ``mrope_positions``)."""
        return mrope_positions(positions, images, self.spatial_merge_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]) -> None:
        """The decoder's tensors load as a Qwen2 checkpoint's, the tower's after them."""
        tower: list[tuple[str, torch.Tensor | CheckpointTensor]] = []

        def decoder_weights():
            for name, tensor in weights:
                part, inner = _split_name(name)
                if part == "visual":
                    tower.append((inner, tensor))
                else:
                    yield inner, tensor

        self.language_model.load_weights(decoder_weights())
        self.visual.load_weights(tower)
