"""`pagedserve serve` on a tiny Qwen2-VL, Qwen2.5-VL and Gemma 3 answers the official openai
client as transformers does: base64 PNGs of different sizes (for Qwen2-VL, of different token
counts) in a chat, streamed or not, and an image in the Responses API's input; the chat
template reads the content as parts and renders each image as its markers (Gemma 3's
``<start_of_image>``, which the engine expands as the processor does). LLaVA's server test is
test_multimodal_server.py."""

from __future__ import annotations

import json

import openai
import pytest
from transformers import AutoTokenizer

from pagedserve.models.testing_gemma3 import make_tiny_gemma3_checkpoint, transformers_gemma3_greedy
from pagedserve.models.testing_multimodal import (
    make_tiny_qwen2_vl_checkpoint,
    tiny_test_images,
    transformers_qwen2_vl_greedy,
)
from pagedserve.server.testing import live_server, png_data_url

pytestmark = pytest.mark.slow  # one real server per model: ~5 s each to start

NAME = "tiny-vision"
MAX_TOKENS = 16
QUESTION = "What is in these pictures? Describe the colours."
GREEDY = dict(
    max_tokens=MAX_TOKENS,
    temperature=0,
    extra_body={"ignore_eos": True, "return_token_ids": True},
)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "gemma3"])
def folder(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3":
        return make_tiny_gemma3_checkpoint(out)
    return make_tiny_qwen2_vl_checkpoint(out, request.param)


@pytest.fixture(scope="module")
def client(folder):
    flags = ("--served-model-name", NAME, "--dtype", "float32", "--max-model-len", "512")
    with live_server(str(folder), *flags) as live:
        yield openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def reference(folder, images: list) -> list[int]:
    """transformers' greedy ids for the user message: the chat template over content parts
    (an image part per image, then the text, as the server hands them)."""
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": QUESTION}]
    prompt = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    gemma3 = json.loads((folder / "config.json").read_text())["model_type"] == "gemma3"
    greedy = transformers_gemma3_greedy if gemma3 else transformers_qwen2_vl_greedy
    return greedy(folder, prompt, images, MAX_TOKENS)[1]


def messages(*pictures) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": png_data_url(p)}} for p in pictures]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


def test_images_of_two_sizes_equal_transformers_whole_and_streamed(client, folder):
    pictures = tiny_test_images()[:2]
    expected = reference(folder, pictures)
    whole = client.chat.completions.create(model=NAME, messages=messages(*pictures), **GREEDY)
    assert whole.choices[0].model_extra["token_ids"] == expected
    stream = client.chat.completions.create(
        model=NAME, messages=messages(*pictures), stream=True, **GREEDY
    )
    streamed = [
        t for c in stream if c.choices for t in c.choices[0].model_extra.get("token_ids") or []
    ]
    assert streamed == expected


def test_an_image_in_the_responses_input_equals_transformers(client, folder):
    picture = tiny_test_images()[2]
    response = client.responses.create(
        model=NAME,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": png_data_url(picture)},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ],  # fmt: skip
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    expected = AutoTokenizer.from_pretrained(folder).decode(
        reference(folder, [picture]), skip_special_tokens=True
    )
    assert response.output_text == expected
