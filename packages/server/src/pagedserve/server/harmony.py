"""OpenAI's harmony format (gpt-oss): a reply as a stream of messages, and its thinking.

gpt-oss's chat template ends the prompt with ``<|start|>assistant``; the reply is then one or
more messages, each a header, ``<|message|>``, its text and an end: ``<|end|>`` (more follow),
``<|call|>`` (a tool call) or ``<|return|>`` (the last). The next message opens with
``<|start|>assistant``. A header names the message's channel after ``<|channel|>``,
optionally its recipient (``to=functions.NAME``, before or after the channel) and the text's
content type (``<|constrain|>json``, or a bare ``json`` after the channel):

    <|channel|>analysis<|message|>The user asks for the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Tokyo"}<|call|>

(one reply, cut at its message boundaries here). ``analysis`` is the reasoning; ``final`` the
answer; ``commentary`` carries tool calls (a message with a recipient) and preambles the user
may see (one without). The markers are special tokens, so a reply read this way is detokenized
with them kept.

``HarmonyStream`` reads the text in pieces into message events, holding back what could still
be the start of a marker. ``HarmonySplitter`` is ``--reasoning-parser openai_gptoss``'s splitter
(the ``ReasoningSplitter`` interface): analysis text is the thinking; final and preamble text is
the answer, verbatim; a message to a recipient goes on into the answer as one canonical call,
``<|channel|>commentary to=RECIPIENT <|constrain|>json<|message|>ARGS<|call|>``, which the
``openai`` tool parser reads (tool_parsers/harmony.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pagedserve.server.tool_parsers.base import held_back
from pagedserve.server.tool_parsers.harmony import CALL_END, CALL_OPEN

START, CHANNEL, CONSTRAIN, MESSAGE = "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>"
ENDS = ("<|end|>", CALL_END, "<|return|>")
MARKERS = (START, CHANNEL, CONSTRAIN, MESSAGE, *ENDS)
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=<\||\s|$)")


@dataclass(frozen=True)
class Header:
    """A message's header: its channel (None when it names none), its recipient (None: to the
    user) and its content type (None: text)."""

    channel: str | None
    recipient: str | None
    content_type: str | None

    @classmethod
    def parse(cls, raw: str) -> Header:
        """From the text between a message's start and ``<|message|>`` (its role included)."""
        recipient = _RECIPIENT.search(raw)
        channel = content_type = None
        if CHANNEL in raw:
            after = raw.split(CHANNEL, 1)[1]
            words = [w for w in after.replace(CONSTRAIN, " ").split() if not w.startswith("to=")]
            channel = words[0] if words else None
            content_type = words[1] if len(words) > 1 else None
        elif CONSTRAIN in raw:
            content_type = raw.split(CONSTRAIN, 1)[1].strip() or None
        return cls(channel, recipient.group(1) if recipient else None, content_type)


@dataclass(frozen=True)
class Event:
    """``text`` of message ``header`` (``kind`` "text"), or its end (``kind`` "end";
    ``text`` the end marker, empty when the reply stopped inside the message)."""

    kind: str
    header: Header
    text: str = ""


class HarmonyStream:
    """Reads one reply's text, fed in pieces, into message events. The reply starts inside a
    header (the prompt opened the assistant's message); text outside any message (a reply
    that is not harmony at all) is the text of a message without a channel."""

    def __init__(self) -> None:
        self._buffer = ""
        self._header: Header | None = None  # the open message's, once its <|message|> is read
        self._in_header = True

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        events = self._drain(final=True)
        if self._in_header and self._buffer.strip() and not any(m in self._buffer for m in MARKERS):
            plain = Header(None, None, None)  # no harmony: the reply's text as it is
            events += [Event("text", plain, self._buffer), Event("end", plain)]
        elif self._header is not None:
            events.append(Event("end", self._header))  # stopped inside (its end token unread)
        self._buffer, self._header = "", None
        return events

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self._in_header:
                at = self._buffer.find(MESSAGE)
                if at < 0:
                    return events
                self._header = Header.parse(self._buffer[:at])
                self._buffer, self._in_header = self._buffer[at + len(MESSAGE) :], False
            header = self._header
            ends = [(self._buffer.find(end), end) for end in ENDS]
            found = min(((i, e) for i, e in ends if i >= 0), default=None)
            if found is None:
                keep = 0 if final else held_back(self._buffer, 0, ENDS)
                cut = len(self._buffer) - keep
                if cut:
                    events.append(Event("text", header, self._buffer[:cut]))
                self._buffer = self._buffer[cut:]
                return events
            at, end = found
            if at:
                events.append(Event("text", header, self._buffer[:at]))
            events.append(Event("end", header, end))
            rest = self._buffer[at + len(end) :]
            self._buffer, self._header, self._in_header = rest.removeprefix(START), None, True


class HarmonySplitter:
    """A harmony reply's thinking and answer (the module docstring), fed in pieces:
    ``feed``/``finish`` return ``(thinking, answer)`` settled so far. ``ended``: the thinking
    closed, as ``</think>`` closes it (an analysis message's end marker was read);
    ``thought``: some of the reply was thinking."""

    def __init__(self) -> None:
        self._stream = HarmonyStream()
        self._open_call = False
        self.ended = False
        self.thought = False

    def feed(self, text: str) -> tuple[str, str]:
        return self._split(self._stream.feed(text))

    def finish(self) -> tuple[str, str]:
        thinking, answer = self._split(self._stream.finish())
        if self._open_call:  # stopped on its <|call|>, which the reply's text leaves out
            answer, self._open_call = answer + CALL_END, False
        return thinking, answer

    def _split(self, events: list[Event]) -> tuple[str, str]:
        thinking, answer = "", ""
        for event in events:
            header = event.header
            if header.channel == "analysis" and header.recipient is None:
                if event.kind == "text":
                    thinking += event.text
                    self.thought = True
                elif event.text:  # its end marker (not the reply stopping inside it)
                    self.ended = True
                continue
            if header.recipient is None:
                answer += event.text if event.kind == "text" else ""
                continue
            if not self._open_call:  # a call's canonical header, once
                answer += f"{CALL_OPEN}{header.recipient} {CONSTRAIN}json{MESSAGE}"
                self._open_call = True
            if event.kind == "text":
                answer += event.text
            else:
                answer, self._open_call = answer + CALL_END, False
        return thinking, answer
