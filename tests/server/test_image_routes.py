"""The chat, batch and responses routes on a model that takes images: a real engine over the
tiny LLaVA (a random CLIP tower and Llama decoder), transformers' own reference beside it.

A reply is transformers' greedy continuation of the prompt the chat template renders, with the
request's images in the order its parts give them (a data: URL and a file:// URL; swapped,
another answer that transformers agrees with); usage counts each image's rows; a placeholder the
text already holds keeps its place; n > 1, the batch route and the responses route carry the
images; more images than the limit, a bad image in a later message, hostile URLs and
placeholders without their images are 400s naming the part, holding no block afterwards.
"""

from __future__ import annotations

import asyncio
import base64

import pytest
from PIL import Image
from starlette.testclient import TestClient

from pagedserve.models.testing_multimodal import (
    make_tiny_llava_checkpoint,
    tiny_test_images,
    transformers_llava_greedy,
)
from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.testing import (
    blocks_held,
    data_url,
    make_engine,
    png_header,
    wait_engine_idle,
)
from pagedserve.server.testing import encoded_image as encoded

PART = "messages.0.content.1"

LLAVA = "tiny-llava"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_tiny_llava_checkpoint(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def tokenizer(llava):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llava)


@pytest.fixture(scope="module")
def pictures():
    """A wide, a square and a tall picture of noise; the tall one is also tall.png in the
    media folder."""
    return tiny_test_images()


@pytest.fixture(scope="module")
def media(tmp_path_factory, pictures):
    folder = tmp_path_factory.mktemp("media")
    pictures[2].save(folder / "tall.png")  # PNG: lossless, the file holds the same pixels
    return folder


@pytest.fixture(scope="module")
def llava_engine(llava, media):
    engine = make_engine(
        str(llava),
        dtype="float32",
        allowed_local_media_path=str(media),
        limit_mm_per_prompt={"image": 2},
    )
    yield engine
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def llava_client(llava_engine):
    app = build_app(llava_engine, ServerConfig(), LLAVA)
    return TestClient(app, raise_server_exceptions=False)


