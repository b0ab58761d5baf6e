"""A chat message and its content parts, as OpenAI's chat API spells them.

A message's ``content`` is a string, or a list of parts: ``{"type": "text", "text": ...}`` and
``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}``. Audio, video and file parts
are refused by the request's validation (errors.py says what ``content`` accepts). What an image
part's URL may be, and how its image is read, is media.py's; where its placeholder goes in the
prompt is media.py's too (``ImageInputs.message_content``).

Kept apart from protocol.py, which holds the request and response bodies around the messages.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictStr

from pagedserve.server.structured_protocol import ToolCall


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextContentPart(_Model):
    type: Literal["text"]
    text: StrictStr


class ImageURL(_Model):
    """Where the image is (a ``data:`` or ``file://`` URL, media.py) and OpenAI's ``detail``,
    of which only ``auto`` is served (media.check_detail says why)."""

    url: StrictStr
    detail: StrictStr | None = None


class ImageURLContentPart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL
    uuid: StrictStr | None = None  # vLLM's: refused (media.py), images are keyed by content


ContentPart = Annotated[TextContentPart | ImageURLContentPart, Field(discriminator="type")]


class ChatMessage(_Model):
    """One message. Content is text, or a list of text and image parts.

    The role is any string, as vLLM takes it: the chat template decides what a role it does not
    know means (most render it as they render any role; one that refuses it makes a 400)."""

    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    # an assistant turn's thinking, sent back as history (vLLM takes both names); a template
    # that shows earlier thinking reads it as ``reasoning_content``
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None
    # where the client sent this message when it was not ``messages.<i>`` (a Responses input
    # item, ``input.<k>``), so that a 400 about one of its parts names the field sent
    _origin: str | None = PrivateAttr(default=None)

    def text(self) -> str:
        """The message's text: its text parts joined, without separator (images left out)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextContentPart))

    def parts(self) -> list[TextContentPart | ImageURLContentPart]:
        """The content as parts, in the order sent (a string is one text part)."""
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [TextContentPart(type="text", text=self.content)]
        return list(self.content)

    def sent_as(self, origin: str) -> ChatMessage:
        """This message, noted as sent at ``origin`` (``input.3``) rather than ``messages.<i>``."""
        self._origin = origin
        return self

    def param(self, index: int) -> str:
        """The request field that holds this message, the ``index``-th of its conversation."""
        return self._origin or f"messages.{index}"
