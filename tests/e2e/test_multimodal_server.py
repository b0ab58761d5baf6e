"""`pagedserve serve` on the tiny LLaVA, its image options given on the command line, answers the
official openai client as transformers does: a base64 PNG and a file:// image (readable only
through --allowed-local-media-path) each give transformers' greedy tokens, streamed or not; a
repeated request is read from the prefix cache without running the vision encoder again, while
the same text with another picture shares only the blocks before its image; a third image is
refused under --limit-mm-per-prompt.
"""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from pagedserve.models.testing_multimodal import (
    make_tiny_llava_checkpoint,
    tiny_test_images,
    transformers_llava_greedy,
)
from pagedserve.server.testing import live_server, png_data_url

pytestmark = pytest.mark.slow  # one real server for the module: ~5 s to start

NAME = "tiny-llava"
BLOCK_SIZE = 16
MAX_TOKENS = 16
# long enough that whole blocks of text come before the image and after it
SYSTEM = "You look at pictures of coloured noise and say what you see in them, briefly."
QUESTION = "What is in this picture? Describe the colours and the shapes that you can see."
GREEDY = dict(
    max_tokens=MAX_TOKENS,
    temperature=0,
    extra_body={"ignore_eos": True, "return_token_ids": True},
)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_tiny_llava_checkpoint(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def pictures():
    return tiny_test_images()


@pytest.fixture(scope="module")
def cache_pictures():
    """Pictures no other test sends, so that the cache test's counters do not depend on the
    order the tests run in."""
    return tiny_test_images(seed=1)


@pytest.fixture(scope="module")
def media(tmp_path_factory, cache_pictures):
    folder = tmp_path_factory.mktemp("media")
    cache_pictures[1].save(folder / "square.png")  # PNG: lossless, the same pixels
    return folder


@pytest.fixture(scope="module")
def server(llava, media):
    flags = (
        "--served-model-name", NAME, "--dtype", "float32", "--max-model-len", "256",
        "--block-size", str(BLOCK_SIZE),
        "--allowed-local-media-path", str(media),
        "--limit-mm-per-prompt", '{"image": 2}',
    )  # fmt: skip
    with live_server(str(llava), *flags) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def messages(*urls: str, system: str = SYSTEM) -> list[dict]:
    parts = [{"type": "text", "text": QUESTION}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "system", "content": system}, {"role": "user", "content": parts}]


def reference(llava, images: list, system: str = SYSTEM) -> tuple[list[int], list[int]]:
    """transformers' (expanded prompt ids, greedy ids) for ``messages`` with ``images``: the
    chat template over string content, a placeholder line per image before the text."""
    tokenizer = AutoTokenizer.from_pretrained(llava)
    conversation = [
        {"role": "system", "content": system},
        {"role": "user", "content": "<image>\n" * len(images) + QUESTION},
    ]
    prompt = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return transformers_llava_greedy(llava, prompt, images, MAX_TOKENS)


def token_ids(completion) -> list[int]:
    return completion.choices[0].model_extra["token_ids"]


class CacheCounters:
    """/metrics' prefix-cache hits (tokens) and encoder-cache counters (images); ``grown()``
    is each one's growth since the last reading."""

    NAMES = ("prefix_cache_hits", "encoder_cache_encoded", "encoder_cache_hits")

    def __init__(self, server) -> None:
        self.server = server
        self.last = self.read()

    def read(self) -> dict[str, float]:
        return {name: self.server.metric(name + "_total") for name in self.NAMES}

    def grown(self) -> dict[str, float]:
        now = self.read()
        growth = {name: now[name] - self.last[name] for name in self.NAMES}
        self.last = now
        return growth


def test_an_image_chat_equals_transformers_and_repeats_are_read_from_the_caches(
    server, client, llava, cache_pictures, media
):
    """The same request twice: the second reads the image's blocks from the prefix cache and
    never runs the encoder. The same text with another picture (a file:// URL) shares only the
    blocks before its image. The first picture after another system prompt shares no block,
    but its embeddings come from the encoder cache. Every reply is transformers'."""
    expanded, expected = reference(llava, [cache_pictures[0]])
    image_token = AutoTokenizer.from_pretrained(llava).convert_tokens_to_ids("<image>")
    image_rows = [i for i, token in enumerate(expanded) if token == image_token]
    first_row, end_row = image_rows[0], image_rows[-1] + 1
    # the prompt's layout makes the checks telling: a whole block before the image, and the
    # image's blocks complete before the prompt's last block (which is always recomputed)
    assert first_row >= BLOCK_SIZE and end_row + BLOCK_SIZE < len(expanded)
    counters = CacheCounters(server)

    url = png_data_url(cache_pictures[0])
    first = client.chat.completions.create(model=NAME, messages=messages(url), **GREEDY)
    assert token_ids(first) == expected
    grown = counters.grown()
    assert grown["encoder_cache_encoded"] == 1 and grown["encoder_cache_hits"] == 0
    # the system prompt's blocks may have been cached by another test; no block with an image row
    assert grown["prefix_cache_hits"] <= first_row // BLOCK_SIZE * BLOCK_SIZE

    again = client.chat.completions.create(model=NAME, messages=messages(url), **GREEDY)
    assert token_ids(again) == expected
    grown = counters.grown()
    blocks_through_image = -(-end_row // BLOCK_SIZE) * BLOCK_SIZE
    assert grown["prefix_cache_hits"] >= blocks_through_image  # the image's rows were cached
    assert grown["encoder_cache_encoded"] == 0

    other_expanded, other_expected = reference(llava, [cache_pictures[1]])
    assert other_expanded[:first_row] == expanded[:first_row]  # the same text before it
    other = client.chat.completions.create(
        model=NAME, messages=messages(f"file://{media}/square.png"), **GREEDY
    )
    assert token_ids(other) == other_expected != expected
    assert counters.grown() == {
        "prefix_cache_hits": first_row // BLOCK_SIZE * BLOCK_SIZE,  # no block holding an image row
        "encoder_cache_encoded": 1,
        "encoder_cache_hits": 0,
    }

    system = "Be brief."  # another first token: no block of the prompt is shared
    moved = client.chat.completions.create(
        model=NAME, messages=messages(url, system=system), **GREEDY
    )
    assert token_ids(moved) == reference(llava, [cache_pictures[0]], system)[1]
    assert counters.grown() == {
        "prefix_cache_hits": 0, "encoder_cache_encoded": 0, "encoder_cache_hits": 1
    }  # fmt: skip


def test_a_streamed_image_chat_equals_transformers(client, llava, pictures):
    _, expected = reference(llava, [pictures[2]])
    whole = client.chat.completions.create(
        model=NAME, messages=messages(png_data_url(pictures[2])), **GREEDY
    )
    stream = client.chat.completions.create(
        model=NAME,
        messages=messages(png_data_url(pictures[2])),
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    streamed = [
        t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []
    ]
    assert streamed == expected == token_ids(whole)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_the_command_lines_image_limit_holds(client, llava, pictures):
    """Three images are one too many under --limit-mm-per-prompt '{"image": 2}' (the default
    allows four); two are served, as transformers answers them."""
    urls = [png_data_url(picture) for picture in pictures]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=NAME, messages=messages(*urls), **GREEDY)
    assert bad.value.body["param"] == "messages.1.content.3"
    assert "at most 2" in bad.value.body["message"]
    two = client.chat.completions.create(model=NAME, messages=messages(*urls[:2]), **GREEDY)
    assert token_ids(two) == reference(llava, pictures[:2])[1]
