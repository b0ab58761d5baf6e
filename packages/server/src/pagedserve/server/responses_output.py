"""The output of one /v1/responses reply: its items, and OpenAI's typed events as they stream.

The reply is read by the request's ``ReplyPlan`` (reply.py); each ``ReplyDelta`` extends the open
item or opens the next: a ``reasoning`` item for the thinking (its text in one ``reasoning_text``
part), a ``message`` for the answer's text (one ``output_text`` part), a ``function_call`` per
tool call, in the order the reply writes them. Streamed, each item is framed as OpenAI frames
it: ``response.output_item.added``, for a reasoning item or a message ``response.content_part
.added``, then its text's deltas (``response.reasoning_text.delta``, ``response.output_text
.delta``, ``response.function_call_arguments.delta``), their ``.done``, ``response.content_part
.done``, ``response.output_item.done``; every event numbered by ``sequence_number``. A
non-streamed reply goes through the same builder, so the two give the same items.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.server.reply import ReplyDelta
from pagedserve.server.state import new_id
from pagedserve.server.tools import new_tool_call_id

TEXT_PART = {"reasoning": "reasoning_text", "message": "output_text"}
DELTA_EVENT = {
    "reasoning": "response.reasoning_text.delta",
    "message": "response.output_text.delta",
    "function_call": "response.function_call_arguments.delta",
}


class OutputItems:
    """The items of one reply (dicts in the Responses API's shape) and their events."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # the reply's call index -> its item
        self.sequence = 0

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def feed(self, delta: ReplyDelta) -> list[str]:
        """The events of one delta of the reply."""
        events: list[str] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.calls:
            if call.name is not None:
                events += self._opened(self._function_call(call.index, call.name))
            item = self._calls[call.index]
            if call.arguments:
                item["arguments"] += call.arguments
                events.append(self._delta(item, call.arguments))
        return events

    def close(self, status: str) -> list[str]:
        """Closes the open item; every item takes the reply's final ``status``."""
        events = self._closed()
        for item in self.items:
            item["status"] = status
        return events

    # ---- items -------------------------------------------------------------------------

    def _text(self, kind: str, text: str) -> list[str]:
        events = []
        if self._open is None or self._open["type"] != kind:
            prefix = "rs" if kind == "reasoning" else "msg"
            item: dict[str, Any] = {"id": new_id(prefix), "type": kind, "status": "in_progress"}
            if kind == "reasoning":
                item["summary"] = []
            else:
                item["role"] = "assistant"
            item["content"] = []
            events += self._opened(item)
        item = self._open
        assert item is not None
        item["content"][0]["text"] += text
        events.append(self._delta(item, text))
        return events

    def _function_call(self, index: int, name: str) -> dict[str, Any]:
        call_id = new_tool_call_id()
        item = {
            "id": "fc_" + call_id.removeprefix("call_"),
            "type": "function_call",
            "call_id": call_id,
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        self._calls[index] = item
        return item

    def _opened(self, item: dict[str, Any]) -> list[str]:
        events = self._closed()
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=item))
        if item["type"] in TEXT_PART:
            part = {"type": TEXT_PART[item["type"]], "text": ""}
            if item["type"] == "message":
                part.update(annotations=[], logprobs=[])
            events.append(self.event("response.content_part.added", part=part, **self._where()))
            item["content"].append(dict(part))
        return events

    def _closed(self) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        index = self.items.index(item)
        events = []
        if item["type"] in TEXT_PART:
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            part = item["content"][0]
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else None
            extra = {} if done else {"logprobs": []}
            events.append(
                self.event(done or "response.output_text.done", text=part["text"], **extra, **where)
            )
            events.append(self.event("response.content_part.done", part=part, **where))
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    arguments=item["arguments"],
                    item_id=item["id"],
                    output_index=index,
                )
            )
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def _where(self) -> dict[str, Any]:
        item = self.items[-1]
        return {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _delta(self, item: dict[str, Any], text: str) -> str:
        index = self.items.index(item)
        fields: dict[str, Any] = {"item_id": item["id"], "output_index": index, "delta": text}
        if item["type"] in TEXT_PART:
            fields["content_index"] = 0
        if item["type"] == "message":
            fields["logprobs"] = []
        return self.event(DELTA_EVENT[item["type"]], **fields)
