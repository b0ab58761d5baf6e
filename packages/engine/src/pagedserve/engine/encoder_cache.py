"""The model runner's encoder cache: image embeddings by content hash, a step's image rows, its
M-RoPE positions and (for images read both ways) its attention's key limits.

The scheduler decides (scheduler/encoder_cache.py): which images a step encodes, which cached
entries go. This side holds the tensors and does what it was told, in that order: drop the
evicted entries, run the vision encoder over the step's new images (one call for all of them:
the model batches them as its tower can), then, for every chunk of the step that covers
placeholder tokens, pick the embedding rows those tokens stand for. A chunk that ends in the
middle of an image takes the rows up to its end; the next chunk takes the rest from the cache,
without encoding again.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.scheduler import SchedulerOutput


class EncoderCache:
    """Image embeddings ``[tokens, hidden]`` by content hash, for one model runner."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.embeddings: dict[bytes, torch.Tensor] = {}

    def update(self, output: SchedulerOutput) -> None:
        """Drop what the scheduler evicted, then encode the step's new images."""
        for key in output.encoder_cache_freed:
            self.embeddings.pop(key, None)
        images = [request.images[index] for request, index in output.encoder_inputs]
        if not images:
            return
        grids = None if images[0].grid_thw is None else [image.grid_thw for image in images]
        embedded = self.model.embed_images([image.pixel_values for image in images], grids)
        for image, rows in zip(images, embedded, strict=True):
            # a copy of its own when batched: an evicted image must free its memory, not keep
            # its batch's alive
            self.embeddings[image.content_hash] = rows.clone() if len(images) > 1 else rows

    def step_rows(
        self, output: SchedulerOutput, query_start_loc: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The flat batch's rows that hold image placeholders and the embeddings that replace
        them, in the same order; None when no chunk of the step covers an image."""
        rows: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for entry, request in enumerate(output.requests):
            if not request.images:
                continue
            start = output.num_computed_tokens[entry]
            end = start + output.num_new_tokens[entry]
            first_row = int(query_start_loc[entry])
            for image in request.images:
                if not image.overlaps(start, end):
                    continue
                lo, hi = max(start, image.offset), min(end, image.offset + image.length)
                rows.append(torch.arange(first_row + lo - start, first_row + hi - start))
                values.append(
                    self.embeddings[image.content_hash][lo - image.offset : hi - image.offset]
                )
        if not rows:
            return None
        return torch.cat(rows).to(self.device), torch.cat(values)


def embeddings_with_images(
    model: torch.nn.Module, input_ids: torch.Tensor, image_rows: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """The step's input embeddings: the text embedding of every token, the image embeddings in
    the placeholders' rows."""
    rows, values = image_rows
    embeds = model.embed_input_ids(input_ids)
    embeds[rows] = values.to(embeds.dtype)
    return embeds


def image_layout(
    model: torch.nn.Module, output: SchedulerOutput, batch
) -> tuple[np.ndarray, np.ndarray | None]:
    """What images change in a step's layout (``batch``, input_batch.layout_paged_batch): its
    positions (``step_positions``) and its attention's key limits (``step_key_limits``)."""
    return step_positions(model, output, batch), step_key_limits(model, output, batch)


def step_positions(model: torch.nn.Module, output: SchedulerOutput, batch) -> np.ndarray:
    """The step's token positions, ``[T]``; ``[3, T]`` M-RoPE positions when the model has them
    (Qwen2-VL, models/qwen2_vl.py) and a request of the step has images (a text request's
    three rows are its plain position; a step of text alone stays ``[T]``)."""
    mrope, positions = getattr(model, "mrope_positions", None), batch.positions
    if mrope is None or not any(request.images for request in output.requests):
        return positions
    rows3 = np.broadcast_to(positions, (3, len(positions))).copy()
    for entry, request in enumerate(output.requests):
        if request.images:
            rows = slice(int(batch.query_start_loc[entry]), int(batch.query_start_loc[entry + 1]))
            rows3[:, rows] = mrope(positions[rows], request.images)
    return rows3


def step_key_limits(model: torch.nn.Module, output: SchedulerOutput, batch) -> np.ndarray | None:
    """For a model whose image tokens attend to each other both ways (Gemma 3): each row's
    exclusive bound on the key positions it may read, ``[T]`` int32: the end of its image for a
    row inside an image, its own position + 1 (causal) for any other; None when no row of the
    step is inside an image. The scheduler computes each image in one chunk (``whole_images``),
    so the keys up to its end are in the cache when the step attends."""
    if not getattr(model, "bidirectional_images", False):
        return None
    positions, query_start_loc, limits = batch.positions, batch.query_start_loc, None
    for entry, request in enumerate(output.requests):
        start, end = int(query_start_loc[entry]), int(query_start_loc[entry + 1])
        first, last = int(positions[start]), int(positions[end - 1])
        for image in request.images:
            image_end = image.offset + image.length
            if image_end <= first or image.offset > last:  # a decode step past its images
                continue
            inside = (positions[start:end] >= image.offset) & (positions[start:end] < image_end)
            if inside.any():
                if limits is None:
                    limits = (positions + 1).astype(np.int32)
                limits[start:end][inside] = image_end
    return limits
