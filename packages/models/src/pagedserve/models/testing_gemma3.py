"""A tiny random-weight Gemma 3 vision-language checkpoint and transformers' greedy reference,
for tests and tutorials (testing_multimodal.py holds LLaVA's and Qwen2-VL's).

The folder is what a google/gemma-3-*-it repository holds, made by transformers itself (no
download): ``Gemma3ForConditionalGeneration.save_pretrained`` (a 2-layer SigLIP tower of width
32 over 32-pixel squares of 4-pixel patches, its 8 x 8 grid pooled to 16 rows; a 2-layer Gemma 3
text decoder, a local layer with a ``TINY_WINDOW`` (16) window then a global one, so prompts of
a few dozen tokens cross the window), the tiny BPE tokenizer with Gemma 3's image tokens and
runs of 2 to 8 newlines added (Gemma's vocabulary holds each newline run as one token; the
processor writes ``"\\n\\n"`` around every image), and a ``Gemma3Processor`` (a PIL-backend
image processor resizing to 32 x 32, no pan-and-scan) that expands each ``<start_of_image>``
of a prompt into the image's 16 ``<image_soft_token>`` placeholders between its markers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedserve.models.testing import TINY_VOCAB, _llama_family_config, build_tiny_tokenizer
from pagedserve.models.testing_multimodal import _greedy_over_own_cache

BOI_TOKEN, EOI_TOKEN, IMAGE_SOFT_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
TINY_GEMMA3_IMAGE_SIZE, TINY_GEMMA3_PATCH, TINY_GEMMA3_IMAGE_TOKENS = 32, 4, 16
# Gemma 3's turns over this tokenizer's markers; an image part renders as <start_of_image>,
# which the processor (or the engine) expands
GEMMA3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<start_of_image>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>model\n{% endif %}"
)


def _gemma3_tokenizer(out_dir: Path):
    """The tiny tokenizer of testing.py with Gemma 3's image tokens (named on the tokenizer
    as ``boi_token``, ``eoi_token``, ``image_token``, as the processor reads them), newline
    runs, and the chat template."""
    from transformers import AutoTokenizer

    build_tiny_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(
        out_dir,
        extra_special_tokens={
            "boi_token": BOI_TOKEN, "eoi_token": EOI_TOKEN, "image_token": IMAGE_SOFT_TOKEN,
        },
    )  # fmt: skip
    tokenizer.add_tokens(["\n" * count for count in range(2, 9)])
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    return tokenizer


def _gemma3_config(tokenizer):
    """The tiny Gemma 3 text decoder of testing.py (untied head: see there) and the tiny
    SigLIP tower, with the tokenizer's image token ids."""
    from transformers import Gemma3Config, SiglipVisionConfig

    ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in [("boi_token_index", BOI_TOKEN), ("eoi_token_index", EOI_TOKEN),
                            ("image_token_index", IMAGE_SOFT_TOKEN)]
    }  # fmt: skip
    text = _llama_family_config("gemma3", {"vocab_size": max(TINY_VOCAB, len(tokenizer))})
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=TINY_GEMMA3_IMAGE_SIZE, patch_size=TINY_GEMMA3_PATCH, vision_use_head=False,
    )  # fmt: skip
    return Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=TINY_GEMMA3_IMAGE_TOKENS,
        tie_word_embeddings=False, **ids,
    )  # fmt: skip


def make_tiny_gemma3_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny Gemma 3 folder (model, tokenizer, processor) to ``out_dir``; returns it.

    Every weight is drawn from N(0, 0.1), as make_tiny_llava_checkpoint draws them; the
    tower's LayerNorm scales near 1 and Gemma's RMSNorm weights near 0 (Gemma scales by
    ``1 + weight``)."""
    import torch
    from transformers import (
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
    )

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    tokenizer = _gemma3_tokenizer(out_dir)
    config = _gemma3_config(tokenizer)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            layer_norm = ("layer_norm" in name or "post_layernorm" in name) and name.endswith(
                "weight"
            )
            param.normal_(1.0 if layer_norm else 0.0, 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    size = TINY_GEMMA3_IMAGE_SIZE
    image_processor = Gemma3ImageProcessorPil(  # the PIL backend: no torchvision needed
        size={"height": size, "width": size}, do_pan_and_scan=False
    )
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=GEMMA3_CHAT_TEMPLATE,
        image_seq_length=TINY_GEMMA3_IMAGE_TOKENS,
    )
    processor.save_pretrained(out_dir)
    return out_dir


def transformers_gemma3_greedy(
    folder: str | Path, prompt: str, images: list[Any], max_new_tokens: int
) -> tuple[list[int], list[int]]:
    """``(prompt ids, new ids)``: the processor's expanded prompt (each ``<start_of_image>``
    made ``"\\n\\n" <start_of_image> 16 x <image_soft_token> <end_of_image> "\\n\\n"``) and
    transformers' greedy continuation in fp32 over its own KV cache, never stopping early. The
    prefill passes the processor's ``token_type_ids`` (image tokens attend to their own image
    both ways); decode steps are plain causal steps."""
    import torch
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder)
    model = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return _greedy_over_own_cache(model, processor, prompt, images, max_new_tokens)
