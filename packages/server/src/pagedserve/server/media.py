"""Image inputs: an ``image_url`` content part read into an RGB picture, safely, and its place in
the prompt.

A request names each image by URL, of two kinds; the server fetches nothing:

- ``data:image/<type>;base64,<data>``: the image itself, inside the request body (so also under
  ``--max-body-bytes``);
- ``file:///abs/path``: a file in the folder ``--allowed-local-media-path`` names, and only with
  it. The path is resolved (``..`` and symlinks) before it is compared with the folder, so
  neither leads out of it; a file outside the folder is refused the same whether or not it
  exists.

``http(s)://`` URLs are refused: a server that fetches what a request names can be made to reach
the hosts of its own network, and to wait on a slow one.

The limits hold before any pixel is decoded: first the encoded bytes (``MAX_IMAGE_BYTES``), then
the size the image's header declares (``MAX_IMAGE_SIDE`` a side, ``MAX_IMAGE_PIXELS`` in all).
Pillow opens lazily, reading the header only, so a small file that declares a huge image (a
decompression bomb) is refused for its declared size and never decoded. Pillow's own bomb check
(``Image.MAX_IMAGE_PIXELS``, process-wide, which this module leaves as it is) fires inside
``Image.open`` for the largest ones; its error, and its warning where a filter raises it, are
400s too. Pillow's EPS reader hands the file to Ghostscript, an outside interpreter: it is never
given a request's bytes.

Every refusal is a 400 that names the content part (``messages.<i>.content.<j>``).

Decoding is slow (a 20 MB PNG of 8192x4096 pixels takes a good fraction of a second), so
``ImageInputs.read`` runs it in a worker thread: on the event loop it would stall every other
stream of the server meanwhile. Only the decoding moves: the checks of the whole prompt run on
the loop before it, and the prompt is rendered on the loop after it (the server's tokenizer is
used from the loop's thread alone).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import io
import os
import stat
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from pagedserve.engine.multimodal import DEFAULT_IMAGES_PER_PROMPT, as_rgb, aspect_ratio_error
from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.protocol_content import ChatMessage, ImageURLContentPart
from pagedserve.server.state import ServerState

MAX_IMAGE_BYTES = 20 * 2**20  # encoded, as sent
MAX_IMAGE_SIDE = 8192
MAX_IMAGE_PIXELS = 8192 * 4096  # ~100 MiB decoded as RGB
_OUTSIDE_PROGRAM_FORMATS = frozenset({"EPS"})  # decoded by Ghostscript, not by Pillow
_SHOWN_URL_CHARS = 48


def load_image(url: str, param: str, local_folder: str | None) -> Image.Image:
    """The RGB image ``url`` holds (``param``: the content part, named in every 400)."""
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    if scheme == "data":
        data = data_url_bytes(url, param)
    elif scheme == "file":
        data = local_file_bytes(url, param, local_folder)
    elif scheme in ("http", "https"):
        raise bad_request(
            f"{param}: remote URLs are not fetched; send the image in a data: URL "
            "(data:image/png;base64,...)",
            param,
        )
    else:
        shown = url[:_SHOWN_URL_CHARS] + ("..." if len(url) > _SHOWN_URL_CHARS else "")
        raise bad_request(
            f"{param}: an image URL is a data: URL (data:image/png;base64,...) or a file:// URL; "
            f"got {shown!r}",
            param,
        )
    return decode_image(data, param)


def data_url_bytes(url: str, param: str) -> bytes:
    """The bytes of a base64 ``data:image/...`` URL, its size checked before it is decoded."""
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise bad_request(f"{param}: a data: URL needs a comma before its data", param)
    media_type, *attributes = [field.strip().lower() for field in header.split(";")]
    if not media_type.startswith("image/"):
        raise bad_request(
            f"{param}: the data: URL holds {media_type or 'text/plain'}, not an image "
            "(image/png, image/jpeg, ...)",
            param,
        )
    if "base64" not in attributes:
        raise bad_request(
            f"{param}: an image data: URL is base64 (data:{media_type};base64,...)", param
        )
    if len(payload) // 4 * 3 > MAX_IMAGE_BYTES:
        raise _too_large(param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad_request(f"{param}: the data: URL's data is not valid base64 ({e})", param) from e


def local_file_bytes(url: str, param: str, local_folder: str | None) -> bytes:
    """The bytes of a ``file://`` URL's file, which must lie inside ``local_folder``.

    The folder test is on the resolved path; that path is then opened without following a
    symlink at its end (one swapped in after the test is refused) and without blocking (on a
    FIFO), and read only if it is a regular file within the size limit."""
    if local_folder is None:
        raise bad_request(
            f"{param}: file:// URLs are read only from the server's --allowed-local-media-path, "
            "which is not set; send the image in a data: URL",
            param,
        )
    parts = urllib.parse.urlsplit(url)
    path = urllib.parse.unquote(parts.path)
    if parts.netloc not in ("", "localhost") or not path.startswith("/") or "\0" in path:
        raise bad_request(
            f"{param}: a file:// URL names an absolute local path: file:///...", param
        )
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise bad_request(f"{param}: {path} cannot be resolved: {e}", param) from e
    if not resolved.is_relative_to(Path(local_folder).resolve()):
        raise bad_request(f"{param}: {path} is not inside --allowed-local-media-path", param)
    try:
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise bad_request(f"{param}: {path} cannot be read: {e.strerror}", param) from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise bad_request(f"{param}: {path} is not a regular file", param)
        if info.st_size > MAX_IMAGE_BYTES:
            raise _too_large(param)
        with os.fdopen(os.dup(fd), "rb") as file:
            return file.read(MAX_IMAGE_BYTES + 1)
    finally:
        os.close(fd)


def decode_image(data: bytes, param: str) -> Image.Image:
    """``data`` decoded into an RGB image, its declared size checked before its pixels are."""
    if len(data) > MAX_IMAGE_BYTES:
        raise _too_large(param)
    try:
        with Image.open(io.BytesIO(data), formats=_pillow_formats()) as image:
            check_size(image.size, param)
            image.load()
            return as_rgb(image)
    except APIError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise bad_request(f"{param}: the image declares too many pixels ({e})", param) from e
    except UnidentifiedImageError as e:
        raise bad_request(f"{param}: the data is not an image this server reads", param) from e
    except Exception as e:  # a decoder's complaint about the bytes it was given: truncated, ...
        raise bad_request(f"{param}: the image is corrupt or truncated ({e})", param) from e


def check_size(size: tuple[int, int], param: str) -> None:
    width, height = size
    if max(width, height) > MAX_IMAGE_SIDE or width * height > MAX_IMAGE_PIXELS:
        raise bad_request(
            f"{param}: the image is {width}x{height} pixels; at most {MAX_IMAGE_SIDE} a side "
            f"and {MAX_IMAGE_PIXELS} pixels in all",
            param,
        )
    if aspect_ratio_error(size):
        raise bad_request(f"{param}: {aspect_ratio_error(size)}", param)


@functools.cache
def _pillow_formats() -> tuple[str, ...]:
    Image.init()
    return tuple(name for name in Image.OPEN if name not in _OUTSIDE_PROGRAM_FORMATS)


def _too_large(param: str) -> APIError:
    return bad_request(f"{param}: the image is over {MAX_IMAGE_BYTES} bytes", param)


def decode_images(
    parts: list[tuple[str, ImageURLContentPart]], local_folder: str | None
) -> list[Image.Image]:
    """The RGB images of ``parts`` (``image_parts``), in their order: blocking work, for a worker
    thread (``ImageInputs.read``)."""
    return [load_image(part.image_url.url, param, local_folder) for param, part in parts]


def check_detail(detail: str | None, param: str) -> None:
    """OpenAI's ``detail`` picks how finely its models look at an image; here the model's own
    processor sizes every image, so only ``auto`` holds (vLLM ignores the field; a request that
    asks for ``low`` to spend fewer tokens must learn that it would not)."""
    if detail not in (None, "auto"):
        raise bad_request(
            f"{param}: detail {detail!r} is not served: the model's image processor sizes "
            "every image; send 'auto' or leave it out",
            param,
        )


def image_parts(messages: list[ChatMessage]) -> list[tuple[str, ImageURLContentPart]]:
    """The conversation's image parts in prompt order, each with the field that holds it."""
    found = []
    for index, message in enumerate(messages):
        for j, part in enumerate(message.parts()):
            if isinstance(part, ImageURLContentPart):
                found.append((f"{message.param(index)}.content.{j}", part))
    return found


