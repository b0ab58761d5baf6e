"""POST /v1/responses: OpenAI's Responses API over the chat path.

The input (a string, or messages) and ``instructions`` (a system message first) become a chat
conversation; planning, the chat template, the caps and the engine are the chat route's. The
answer is one assistant message with one ``output_text`` part; a response cut by
``max_output_tokens`` is ``incomplete``. Streamed, it is OpenAI's typed events, each an SSE
``event:`` line and its JSON, numbered by ``sequence_number``: response.created,
response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta (one per new text), response.output_text.done,
response.content_part.done, response.output_item.done, response.completed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.engine import RequestOutput
from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.protocol import ChatCompletionRequest, ChatMessage
from pagedserve.server.protocol_responses import (
    IncompleteDetails,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from pagedserve.server.serving_chat import plan_prompt
from pagedserve.server.sse import ClientDisconnected, EngineStreamingResponse, unless_disconnected
from pagedserve.server.state import ServerState, new_id, now_s
from pagedserve.server.streams import EngineStreams, PromptRequest, StreamProgress, final_outputs

# The chat route's names -> the Responses API's, so that a 400 names the field sent.
RESPONSES_ALIASES = {"max_tokens": "max_output_tokens", "messages": "input"}


def as_chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The same conversation as a chat request (what the Responses API does not have, refused)."""
    if body.previous_response_id is not None:
        raise bad_request(
            "previous_response_id needs stored responses; this server stores none (send the "
            "conversation in input)",
            "previous_response_id",
        )
    if body.tools:
        raise bad_request("tools are not supported", "tools")
    messages = []
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        messages.append(ChatMessage(role="user", content=body.input))
    else:
        messages += [ChatMessage(role=m.role, content=m.text()) for m in body.input]
    fields = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
    }
    sent = {
        k: v for k, v in fields.items() if k in ("model", "messages", "stream") or v is not None
    }
    return ChatCompletionRequest(**sent)


def renamed(error: APIError) -> APIError:
    if error.param is None:
        return error
    head, _, rest = error.param.partition(".")
    if head in RESPONSES_ALIASES:
        new = RESPONSES_ALIASES[head] + ("." + rest if rest else "")
        error.message = error.message.replace(error.param, new, 1)
        error.param = new
    return error


async def create_response(request: Request, state: ServerState, body: ResponsesRequest):
    state.check_admitting()
    try:
        prompt, aliases, _tools = plan_prompt(state, as_chat_request(body))
    except APIError as error:
        raise renamed(error) from error
    aliases = {**aliases, **RESPONSES_ALIASES, "prompt": "input"}
    view = _ResponsesView(state, body, prompt)
    streams = EngineStreams(state, view.id, [prompt], 0, aliases)
    try:
        await unless_disconnected(request, streams.admitted())
        if body.stream:
            return EngineStreamingResponse(view.stream(streams), streams)
        finals = await unless_disconnected(request, final_outputs(streams))
    except ClientDisconnected:
        streams.cancel()
        return Response(status_code=499)
    return JSONResponse(view.response(finals[0]).model_dump())


class _ResponsesView:
    def __init__(self, state: ServerState, body: ResponsesRequest, prompt: PromptRequest):
        self.state, self.body, self.prompt = state, body, prompt
        self.id = new_id("resp")
        self.message_id = new_id("msg")
        self.created = now_s()
        self.sequence = 0

    def response(self, final: RequestOutput | None) -> ResponseObject:
        """The response object: in progress (no output yet), or finished from ``final``."""
        body = self.body
        common = dict(
            id=self.id,
            created_at=self.created,
            model=self.state.model_name,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            metadata=body.metadata,
        )
        if final is None:
            return ResponseObject(status="in_progress", output=[], **common)
        completion = final.outputs[0]
        cut = completion.finish_reason == "length"
        status = "incomplete" if cut else "completed"
        num_prompt, num_output = len(self.prompt.prompt_token_ids), len(completion.token_ids)
        return ResponseObject(
            status=status,
            output=[self.message(completion.text, status)],
            usage=ResponseUsage(
                input_tokens=num_prompt,
                output_tokens=num_output,
                total_tokens=num_prompt + num_output,
            ),
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut else None,
            **common,
        )

    def message(self, text: str | None, status: str) -> OutputMessage:
        content = [] if text is None else [OutputText(text=text)]
        return OutputMessage(id=self.message_id, status=status, content=content)

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    async def stream(self, streams: EngineStreams) -> AsyncIterator[str]:
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        started = self.response(None).model_dump()
        yield self.event("response.created", response=started)
        yield self.event("response.in_progress", response=started)
        item = self.message(None, "in_progress").model_dump()
        yield self.event("response.output_item.added", output_index=0, item=item)
        empty = OutputText(text="").model_dump()
        yield self.event("response.content_part.added", part=empty, **where)
        progress, final = StreamProgress(), None
        try:
            async for _, output in streams:
                delta = progress.advance(0, output.outputs[0])
                if delta is not None and delta.text:
                    yield self.event(
                        "response.output_text.delta", delta=delta.text, logprobs=[], **where
                    )
                final = output
        except APIError as error:
            yield self.event(
                "error", code=error.code or error.type, message=error.message, param=error.param
            )
            return
        done = self.response(final).model_dump()
        message = done["output"][0]
        yield self.event(
            "response.output_text.done", text=message["content"][0]["text"], logprobs=[], **where
        )
        yield self.event("response.content_part.done", part=message["content"][0], **where)
        yield self.event("response.output_item.done", output_index=0, item=message)
        yield self.event(f"response.{done['status']}", response=done)
