"""A tiny random-weight LLaVA-1.5 checkpoint, test images, and transformers' greedy reference,
for tests and tutorials.

The folder is what a llava-hf repository holds, made by transformers itself (no download):
``LlavaForConditionalGeneration.save_pretrained`` (a 2-layer CLIP tower of width 32 over
``image_size`` squares of ``patch_size`` patches, the tiny Llama decoder of testing.py), the
tiny BPE tokenizer with ``<image>`` added as a special token, and a ``LlavaProcessor`` (a CLIP
image processor resizing and cropping to ``image_size``) that expands each ``<image>`` of a
prompt into one placeholder per image row. So ``AutoProcessor`` and transformers' model class
load it, and transformers' greedy continuation is the reference pagedserve is held to.
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
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    tokens: list[int] = []
    with torch.inference_mode():
        out = model(**inputs, use_cache=True)
        for _ in range(max_new_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            step = torch.tensor([[tokens[-1]]])
            out = model(input_ids=step, cache=out.cache, use_cache=True)
    return inputs["input_ids"][0].tolist(), tokens