@dataclass(frozen=True)
class ImageInputs:
    """What the served model takes as images: ``placeholder``, the text that stands for one
    image in the prompt (None: a text model, which takes none), ``local_folder`` (file:// URLs,
    None: refused) and ``limit``, the most images one prompt may carry."""

    model_name: str
    placeholder: str | None
    local_folder: str | None
    limit: int

    @classmethod
    def of(cls, state: ServerState) -> ImageInputs:
        args = state.engine.args
        limits = args.limit_mm_per_prompt or {}
        return cls(
            model_name=state.model_name,
            placeholder=state.engine.image_placeholder,
            local_folder=args.allowed_local_media_path,
            limit=limits.get("image", DEFAULT_IMAGES_PER_PROMPT),
        )

    def check(self, parts: list[tuple[str, ImageURLContentPart]]) -> None:
        """What the prompt's image parts (``image_parts``) must be before any is read: each
        ``detail`` served, a model that takes images, no more images than the limit (the
        engine's own check, made before the server decodes images it would refuse)."""
        for param, part in parts:
            check_detail(part.image_url.detail, f"{param}.image_url.detail")
            if part.uuid is not None:
                raise bad_request(
                    f"{param}.uuid: images are not named by uuid here; the caches key each "
                    "image by a hash of its pixels",
                    f"{param}.uuid",
                )
        if parts and self.placeholder is None:
            raise bad_request(
                f"{parts[0][0]}: the model {self.model_name!r} does not accept images (it is a "
                "text model)",
                parts[0][0],
            )
        if len(parts) > self.limit:
            raise bad_request(
                f"{len(parts)} images in one prompt; at most {self.limit} are allowed "
                f"(limit_mm_per_prompt): {parts[self.limit][0]} is one too many",
                parts[self.limit][0],
            )

    async def read(self, parts: list[tuple[str, ImageURLContentPart]]) -> list[Image.Image]:
        """The images of the prompt's image parts (``image_parts``), in prompt order: checked
        (``check``) on the event loop, then decoded in a worker thread, off the loop."""
        self.check(parts)
        return await asyncio.to_thread(decode_images, parts, self.local_folder)

    def message_content(self, message: ChatMessage) -> str:
        """The content the chat template gets for ``message``, whose images ``read`` decoded
        (the prompt's images, in prompt order, are that list: this places their placeholders).

        vLLM's "string" content format: a message without images is its text; one with images
        is one placeholder per image, each on its own line, then the text (its text parts
        joined). A text that already holds placeholders keeps them, and only the images beyond
        their count get a line before the text, so a client can place images itself. The engine
        gives the prompt's placeholders its images in order: the lines before a text take its
        message's first images."""
        count = sum(isinstance(part, ImageURLContentPart) for part in message.parts())
        text = message.text()
        if not count:
            return text
        missing = max(0, count - text.count(self.placeholder))
        return "\n".join([self.placeholder] * missing + [text])