def image_part(url: str, detail: str | None = None) -> dict:
    image_url = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": image_url}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def greedy(messages: list, **fields) -> dict:
    """A greedy chat body that always runs MAX_TOKENS tokens and returns their ids."""
    body = {"model": LLAVA, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    return {**body, "ignore_eos": True, "return_token_ids": True, **fields}


def reference(llava, tokenizer, conversation: list[dict], images: list) -> tuple[list, list]:
    """transformers' (expanded prompt ids, greedy ids) for ``conversation`` (string content, as
    the server is to hand it to the chat template) and ``images`` in prompt order."""
    prompt = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return transformers_llava_greedy(llava, prompt, images, MAX_TOKENS)


def reply_ids(response) -> list[list[int]]:
    assert response.status_code == 200, response.text
    return [choice["token_ids"] for choice in response.json()["choices"]]


def refused(client, engine, route: str, body: dict, param: str) -> str:
    """Post ``body``: a 400 naming ``param``, no KV block left held, the server healthy; the
    error's message."""
    response = client.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    wait_engine_idle(engine)
    assert blocks_held(engine) == 0
    assert client.get("/health").json() == {"status": "ok"}
    return error["message"]


def test_images_reach_the_model_in_prompt_order(llava_client, llava, tokenizer, pictures, media):
    """A data: URL and a file:// URL, a placeholder line each before the text: the reply is
    transformers' on those images in that order; the parts swapped, another reply, and
    transformers' on the images swapped."""
    wide = image_part(data_url(encoded(pictures[0])), "auto")
    tall = image_part(f"file://{media}/tall.png")
    conversation = [{"role": "user", "content": "<image>\n<image>\nCompare them."}]
    answers = []
    for parts, images in (
        ([wide, text_part("Compare them."), tall], [pictures[0], pictures[2]]),
        ([tall, text_part("Compare them."), wide], [pictures[2], pictures[0]]),
    ):
        response = llava_client.post(
            "/v1/chat/completions", json=greedy([{"role": "user", "content": parts}])
        )
        _, expected = reference(llava, tokenizer, conversation, images)
        assert reply_ids(response) == [expected]
        answers.append(expected)
    assert answers[0] != answers[1]  # the order is seen: it is not a bag of images


def test_the_usage_counts_each_images_rows(llava_client, llava, tokenizer, pictures):
    """usage.prompt_tokens (and vLLM's ``prompt_token_ids``) are the prompt the model reads,
    each placeholder expanded into its image's rows, as vLLM and OpenAI count image tokens;
    so is the responses route's ``input_tokens``, which its ``cached_tokens`` never exceeds."""
    parts = [text_part("What is this?"), image_part(data_url(encoded(pictures[1])))]
    response = llava_client.post(
        "/v1/chat/completions", json=greedy([{"role": "user", "content": parts}])
    )
    conversation = [{"role": "user", "content": "<image>\nWhat is this?"}]
    expanded, expected = reference(llava, tokenizer, conversation, [pictures[1]])
    assert reply_ids(response) == [expected]
    body = response.json()
    assert body["usage"]["prompt_tokens"] == len(expanded)
    assert body["prompt_token_ids"] == expanded
    content = [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": parts[1]["image_url"]["url"]},
    ]
    response = llava_client.post(
        "/v1/responses",
        json={"model": LLAVA, "input": [{"role": "user", "content": content}],
              "max_output_tokens": 2, "temperature": 0},
    )  # fmt: skip
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["input_tokens"] == len(expanded)
    assert usage["input_tokens_details"]["cached_tokens"] <= usage["input_tokens"]


def test_without_max_tokens_the_reply_fills_the_room_the_expanded_prompt_leaves(
    llava_client, llava_engine, pictures
):
    """The default max_tokens is the room after the prompt as the engine runs it (each image's
    placeholder expanded): not the room after the shorter prompt the server tokenized, which
    would ask for more tokens than max_model_len leaves, and be refused."""
    parts = [text_part("Go on."), image_part(data_url(encoded(pictures[0])))]
    body = greedy([{"role": "user", "content": parts}])
    del body["max_tokens"]
    response = llava_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    usage, choice = response.json()["usage"], response.json()["choices"][0]
    max_model_len = llava_engine.scheduler_config.max_model_len
    assert usage["completion_tokens"] == max_model_len - usage["prompt_tokens"]
    assert choice["finish_reason"] == "length"


def test_a_text_that_holds_the_placeholder_places_the_image_there(
    llava_client, llava, tokenizer, pictures
):
    """No line is added for an image the text already places: the prompt has one placeholder
    (two would be refused for one image) and the reply is transformers' on that prompt."""
    parts = [text_part("Before <image> after"), image_part(data_url(encoded(pictures[0])))]
    response = llava_client.post(
        "/v1/chat/completions", json=greedy([{"role": "user", "content": parts}])
    )
    conversation = [{"role": "user", "content": "Before <image> after"}]
    assert reply_ids(response) == [reference(llava, tokenizer, conversation, [pictures[0]])[1]]


def test_more_images_than_the_limit_is_a_400_naming_the_first_too_many(llava_client, llava_engine):
    """Three images under a limit of two: the third part is named, before any image is read
    (a broken first image does not change the answer) and before the engine runs anything."""
    fresh = [data_url(encoded(image)) for image in tiny_test_images(seed=7)]
    before = llava_engine.get_stats(drain=False)
    parts = [text_part("Compare.")] + [image_part(url) for url in fresh]
    message = refused(
        llava_client,
        llava_engine,
        "/v1/chat/completions",
        greedy([{"role": "user", "content": parts}]),
        "messages.0.content.3",
    )
    assert "at most 2" in message
    parts[1] = image_part("data:image/png;base64,iVBORw0KGgo=")  # a PNG signature, no more
    refused(
        llava_client,
        llava_engine,
        "/v1/chat/completions",
        greedy([{"role": "user", "content": parts}]),
        "messages.0.content.3",
    )
    after = llava_engine.get_stats(drain=False)
    for counter in ("num_requests_finished", "prompt_tokens_total", "encoder_cache_encoded"):
        assert getattr(after, counter) == getattr(before, counter), counter


def test_a_bad_image_in_a_later_message_names_its_part(llava_client, llava_engine, pictures):
    broken = [text_part("And this?"), image_part("data:image/png;base64,iVBORw0KGgo=")]
    messages = [
        {"role": "user", "content": [image_part(data_url(encoded(pictures[0]))), text_part("Hi")]},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": broken},
    ]
    refused(
        llava_client, llava_engine, "/v1/chat/completions", greedy(messages), "messages.2.content.1"
    )


def test_n_choices_share_the_one_request_and_its_image(
    llava_client, llava_engine, llava, tokenizer
):
    """n=2 is one engine request whose picture is encoded once, and each choice is
    transformers' greedy reply on it."""
    picture = tiny_test_images(seed=3)[1]  # a picture no other test sends
    before = llava_engine.get_stats(drain=False)
    parts = [text_part("What is this?"), image_part(data_url(encoded(picture)))]
    response = llava_client.post(
        "/v1/chat/completions", json=greedy([{"role": "user", "content": parts}], n=2)
    )
    conversation = [{"role": "user", "content": "<image>\nWhat is this?"}]
    expected = reference(llava, tokenizer, conversation, [picture])[1]
    assert reply_ids(response) == [expected, expected]
    assert [c["index"] for c in response.json()["choices"]] == [0, 1]
    after = llava_engine.get_stats(drain=False)
    assert after.num_requests_finished - before.num_requests_finished == 1
    assert after.encoder_cache_encoded - before.encoder_cache_encoded == 1


def test_the_batch_route_carries_each_conversations_images(
    llava_client, llava, tokenizer, pictures
):
    """Conversation i's choice is transformers' reply to conversation i with its own images
    (and none for a text conversation)."""
    conversations = [
        [{"role": "user", "content": [text_part("Describe."), image_part(data_url(encoded(pictures[0])))]}],
        [{"role": "user", "content": "Hi"}],
        [{"role": "user", "content": [image_part(data_url(encoded(pictures[1]))), text_part("Describe.")]}],
    ]  # fmt: skip
    response = llava_client.post("/v1/chat/completions/batch", json=greedy(conversations))
    expected = [
        reference(llava, tokenizer, [{"role": "user", "content": content}], images)[1]
        for content, images in (
            ("<image>\nDescribe.", [pictures[0]]),
            ("Hi", []),
            ("<image>\nDescribe.", [pictures[1]]),
        )
    ]
    assert reply_ids(response) == expected


def test_the_responses_route_reads_input_image(
    llava_client, llava_engine, llava, tokenizer, pictures
):
    """``input_image`` after ``input_text``: a placeholder line before the text, the reply's
    text transformers' greedy reply decoded (to its first EOS: this route has no
    ``ignore_eos``); ``detail: "low"`` is refused naming its field."""
    content = [
        {"type": "input_text", "text": "Describe."},
        {"type": "input_image", "image_url": data_url(encoded(pictures[2])), "detail": "auto"},
    ]
    body = {"model": LLAVA, "input": [{"role": "user", "content": content}]}
    response = llava_client.post(
        "/v1/responses", json={**body, "max_output_tokens": MAX_TOKENS, "temperature": 0}
    )
    assert response.status_code == 200, response.text
    conversation = [{"role": "user", "content": "<image>\nDescribe."}]
    expected = reference(llava, tokenizer, conversation, [pictures[2]])[1]
    if tokenizer.eos_token_id in expected:
        expected = expected[: expected.index(tokenizer.eos_token_id)]
    (message,) = response.json()["output"]
    assert message["content"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    low = {**body, "input": [{"role": "user", "content": [{**content[1], "detail": "low"}]}]}
    refused(llava_client, llava_engine, "/v1/responses", low, "input.0.content.0.detail")


@pytest.fixture(scope="module")
def outside(media):
    """An image beside the media folder, outside it."""
    path = media.parent / f"{media.name}-secret.png"
    Image.new("RGB", (3, 3)).save(path)
    return path


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/cat.png",
        "file://{media}/../{outside}",
        "data:image/png;base64," + base64.b64encode(png_header(30000, 30000)).decode(),
        data_url(encoded(tiny_test_images()[1])[:2000]),
        "data:text/plain;base64,aGVsbG8=",
    ],
    ids=["remote", "outside-the-folder", "bomb-header", "truncated", "not-an-image"],
)
def test_hostile_image_urls_are_refused_and_hold_nothing(
    llava_client, llava_engine, media, outside, url
):
    url = url.format(media=media, outside=outside.name)
    parts = [text_part("What is this?"), image_part(url)]
    body = greedy([{"role": "user", "content": parts}])
    refused(llava_client, llava_engine, "/v1/chat/completions", body, PART)


