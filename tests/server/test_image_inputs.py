"""Image inputs on the server side: media.py reads an image part's URL safely, and the chat and
responses routes carry the images to the model with a placeholder per image in the prompt.

Unit tests of media.py: data: URLs of PNG and JPEG decode to RGB of their size (a transparent
pixel over white); what is not an image data: URL, bad base64, a truncated PNG, a header that
declares a huge image (with or without Pillow's own bomb check), an oversized payload and file
are 400s; file:// URLs only inside --allowed-local-media-path (``..``, symlinks, FIFOs and the
flag's absence refused); http(s) never fetched.

Server tests, on the tiny text model: an image part is a 400 naming it, ``detail: "high"`` a 400
naming the field, and the server still serves. The routes on a model that takes images: test_image_routes.py.
"""

from __future__ import annotations

import base64
import os

import openai
import pytest
from PIL import Image

from pagedserve.server.errors import APIError
from pagedserve.server.media import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, decode_image, load_image
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL_NAME
from pagedserve.server.testing import blocks_held, data_url, png_header, wait_engine_idle
from pagedserve.server.testing import encoded_image as encoded

PART = "messages.0.content.1"


def refusal(url: str, folder: str | None = None) -> APIError:
    with pytest.raises(APIError) as caught:
        load_image(url, PART, folder)
    assert caught.value.status_code == 400 and caught.value.param == PART
    assert PART in caught.value.message
    return caught.value


# ---- media.py ---------------------------------------------------------------------------------


def test_png_and_jpeg_data_urls_decode_to_rgb_of_their_size():
    palette = Image.new("P", (37, 23))
    palette.putpalette([0, 0, 0, 200, 10, 30] + [0] * 762)
    palette.paste(1, (5, 5, 20, 15))
    png = load_image(data_url(encoded(palette)), PART, None)
    assert png.mode == "RGB" and png.size == (37, 23)
    assert png.getpixel((6, 6)) == (200, 10, 30) and png.getpixel((0, 0)) == (0, 0, 0)
    assert png.tobytes() == palette.convert("RGB").tobytes()  # lossless: every pixel

    photo = Image.new("RGB", (40, 30), (30, 120, 200))
    jpeg = load_image(data_url(encoded(photo, "JPEG"), "image/jpeg"), PART, None)
    assert jpeg.mode == "RGB" and jpeg.size == (40, 30)
    assert all(abs(a - b) <= 3 for a, b in zip(jpeg.getpixel((20, 15)), (30, 120, 200)))


def test_a_transparent_pixel_is_white_and_an_opaque_one_keeps_its_colour():
    image = Image.new("RGBA", (2, 1), (255, 0, 0, 0))
    image.putpixel((1, 0), (0, 0, 255, 255))
    rgb = load_image(data_url(encoded(image)), PART, None)
    assert rgb.getpixel((0, 0)) == (255, 255, 255) and rgb.getpixel((1, 0)) == (0, 0, 255)


@pytest.mark.parametrize(
    "url, words",
    [
        ("data:text/plain;base64,aGVsbG8=", "text/plain"),
        ("data:;base64,aGVsbG8=", "text/plain"),
        ("data:image/png,rawbytes", "base64"),
        ("data:image/png;base64", "comma"),
        ("data:image/png;base64,@@not base64@@", "base64"),
        ("data:image/png;base64," + base64.b64encode(b"hello, not a picture").decode(), "not an"),
    ],
    ids=["text", "no-type", "not-base64", "no-comma", "bad-base64", "not-an-image"],
)
def test_a_data_url_that_is_not_a_base64_image_is_a_400(url, words):
    assert words in refusal(url).message


