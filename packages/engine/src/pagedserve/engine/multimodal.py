"""Images in a prompt: pixels through the model's own image processor, placeholders expanded.

A prompt for a vision-language model holds one image token (``<image>``) where each image goes.
The model replaces placeholder rows with the image's embeddings, one row per embedding, so the
prompt the engine runs has as many placeholder tokens as the image has embeddings: each
``<image>`` is expanded here to that count (LLaVA-1.5 at 336 px: 576). The pixels come from the
model folder's own processor (transformers' ``AutoImageProcessor``), never a hand-written
resize that could drift from what the model was trained on.

Each image gets a content hash (SHA-256 of its decoded pixels, mode and size): the prefix
cache hashes it into the blocks its placeholders fill, and the encoder cache keys its
embeddings by it. Two URLs of the same picture hash the same; the same bytes decoded to other
pixels cannot.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch

from pagedserve.blockmgr import ImagePlaceholder
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.models.image_inputs import ImagePromptFormat, image_prompt_format

DEFAULT_IMAGES_PER_PROMPT = 4
# An image processor scales the shortest side up to the tower's size before it crops: a thin
# strip of a few bytes (8192 x 4 pixels) would become gigabytes of floats on the way. Wider
# than this, an image is refused before it reaches the processor.
MAX_ASPECT_RATIO = 50


@dataclass(frozen=True)
class ImageInput(ImagePlaceholder):
    """An image of a request: where its placeholders sit, its content hash, and its pixels as
    the model's image processor made them (LLaVA: ``[3, S, S]``; Qwen2-VL: its patches, with
    their grid), which only the runner reads."""

    pixel_values: torch.Tensor = field(default=None, compare=False, repr=False)
    grid_thw: tuple[int, int, int] | None = field(default=None, compare=False)


def image_content_hash(image) -> bytes:
    """SHA-256 of a PIL image's mode, size and pixel bytes."""
    h = hashlib.sha256()
    h.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    return h.digest()