def test_placeholders_without_their_images_are_refused_by_the_engine(
    llava_client, llava_engine, pictures
):
    """Two placeholders in the text, one image: the engine refuses the prompt (the server
    cannot know which placeholder the client meant), naming the messages."""
    parts = [text_part("<image> and <image>"), image_part(data_url(encoded(pictures[0])))]
    body = greedy([{"role": "user", "content": parts}])
    message = refused(llava_client, llava_engine, "/v1/chat/completions", body, "messages")
    assert "placeholder" in message


def test_the_llava_server_still_answers_as_transformers(
    llava_client, llava_engine, llava, tokenizer, pictures
):
    parts = [text_part("Still there?"), image_part(data_url(encoded(pictures[1])))]
    response = llava_client.post(
        "/v1/chat/completions", json=greedy([{"role": "user", "content": parts}])
    )
    conversation = [{"role": "user", "content": "<image>\nStill there?"}]
    assert reply_ids(response) == [reference(llava, tokenizer, conversation, [pictures[1]])[1]]
    wait_engine_idle(llava_engine)
    assert blocks_held(llava_engine) == 0


def test_what_an_image_prompt_cannot_take_is_refused_by_name(llava_client, llava_engine, pictures):
    """/tokenize (an image's tokens are its rows, which the engine decides), truncation (it
    would cut an image), vLLM's ``uuid`` (images are keyed by their pixels) and a strip whose
    sides differ by more than 50x (the processor would scale it up to gigabytes)."""
    url = data_url(encoded(pictures[0]))
    messages = [{"role": "user", "content": [text_part("What?"), image_part(url)]}]
    body = {"model": LLAVA, "messages": messages}
    message = refused(llava_client, llava_engine, "/tokenize", body, PART)
    assert "not tokenized here" in message
    truncated = greedy(messages, truncate_prompt_tokens=8)
    refused(llava_client, llava_engine, "/v1/chat/completions", truncated, "truncate_prompt_tokens")
    named = [{"role": "user", "content": [text_part("What?"), {**image_part(url), "uuid": "x"}]}]
    refused(llava_client, llava_engine, "/v1/chat/completions", greedy(named), f"{PART}.uuid")
    strip = data_url(encoded(Image.new("RGB", (8192, 4))))
    thin = [{"role": "user", "content": [text_part("What?"), image_part(strip)]}]
    message = refused(llava_client, llava_engine, "/v1/chat/completions", greedy(thin), PART)
    assert "50x" in message


def test_a_llava_hf_folder_whose_template_reads_parts_answers_as_transformers(
    tmp_path_factory, pictures
):
    """The chat template only in chat_template.json, reading content as parts (as llava-hf
    repositories hold it): the server renders the chat as parts, text and images, and answers
    as transformers does for the processor's rendering of the same chat."""
    from transformers import AutoProcessor

    folder = make_tiny_llava_checkpoint(tmp_path_factory.mktemp("hf"), processor_template=True)
    engine = make_engine(str(folder), dtype="float32")
    try:
        client = TestClient(build_app(engine, ServerConfig(), LLAVA))
        parts = [text_part("What is this?"), image_part(data_url(encoded(pictures[1])))]
        response = client.post(
            "/v1/chat/completions", json=greedy([{"role": "user", "content": parts}])
        )
        conversation = [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}],
            }
        ]
        prompt = AutoProcessor.from_pretrained(folder).apply_chat_template(
            conversation, add_generation_prompt=True
        )
        expanded, expected = transformers_llava_greedy(folder, prompt, [pictures[1]], MAX_TOKENS)
        assert reply_ids(response) == [expected]
        assert response.json()["prompt_token_ids"] == expanded
    finally:
        asyncio.run(engine.shutdown())