def test_a_truncated_png_is_a_400():
    noise = Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3))
    whole = encoded(noise)
    assert "truncated" in refusal(data_url(whole[: len(whole) // 2])).message


def test_a_header_that_declares_30000x30000_pixels_is_a_400_without_decoding():
    before = Image.MAX_IMAGE_PIXELS
    assert "too many pixels" in refusal(data_url(png_header(30000, 30000))).message
    assert Image.MAX_IMAGE_PIXELS == before  # nothing process-wide was changed


def test_the_size_check_holds_without_pillows_own(monkeypatch):
    """A process may switch Pillow's bomb check off (Image.MAX_IMAGE_PIXELS = None): the
    declared size is still refused, before the pixels are decoded."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert "30000x30000" in refusal(data_url(png_header(30000, 30000))).message


def test_the_pixel_and_side_limits_are_below_pillows_and_hold():
    side = int(MAX_IMAGE_PIXELS**0.5) + 8  # a square just past the pixel limit, sides allowed
    assert "pixels" in refusal(data_url(png_header(side, side))).message
    wide = Image.new("L", (9000, 1))  # small in pixels, too wide a side
    assert "9000x1" in refusal(data_url(encoded(wide))).message


def test_an_oversized_payload_is_refused_before_it_is_decoded():
    payload = "A" * ((MAX_IMAGE_BYTES // 3 + 8) * 4)
    assert "bytes" in refusal("data:image/png;base64," + payload).message
    with pytest.raises(APIError) as caught:
        decode_image(b"\0" * (MAX_IMAGE_BYTES + 1), PART)
    assert caught.value.param == PART


@pytest.mark.parametrize("url", ["http://127.0.0.1/cat.png", "HTTPS://example.com/cat.png"])
def test_remote_urls_are_never_fetched(url):
    assert "remote URLs are not fetched" in refusal(url).message


def test_an_unknown_scheme_is_a_400():
    assert "data: URL" in refusal("ftp://host/cat.png").message


@pytest.fixture
def media_folder(tmp_path):
    """``allowed/`` with one image, and an image beside it, outside."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(encoded(Image.new("RGB", (7, 5), (1, 2, 3))))
    (tmp_path / "secret.png").write_bytes(encoded(Image.new("RGB", (3, 3))))
    return allowed


def test_a_file_url_inside_the_allowed_folder_is_read(media_folder):
    image = load_image(f"file://{media_folder}/cat.png", PART, str(media_folder))
    assert image.size == (7, 5) and image.getpixel((0, 0)) == (1, 2, 3)
    (media_folder / "sub dir").mkdir()
    os.symlink(media_folder / "cat.png", media_folder / "sub dir" / "alias.png")
    inside = load_image(f"file://{media_folder}/sub%20dir/alias.png", PART, str(media_folder))
    assert inside.size == (7, 5)  # a symlink that stays inside is followed


def test_a_file_url_without_the_flag_is_a_400(media_folder):
    assert "--allowed-local-media-path" in refusal(f"file://{media_folder}/cat.png").message


def test_paths_that_lead_out_of_the_folder_are_400s(media_folder):
    folder = str(media_folder)
    assert "not inside" in refusal(f"file://{media_folder}/../secret.png", folder).message
    os.symlink(media_folder.parent / "secret.png", media_folder / "escape.png")
    assert "not inside" in refusal(f"file://{media_folder}/escape.png", folder).message
    os.symlink(media_folder.parent, media_folder / "up")
    assert "not inside" in refusal(f"file://{media_folder}/up/secret.png", folder).message
    missing = refusal(f"file://{media_folder}/../no-such.png", folder).message
    assert "not inside" in missing  # the same answer, whether or not the file exists outside
    assert "file:///" in refusal("file://otherhost/etc/passwd", folder).message


def test_a_fifo_a_folder_a_missing_file_and_a_huge_file_are_400s(media_folder):
    folder = str(media_folder)
    os.mkfifo(media_folder / "pipe.png")  # would block a plain open() for a writer
    assert "regular file" in refusal(f"file://{media_folder}/pipe.png", folder).message
    assert "regular file" in refusal(f"file://{media_folder}", folder).message
    assert "cannot be read" in refusal(f"file://{media_folder}/none.png", folder).message
    with open(media_folder / "huge.png", "wb") as file:
        file.truncate(MAX_IMAGE_BYTES + 1)  # sparse: nothing is written, nothing must be read
    assert "bytes" in refusal(f"file://{media_folder}/huge.png", folder).message


# ---- the routes, on a text model --------------------------------------------------------------

PIXEL = data_url(encoded(Image.new("RGB", (4, 4), (9, 9, 9))))


def image_message(detail: str | None = None, text: str = "What is this?") -> dict:
    image_url = {"url": PIXEL} if detail is None else {"url": PIXEL, "detail": detail}
    return {
        "role": "user",
        "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": image_url}],
    }


@pytest.fixture(scope="module")
def oai(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)


def test_an_image_to_a_text_model_is_a_400_naming_the_part(oai):
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model=MODEL_NAME, messages=[image_message()], max_tokens=2)
    assert bad.value.body["param"] == PART
    assert "does not accept images" in bad.value.body["message"]


def test_detail_other_than_auto_is_a_400_naming_the_field(oai):
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(
            model=MODEL_NAME, messages=[image_message("high")], max_tokens=2
        )
    assert bad.value.body["param"] == PART + ".image_url.detail"
    assert "'high'" in bad.value.body["message"]


def test_an_audio_part_is_a_400_naming_the_content(client):
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": [audio]}]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages.0.content"
    assert "image_url" in response.json()["error"]["message"]


def test_an_input_image_to_a_text_model_is_a_400_naming_it(client):
    content = [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": PIXEL},
    ]
    body = {"model": MODEL_NAME, "input": [{"role": "user", "content": content}]}
    response = client.post("/v1/responses", json={**body, "instructions": "Be brief."})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "input.0.content.1"


def test_the_server_still_serves_after_refused_images(client, engine):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    wait_engine_idle(engine)
    assert blocks_held(engine) == 0
    assert client.get("/health").json() == {"status": "ok"}
