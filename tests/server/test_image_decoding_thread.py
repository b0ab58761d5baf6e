"""An image part is decoded in a worker thread, never on the event loop.

Decoding a large image takes a good fraction of a second (a 20 MB PNG of 8192x4096 pixels); on
the event loop it would stall every other stream of the server. media.py's public decoder
(``decode_image``) is wrapped here, on an app over the tiny LLaVA driven by an event loop of the
test's own (httpx over ASGI), whose default executor is a pool of threads named here:

- every image part of the chat, batch and responses routes is decoded in a thread of
  that pool, not on the loop's thread; the reply is still a 200;
- a text request submits nothing to the pool (it pays for no thread hop);
- the refusals of the whole prompt (a ``detail`` not served, too many images) come before any
  image is decoded, and a bad image is still a 400 naming its part;
- a decode that blocks until a concurrent text request has been answered finishes: the text
  request is served while the image is being decoded. On the loop it would wait forever (its
  wait times out, and the test fails).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import httpx
import pytest
from PIL import Image

from pagedserve.models.testing_multimodal import make_tiny_llava_checkpoint, tiny_test_images
from pagedserve.server import media
from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.testing import make_engine, png_data_url

LLAVA = "tiny-llava"
POOL = "test-default-executor"
WAIT_S = 30.0  # a decode that waits on the loop waits this long, then fails the request


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    path = make_tiny_llava_checkpoint(tmp_path_factory.mktemp("llava"))
    engine = make_engine(str(path), dtype="float32", limit_mm_per_prompt={"image": 2})
    yield build_app(engine, ServerConfig(), LLAVA)
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def picture_url() -> str:
    return png_data_url(tiny_test_images()[1])


class CountingPool(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor (``asyncio.to_thread``'s), counting what is submitted."""

    def __init__(self) -> None:
        super().__init__(max_workers=4, thread_name_prefix=POOL)
        self.submitted = 0

    def submit(self, *args, **kwargs):
        self.submitted += 1
        return super().submit(*args, **kwargs)


def serve(app, requests):
    """Run ``requests(client)`` (a coroutine function) on a new event loop whose default executor
    is a ``CountingPool``; its result, the loop's thread and the pool."""
    pool = CountingPool()

    async def main():
        asyncio.get_running_loop().set_default_executor(pool)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await requests(client), threading.current_thread()

    result, loop_thread = asyncio.run(main())
    return result, loop_thread, pool


@pytest.fixture
def decodes(monkeypatch) -> list[tuple[str, threading.Thread]]:
    """Each call of media.decode_image: the part it decodes and the thread that decodes it."""
    calls: list[tuple[str, threading.Thread]] = []
    decode = media.decode_image

    def recorded(data: bytes, param: str) -> Image.Image:
        calls.append((param, threading.current_thread()))
        return decode(data, param)

    monkeypatch.setattr(media, "decode_image", recorded)
    return calls


def chat(content, **fields) -> dict:
    messages = [{"role": "user", "content": content}]
    return {"model": LLAVA, "messages": messages, "max_tokens": 2, "temperature": 0, **fields}


def image(url: str, detail: str | None = None) -> dict:
    image_url = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": image_url}


def text(words: str) -> dict:
    return {"type": "text", "text": words}


def test_every_route_decodes_its_images_off_the_event_loop(app, picture_url, decodes):
    """Chat (two images), batch (one in each conversation) and responses: each image part
    decoded once, each in the default executor's pool, none on the loop's thread."""
    two = chat([image(picture_url), text("Compare."), image(picture_url)])
    conversations = [[{"role": "user", "content": [image(picture_url), text(t)]}] for t in "ab"]
    batch = {**chat(""), "messages": conversations}
    content = [
        {"type": "input_text", "text": "What?"},
        {"type": "input_image", "image_url": picture_url},
    ]
    responses = {
        "model": LLAVA,
        "input": [{"role": "user", "content": content}],
        "max_output_tokens": 2,
    }

    async def requests(client):
        return [
            await client.post("/v1/chat/completions", json=two),
            await client.post("/v1/chat/completions/batch", json=batch),
            await client.post("/v1/responses", json=responses),
        ]

    replies, loop_thread, _ = serve(app, requests)
    assert [r.status_code for r in replies] == [200] * 3, [r.text for r in replies]
    assert len(decodes) == 2 + 2 + 1
    assert [param for param, _ in decodes[:2]] == ["messages.0.content.0", "messages.0.content.2"]
    for param, thread in decodes:
        assert thread is not loop_thread, param
        assert thread.name.startswith(POOL), (param, thread.name)


def test_a_text_request_takes_no_thread_hop(app, decodes):
    """A text conversation is planned on the loop alone: nothing is decoded, nothing submitted to
    the pool that an image's decoding would use."""

    async def requests(client):
        return await client.post("/v1/chat/completions", json=chat("Hello"))

    reply, _, pool = serve(app, requests)
    assert reply.status_code == 200, reply.text
    assert decodes == []
    assert pool.submitted == 0


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (
            [image("data:image/png;base64,AAAA"), image("data:,x", "low")],
            "messages.0.content.1.image_url.detail",
        ),
        ([image("data:image/png;base64,AAAA")] * 3, "messages.0.content.2"),
    ],
    ids=["detail", "limit"],
)
def test_whole_prompt_refusals_come_before_any_decode(app, decodes, content, param):
    """A ``detail`` not served (on the second part) and one image over the limit are refused
    before the first part, a bad image, is decoded: the 400 names them, not the bad image."""

    async def requests(client):
        return await client.post("/v1/chat/completions", json=chat(content))

    reply, _, _ = serve(app, requests)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert decodes == []


def test_a_bad_image_decoded_in_the_thread_is_a_400_naming_its_part(app, picture_url, decodes):
    content = [image(picture_url), text("Compare."), image("data:image/png;base64,AAAA")]

    async def requests(client):
        return await client.post("/v1/chat/completions", json=chat(content))

    reply, _, _ = serve(app, requests)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "messages.0.content.2"
    assert [param for param, _ in decodes] == ["messages.0.content.0", "messages.0.content.2"]


def test_a_slow_decode_does_not_stall_a_text_request(app, picture_url, monkeypatch):
    """The image's decode waits until a text request sent after it has been answered. Off the
    loop, the text request is served meanwhile and both answer; on the loop, the text request
    could not run until the decode returned, so the decode would give up (a 500) first."""
    decoding, text_answered = threading.Event(), threading.Event()
    events: list[str] = []
    decode = media.decode_image

    def slow(data: bytes, param: str) -> Image.Image:
        decoding.set()
        if not text_answered.wait(WAIT_S):
            raise TimeoutError("the text request was not answered while the image decoded")
        events.append("image decoded")
        return decode(data, param)

    monkeypatch.setattr(media, "decode_image", slow)

    async def requests(client):
        image_reply = asyncio.create_task(
            client.post("/v1/chat/completions", json=chat([image(picture_url), text("What?")]))
        )
        while not decoding.is_set():
            await asyncio.sleep(0.01)
        text_reply = await client.post("/v1/chat/completions", json=chat("Hello"))
        events.append("text answered")
        text_answered.set()
        return text_reply, await image_reply

    (text_reply, image_reply), _, _ = serve(app, requests)
    assert text_reply.status_code == 200, text_reply.text
    assert image_reply.status_code == 200, image_reply.text
    assert events == ["text answered", "image decoded"]