class ImagePromptProcessor:
    """Turns (prompt token ids with one image token per image, images) into the prompt the
    engine runs and its ``ImageInput``s, for one vision-language model."""

    def __init__(
        self, model_dir: str, model_config, tokenizer, limit_mm_per_prompt, processor_kwargs=None
    ) -> None:
        self.image_processor = _image_processor(model_dir, processor_kwargs or {})
        if getattr(self.image_processor, "do_pan_and_scan", False):
            raise ValueError(
                f"{model_dir}: its image processor cuts wide images into pan-and-scan crops "
                "(do_pan_and_scan), which pagedserve does not serve: set it to false in "
                "preprocessor_config.json"
            )
        self.model_config = model_config
        self.format = image_prompt_format(model_config, tokenizer)
        self.placeholder = tokenizer.convert_ids_to_tokens(self.format.marker)
        self.max_images = _images_allowed(limit_mm_per_prompt)
        self._largest = self.largest_image()  # until the memory profile takes it
        self.max_image_tokens = self._largest.num_tokens

    def largest_image(self):
        """The processor's output for a picture larger than it keeps: the most embedding rows
        one image takes (a model that resizes every image to one size gives every image this
        count; one of dynamic resolution caps a picture at its ``max_pixels``)."""
        from PIL import Image

        limit = getattr(self.image_processor, "max_pixels", None) or (
            (getattr(self.image_processor, "size", None) or {}).get("longest_edge")
        )
        side = max(4096, math.isqrt(int(limit)) + 64) if isinstance(limit, int) else 4096
        (image,) = self._processed([Image.new("RGB", (side, side))])
        return image

    def take_profile_images(self, scheduler_config) -> list:
        """The largest image as many times as one step may encode it, for a GPU's memory
        profile to run through the tower; the processor lets go of it (hundreds of MB for
        Qwen2-VL at its ``max_pixels``). A step encodes what its chunks reach: at most the
        encoder cache's rows, and about a token budget's worth of images (all of them whole
        when images are read whole, ``whole_images``)."""
        image, self._largest = self._largest or self.largest_image(), None
        size, budget = self.max_image_tokens, scheduler_config.max_num_batched_tokens
        reach = budget // size if scheduler_config.whole_images else budget // size + 1
        return [image] * max(1, min(scheduler_config.encoder_cache_size // size, reach))

    def process(self, prompt_ids: list[int], multi_modal_data) -> tuple[list[int], tuple]:
        """The expanded prompt and its images, or ``InvalidRequestError`` naming the field."""
        images = _images_of(multi_modal_data, self.max_images)
        processed = self._processed(images)
        spans = _image_spans(prompt_ids, self.format, [p.num_tokens for p in processed])
        if spans is None:
            written = prompt_ids.count(self.format.marker)
            raise InvalidRequestError(
                f"the prompt has {written} image placeholder(s) {self.placeholder!r} and "
                f"{len(images)} image(s) were given: put one placeholder where each image goes",
                "multi_modal_data",
            )
        expanded, runs = spans
        inputs = tuple(
            ImageInput(offset, length, image_content_hash(image), p.pixel_values, p.grid_thw)
            for (offset, length), image, p in zip(runs, images, processed, strict=True)
        )
        return expanded, inputs

    def _processed(self, images: list) -> list:
        """One ``ProcessedImage`` per image, from the processor's batch of them all."""
        from pagedserve.models import processed_images

        if not images:
            return []
        try:
            batch = self.image_processor(images=images, return_tensors="pt")
        except Exception as e:  # the processor's own refusal of a degenerate image
            raise InvalidRequestError(
                f"the model's image processor rejected an image: {e}", "multi_modal_data"
            ) from e
        try:
            return processed_images(self.model_config, batch)
        except ValueError as e:  # what the model cannot read of the processor's output
            raise InvalidRequestError(str(e), "multi_modal_data") from e


# What a model's tower is built for: changing it would make the processor's patches or token
# counts disagree with the model, so mm_processor_kwargs may not.
_TOWER_SETTINGS = {"patch_size", "merge_size", "temporal_patch_size"}
_NOT_SETTINGS = {"return_tensors", "device", "data_format", "input_data_format"}


def _image_processor(model_dir: str, kwargs: dict):
    """The folder's image processor (transformers' ``AutoImageProcessor``), with ``kwargs``
    (``mm_processor_kwargs``) over its settings: each must be a setting the processor takes
    (its ``valid_kwargs``) and not one the model's tower depends on, or it is refused."""
    from transformers import AutoImageProcessor

    try:
        processor = AutoImageProcessor.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{model_dir} takes images but has no image processor config "
            f"(preprocessor_config.json): {e}"
        ) from e
    if not kwargs:
        return processor
    takes = set()
    for cls in getattr(type(processor), "valid_kwargs", dict).__mro__:
        takes |= set(getattr(cls, "__annotations__", {}))
    for key in kwargs:
        if key not in takes - _NOT_SETTINGS or key in _TOWER_SETTINGS:
            why = "the model's tower is built for" if key in _TOWER_SETTINGS else "not a setting of"
            raise ValueError(
                f"mm_processor_kwargs.{key}: {why} {type(processor).__name__} (it takes "
                f"{sorted(takes - _NOT_SETTINGS - _TOWER_SETTINGS)})"
            )
    return AutoImageProcessor.from_pretrained(model_dir, **kwargs)


def image_processor_for(
    args, model_config, tokenizer, scheduler_config, speculator
) -> ImagePromptProcessor | None:
    """The prompt processor of a model that takes images (None for a text model), after
    refusing the options that cannot serve image prompts yet. The encoder cache, unless sized
    by hand, holds at least one image. A model whose image tokens attend to each other both
    ways (Gemma 3) has each image computed in one chunk (``whole_images``)."""
    if model_config.image_token_id is None:
        for name in ("limit_mm_per_prompt", "mm_processor_kwargs"):
            if getattr(args, name):
                raise ValueError(f"{name}: {args.model} is a text model: it takes no images")
        return None
    for name in ("kv_transfer_config", "kv_offload_memory", "kv_offload_dir"):
        if getattr(args, name):
            raise ValueError(f"{name}: the KV blocks of image prompts do not travel yet")
    if speculator is not None and speculator.draft is not None:
        raise ValueError("speculative_config: a draft model cannot read image prompts (use ngram)")
    processor = ImagePromptProcessor(
        args.tokenizer or args.model,
        model_config,
        tokenizer,
        args.limit_mm_per_prompt,
        args.mm_processor_kwargs,
    )
    scheduler_config.whole_images = reads_images_both_ways(model_config)
    if args.encoder_cache_size is None:
        scheduler_config.encoder_cache_size = max(
            scheduler_config.encoder_cache_size, processor.max_image_tokens
        )
    if scheduler_config.whole_images and (
        scheduler_config.max_num_batched_tokens < processor.max_image_tokens
    ):
        raise ValueError(
            f"max_num_batched_tokens {scheduler_config.max_num_batched_tokens} is less than one "
            f"image of {args.model} ({processor.max_image_tokens} rows), which it reads in one "
            "step: every image would be refused"
        )
    if args.encoder_cache_size is not None and args.encoder_cache_size < processor.max_image_tokens:
        raise ValueError(
            f"encoder_cache_size {args.encoder_cache_size} is less than one image of "
            f"{args.model} ({processor.max_image_tokens} rows): every image would be refused"
        )
    return processor


def reads_images_both_ways(model_config) -> bool:
    """Whether the model's image tokens attend to each other both ways (``bidirectional_images``
    on its class: Gemma 3), so that the runner lifts the causal mask inside each image."""
    from pagedserve.models.loader import MODEL_CLASSES

    return bool(getattr(MODEL_CLASSES[model_config.arch], "bidirectional_images", False))


def prompt_with_images(
    processor: ImagePromptProcessor | None, model_name: str, prompt_ids: list[int], data
) -> tuple[list[int], tuple]:
    """The prompt with its image placeholders expanded, and its images (none for text)."""
    if processor is None:
        if data:
            raise InvalidRequestError(
                f"{model_name} is a text model: it takes no images", "multi_modal_data"
            )
        return prompt_ids, ()
    if data is None and not {processor.format.marker, processor.format.row} & set(prompt_ids):
        return prompt_ids, ()
    return processor.process(list(prompt_ids), data or {})


def _images_allowed(limit_mm_per_prompt) -> int:
    if not limit_mm_per_prompt:
        return DEFAULT_IMAGES_PER_PROMPT
    unknown = set(limit_mm_per_prompt) - {"image"}
    if unknown:
        raise ValueError(
            f"limit_mm_per_prompt: pagedserve takes images only, not {sorted(unknown)}"
        )
    limit = limit_mm_per_prompt.get("image", DEFAULT_IMAGES_PER_PROMPT)
    if not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit_mm_per_prompt.image must be an integer >= 0, got {limit!r}")
    return limit


def _images_of(multi_modal_data, max_images: int) -> list:
    from PIL import Image

    if not isinstance(multi_modal_data, dict) or set(multi_modal_data) - {"image"}:
        raise InvalidRequestError(
            "multi_modal_data must be {'image': an image or a list of images}",
            "multi_modal_data",
        )
    images = multi_modal_data.get("image", [])
    images = [images] if isinstance(images, Image.Image) else list(images)
    if not all(isinstance(image, Image.Image) for image in images):
        raise InvalidRequestError("multi_modal_data images must be PIL images", "multi_modal_data")
    if len(images) > max_images:
        raise InvalidRequestError(
            f"{len(images)} images in one prompt; at most {max_images} are allowed "
            "(limit_mm_per_prompt)",
            "multi_modal_data",
        )
    for image in images:
        if aspect_ratio_error(image.size):
            raise InvalidRequestError(aspect_ratio_error(image.size), "multi_modal_data")
    return [as_rgb(image) for image in images]


def aspect_ratio_error(size: tuple[int, int]) -> str | None:
    """Why an image of ``size`` (width, height) is refused, or None."""
    width, height = size
    if min(width, height) < 1 or max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        return (
            f"the image is {width}x{height} pixels: its sides may differ by at most "
            f"{MAX_ASPECT_RATIO}x (the processor would scale it up to gigabytes)"
        )
    return None


def as_rgb(image):
    """``image`` as RGB; a transparent one over white (as transformers' ``convert_to_rgb`` and
    vLLM's media loader put it), never with its alpha channel dropped."""
    from PIL import Image

    transparent = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or ("transparency" in image.info)
    if not transparent:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def _image_spans(
    token_ids: list[int], fmt: ImagePromptFormat, counts: list[int]
) -> tuple[list[int], list[tuple[int, int]]] | None:
    """The prompt with each image's marker expanded (``fmt``: ``counts[i]`` row tokens, with
    what the model puts around them), and each image's rows as (offset, length) in it; None
    when the markers do not match the images.

    One marker per image (``<image><image>`` is two images) is expanded; a prompt already
    expanded (a processor's output: ``sum(counts)`` row tokens, each image's consecutive) is
    taken as it is."""
    rows = [i for i, token in enumerate(token_ids) if token == fmt.row]
    markers = (
        rows if fmt.marker == fmt.row else [i for i, t in enumerate(token_ids) if t == fmt.marker]
    )
    if len(markers) == len(counts) and (fmt.marker == fmt.row or not rows):
        return _expand_markers(token_ids, markers, fmt, counts)
    if len(rows) != sum(counts):
        return None
    if fmt.marker != fmt.row and len(markers) != len(counts):
        return None  # an expanded prompt of Gemma 3 has a marker before each image's rows
    runs, first = [], 0
    for count in counts:
        span = rows[first : first + count]
        if span[-1] - span[0] != count - 1:
            return None  # this image's placeholders are not one run
        runs.append((span[0], count))
        first += count
    return list(token_ids), runs


def _expand_markers(token_ids, markers, fmt: ImagePromptFormat, counts):
    """``_image_spans`` for a prompt of one marker per image."""
    expanded: list[int] = []
    runs: list[tuple[int, int]] = []
    start = 0
    for where, count in zip(markers, counts, strict=True):
        _join(expanded, token_ids[start:where], fmt.newlines)
        image = [*fmt.before, *[fmt.row] * count, *fmt.after]
        first_row = len(expanded) + len(fmt.before) - _join(expanded, image, fmt.newlines)
        runs.append((first_row, count))
        start = where + 1
    _join(expanded, token_ids[start:], fmt.newlines)
    return expanded, runs


def _join(tokens: list[int], piece: list[int], newlines: dict[int, int] | None) -> int:
    """Append ``piece`` to ``tokens``; where the seam puts a newline token after another and the
    tokenizer has one token for all of them, that one token (as tokenizing the expanded text
    would give it). Returns how many tokens the seam merged away (0 or 1)."""
    if newlines and tokens and piece:
        count_of = {token: count for count, token in newlines.items()}
        merged = newlines.get(count_of.get(tokens[-1], 0) + count_of.get(piece[0], 0))
        if tokens[-1] in count_of and piece[0] in count_of and merged is not None:
            tokens[-1] = merged
            tokens.extend(piece[1:])
            return 1
    tokens.extend(piece)
    return 0
