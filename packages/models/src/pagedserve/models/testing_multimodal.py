"""A tiny random-weight LLaVA-1.5 checkpoint, test images, and transformers' greedy reference,
for tests and tutorials.

The folder is what a llava-hf repository holds, made by transformers itself (no download):
``LlavaForConditionalGeneration.save_pretrained`` (a 2-layer CLIP tower of width 32 over
``image_size`` squares of ``patch_size`` patches, the tiny Llama decoder of testing.py), the
tiny BPE tokenizer with ``<image>`` added as a special token, and a ``LlavaProcessor`` (a CLIP
image processor resizing and cropping to ``image_size``) that expands each ``<image>`` of a
prompt into one placeholder per image row. So ``AutoProcessor`` and transformers' model class
load it, and transformers' greedy continuation is the reference pagedserve is held to.

``make_tiny_qwen2_vl_checkpoint`` does the same for Qwen2-VL and Qwen2.5-VL (dynamic resolution:
each test image keeps its own grid of 4-pixel patches), with ``qwen2_vl_processor`` and
``transformers_qwen2_vl_greedy`` beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedserve.models.testing import TINY_VOCAB, _llama_family_config, build_tiny_tokenizer

IMAGE_TOKEN = "<image>"
# LLaVA-1.5's conversation format over string content: "USER: <image>\nWhat is this? ASSISTANT:"
LLAVA_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: {{ m['content'] }} "
    "{% elif m['role'] == 'assistant' %}ASSISTANT: {{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
# llava-hf's own template, kept with the processor (chat_template.json): it reads each message's
# content as parts, images first
LLAVA_HF_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# (width, height) of tiny_test_images: a wide, a square and a tall one, none the tower's size
TEST_IMAGE_SIZES = ((40, 24), (64, 64), (20, 50))


def _tokenizer_with_image_token(out_dir: Path):
    """The tiny tokenizer of testing.py, saved, with ``<image>`` one special token on top."""
    from transformers import AutoTokenizer

    build_tiny_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    return tokenizer


TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def _llava_config(image_token_id, image_size, patch_size, strategy, vision_sizes, text_sizes):
    from transformers import CLIPVisionConfig, LlavaConfig

    vision = CLIPVisionConfig(
        **(vision_sizes or TINY_VISION), image_size=image_size, patch_size=patch_size,
        projection_dim=32,
    )  # fmt: skip
    text_overrides = {**(text_sizes or {}), "vocab_size": max(TINY_VOCAB, image_token_id + 1)}
    text = _llama_family_config("llama", text_overrides)
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        vision_feature_layer=-2,
        vision_feature_select_strategy=strategy,
        image_seq_length=(image_size // patch_size) ** 2 + (strategy == "full"),
    )


def make_tiny_llava_checkpoint(
    out_dir: str | Path,
    image_size: int = 32,
    patch_size: int = 8,
    seed: int = 0,
    strategy: str = "default",
    vision_sizes: dict | None = None,
    text_sizes: dict | None = None,
    processor_template: bool = False,
) -> Path:
    """Write the tiny LLaVA folder (model, tokenizer, processor) to ``out_dir``; returns it.
    ``vision_sizes`` / ``text_sizes`` (CLIPVisionConfig / LlamaConfig fields) make it another
    size: a benchmark's realistic shapes (tools/bench_images.py), still random weights.
    ``processor_template``: the folder as llava-hf repositories hold it, the chat template
    (``LLAVA_HF_CHAT_TEMPLATE``, content as parts) in chat_template.json, none on the tokenizer.

    Every weight is drawn from N(0, 0.1) and every norm's scale near 1, wider than transformers'
    initialisation, so image features differ visibly between images and greedy decoding does
    not sit on near-ties."""
    import torch
    from transformers import CLIPImageProcessorPil, LlavaForConditionalGeneration, LlavaProcessor

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    tokenizer = _tokenizer_with_image_token(out_dir)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    config = _llava_config(
        image_token_id, image_size, patch_size, strategy, vision_sizes, text_sizes
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            norm = "norm" in name and name.endswith("weight")
            param.normal_(1.0 if norm else 0.0, 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    image_processor = CLIPImageProcessorPil(  # the PIL backend: no torchvision needed
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=1,  # CLIP's class row: "default" drops it again
        image_token=IMAGE_TOKEN,
    )
    processor.save_pretrained(out_dir)
    if processor_template:
        import json

        (out_dir / "chat_template.jinja").unlink(missing_ok=True)
        (out_dir / "chat_template.json").write_text(
            json.dumps({"chat_template": LLAVA_HF_CHAT_TEMPLATE})
        )
    return out_dir


def tiny_test_images(seed: int = 0) -> list[Any]:
    """Three RGB ``PIL.Image``s of noise, ``TEST_IMAGE_SIZES``, the same for the same seed."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
        for width, height in TEST_IMAGE_SIZES
    ]


def transformers_llava_greedy(
    folder: str | Path, prompt: str, images: list[Any], max_new_tokens: int
) -> tuple[list[int], list[int]]:
    """``(prompt ids, new ids)``: the processor's expanded prompt (one placeholder per image
    row) and transformers' greedy continuation in fp32, never stopping early (EOS included):
    plain argmax over its own forward and KV cache, as testing.transformers_greedy does."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder)
    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return _greedy_over_own_cache(model, processor, prompt, images, max_new_tokens)


def _greedy_over_own_cache(model, processor, prompt: str, images: list[Any], max_new_tokens: int):
    """``(prompt ids, new ids)``: the processor's inputs through ``model``, then one argmax
    token at a time over transformers' own cache. Decode steps pass no attention mask: with
    one, Qwen2-VL sizes a step's positions to the mask; without, it takes the step's M-RoPE
    position from the prefill's ``rope_deltas``."""
    import torch

    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    tokens: list[int] = []
    with torch.inference_mode():
        out = model(**inputs, use_cache=True)
        for _ in range(max_new_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            step = torch.tensor([[tokens[-1]]])
            out = model(input_ids=step, cache=out.cache, use_cache=True)
    return inputs["input_ids"][0].tolist(), tokens


# Qwen2-VL / Qwen2.5-VL: an image part renders as its three markers; the processor then expands
# the one <|image_pad|> into one per merged patch block (the tower's output rows)
VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = (
    "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>",
)  # fmt: skip
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_VL_VARIANTS = ("qwen2_vl", "qwen2_5_vl")
# the tiny towers: 4-pixel patches, 2x2 merge; Qwen2.5-VL's 16-pixel windows hold 2x2 merged
# blocks, so every test image has several windows, edge windows cut short
TINY_QWEN2_VL_PATCH, TINY_QWEN2_VL_WINDOW = 4, 16
TINY_QWEN2_VL_PIXELS = (16 * 16, 48 * 48)  # min_pixels, max_pixels of the image processor


def _qwen2_vl_tokenizer(out_dir: Path):
    """The tiny tokenizer of testing.py with Qwen2-VL's vision markers as special tokens."""
    from transformers import AutoTokenizer

    build_tiny_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokenizer.add_tokens([VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD], special_tokens=True)
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    return tokenizer


def _qwen2_vl_config(variant: str, ids: dict[str, int]):
    """A 2-layer decoder (64 wide, 4 heads of 16, 2 KV heads, M-RoPE sections [2, 3, 3]) and a
    2-block tower of width 32, 2 heads (Qwen2.5-VL's: block 0 windowed, block 1 full)."""
    import transformers

    text = dict(
        vocab_size=max(TINY_VOCAB, *ids.values()) + 1, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )  # fmt: skip
    vision: dict[str, Any] = dict(
        depth=2, num_heads=2, patch_size=TINY_QWEN2_VL_PATCH, spatial_merge_size=2,
        temporal_patch_size=2,
    )  # fmt: skip
    if variant == "qwen2_vl":
        cls = transformers.Qwen2VLConfig
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
    elif variant == "qwen2_5_vl":
        cls = transformers.Qwen2_5_VLConfig
        vision.update(
            hidden_size=32, intermediate_size=48, out_hidden_size=64,
            window_size=TINY_QWEN2_VL_WINDOW, fullatt_block_indexes=[1],
        )  # fmt: skip
    else:
        raise ValueError(f"variant = {variant!r} is not one of {QWEN2_VL_VARIANTS}")
    return cls(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def make_tiny_qwen2_vl_checkpoint(
    out_dir: str | Path, variant: str = "qwen2_vl", seed: int = 0
) -> Path:
    """Write a tiny Qwen2-VL (``variant="qwen2_vl"``) or Qwen2.5-VL (``"qwen2_5_vl"``) folder:
    model, tokenizer (with the vision markers and a chat template that reads content as
    parts), and processor (a PIL-backend Qwen2-VL image processor over 4-pixel patches,
    ``TINY_QWEN2_VL_PIXELS`` pixels at most, so tiny_test_images make grids of a few dozen
    patches, each of a different shape). Weights as make_tiny_llava_checkpoint draws them."""
    import torch

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    tokenizer = _qwen2_vl_tokenizer(out_dir)
    names = dict(
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD,
    )  # fmt: skip
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in names.items()}
    config = _qwen2_vl_config(variant, ids)
    torch.manual_seed(seed)
    model = _qwen2_vl_model_class(variant)(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            norm = ("norm" in name or "ln_q" in name) and name.endswith("weight")
            param.normal_(1.0 if norm else 0.0, 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    _save_qwen2_vl_processor(out_dir, variant, tokenizer)
    return out_dir


def _save_qwen2_vl_processor(out_dir: Path, variant: str, tokenizer) -> None:
    """The processor's files as a Qwen2-VL repository holds them: tokenizer (with the chat
    template), image processor, video processor, processor_config.json. They are written one
    by one, not by the processor's save_pretrained: transformers builds a Qwen2-VL processor
    only with its video processor, which needs torchvision (see qwen2_vl_processor). The video
    processor's config is written by hand to the image processor's sizes."""
    import json

    from transformers import Qwen2VLImageProcessorPil

    min_pixels, max_pixels = TINY_QWEN2_VL_PIXELS
    sizes = dict(patch_size=TINY_QWEN2_VL_PATCH, merge_size=2, temporal_patch_size=2)
    image_processor = Qwen2VLImageProcessorPil(  # the PIL backend: no torchvision needed
        min_pixels=min_pixels, max_pixels=max_pixels, **sizes
    )
    image_processor.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    video = dict(
        video_processor_type="Qwen2VLVideoProcessor",
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        image_mean=image_processor.image_mean, image_std=image_processor.image_std, **sizes,
    )  # fmt: skip
    processor = "Qwen2VLProcessor" if variant == "qwen2_vl" else "Qwen2_5_VLProcessor"
    for name, content in (
        ("video_preprocessor_config.json", video),
        ("processor_config.json", {"processor_class": processor}),
    ):
        (out_dir / name).write_text(json.dumps(content, indent=2) + "\n")


def qwen2_vl_processor(folder: str | Path):
    """The folder's processor: ``AutoProcessor`` where torchvision is installed; without it
    (transformers' Qwen2-VL processor insists on a video processor, and that needs
    torchvision), the same processor class over the folder's tokenizer and image processor,
    images only. Either expands ``<|image_pad|>`` and returns ``pixel_values``,
    ``image_grid_thw`` and ``mm_token_type_ids`` alike."""
    import json

    import transformers
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return AutoProcessor.from_pretrained(folder)
    name = json.loads((Path(folder) / "processor_config.json").read_text())["processor_class"]
    processor_cls = getattr(transformers, name)

    class ImagesOnly(processor_cls):  # its sub-processors are the ones its __init__ names
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template)

    tokenizer = AutoTokenizer.from_pretrained(folder)
    image_processor = AutoImageProcessor.from_pretrained(folder)
    return ImagesOnly(image_processor, tokenizer, chat_template=tokenizer.chat_template)


def _qwen2_vl_model_class(variant: str):
    import transformers

    if variant == "qwen2_vl":
        return transformers.Qwen2VLForConditionalGeneration
    return transformers.Qwen2_5_VLForConditionalGeneration


def transformers_qwen2_vl_greedy(
    folder: str | Path, prompt: str, images: list[Any], max_new_tokens: int
) -> tuple[list[int], list[int]]:
    """``(prompt ids, new ids)`` for a tiny Qwen2-VL / Qwen2.5-VL folder, as
    transformers_llava_greedy: the processor's expanded prompt (one ``<|image_pad|>`` per
    merged block) and transformers' fp32 greedy continuation over its own KV cache (its M-RoPE
    positions included), never stopping early. The model class is the config's architecture."""
    import json

    import torch
    import transformers

    architecture = json.loads((Path(folder) / "config.json").read_text())["architectures"][0]
    model_cls = getattr(transformers, architecture)
    processor = qwen2_vl_processor(folder)
    model = model_cls.from_pretrained(folder, dtype=torch.float32).eval()
    return _greedy_over_own_cache(model, processor, prompt, images, max_new_tokens)


class PagedSequence:
    """One sequence over a paged KV cache whose blocks are out of order and whose unused slots
    are NaN (a read past the sequence poisons the output)."""

    def __init__(self, config, num_blocks: int = 16, block_size: int = 8) -> None:
        import torch

        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [
            (torch.full(shape, float("nan")), torch.full(shape, float("nan")))
            for _ in range(config.num_layers)
        ]
        gen = torch.Generator().manual_seed(0)
        self.block_table = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        self.block_size, self.length = block_size, 0

    def run(self, model, ids, inputs_embeds=None):
        """The logits of ``ids``, the sequence's next tokens, as one step."""
        import torch

        from pagedserve.models.layers.attention import AttentionMetadata

        n, size = len(ids), self.block_size
        positions = torch.arange(self.length, self.length + n)
        slots = self.block_table[positions // size].long() * size + positions % size
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=self.block_table[None],
            seq_lens=torch.tensor([self.length + n], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        )
        hidden = model(ids, positions, self.kv_caches, meta, inputs_embeds=inputs_embeds)
        self.length += n
        return model.compute_logits(hidden)
