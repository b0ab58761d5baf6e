"""POST /v1/responses: OpenAI's Responses API over the chat path.

The input (a string, or messages) and ``instructions`` (a system message first) become a chat
conversation; planning, the chat template, the caps and the engine are the chat route's. The
answer is one assistant message with one ``output_text`` part; a response cut by
``max_output_tokens`` is ``incomplete``. Streamed, it is OpenAI's typed events, each an SSE
``event:`` line and its JSON, numbered by ``sequence_number``: response.created,
response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta (one per new text), response.output_text.done,
response.content_part.done, response.output_item.done, response.completed.

Function tools are the chat route's (tools.py): the flat Responses tools and tool_choice become
chat's, ``function_call`` / ``function_call_output`` input items become assistant tool_calls and
``tool`` messages, and the calls found in the reply are ``function_call`` output items. A named
call streams its arguments as ``response.function_call_arguments.delta`` while they are written;
under "auto"/"required" the reply is parsed whole at its end and its items are sent then.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request

from pagedserve.engine import RequestOutput
from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.protocol import ChatCompletionRequest, ChatMessage
from pagedserve.server.protocol_responses import (
    FunctionCallInput,
    FunctionCallOutputInput,
    FunctionToolChoice,
    IncompleteDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from pagedserve.server.serving_chat import plan_prompt
from pagedserve.server.sse import answer
from pagedserve.server.state import ServerState, new_id, now_s
from pagedserve.server.streams import EngineStreams, PromptRequest, StreamProgress
from pagedserve.server.structured_protocol import (
    ChatCompletionTool,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
)
from pagedserve.server.tools import ToolCallPlan, new_tool_call_id

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
    messages = []
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        messages.append(ChatMessage(role="user", content=body.input))
    else:
        messages += chat_messages(body.input)
    fields = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "tools": chat_tools(body.tools) if body.tools else None,
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    sent = {
        k: v for k, v in fields.items() if k in ("model", "messages", "stream") or v is not None
    }
    return ChatCompletionRequest(**sent)


def chat_messages(items: list) -> list[ChatMessage]:
    """Input items as chat messages: ``function_call`` items join the assistant turn before
    them (its text, or the calls before them: one turn's ``tool_calls``), a
    ``function_call_output`` is a ``tool`` message."""
    messages: list[ChatMessage] = []
    for item in items:
        if isinstance(item, FunctionCallInput):
            call = ToolCall(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputInput):
            messages.append(
                ChatMessage(role="tool", tool_call_id=item.call_id, content=item.text())
            )
        else:
            messages.append(ChatMessage(role=item.role, content=item.text()))
    return messages


def chat_tools(tools: list[dict[str, Any]]) -> list[ChatCompletionTool]:
    """Flat function tools as chat's ``{"type": "function", "function": {...}}``; any other
    tool type (web_search, file_search, ...) is a 400 naming it."""
    converted = []
    for index, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(
                f"tools[{index}] has type {kind!r}; only function tools are served",
                f"tools[{index}]",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{index}].name is missing", f"tools[{index}]")
        try:
            function = FunctionDefinition.model_validate(tool)
        except ValidationError as error:
            reason = error.errors(include_url=False)[0]["msg"]
            raise bad_request(f"tools[{index}]: {reason}", f"tools[{index}]") from error
        converted.append(ChatCompletionTool(function=function))
    return converted


def chat_tool_choice(choice):
    if isinstance(choice, FunctionToolChoice):
        return NamedToolChoice(function=NamedFunction(name=choice.name))
    return choice


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
        prompt, aliases, tools = plan_prompt(state, as_chat_request(body))
    except APIError as error:
        raise renamed(error) from error
    aliases = {**aliases, **RESPONSES_ALIASES, "prompt": "input"}
    view = _ResponsesView(state, body, prompt, tools)
    streams = EngineStreams(state, view.id, [prompt], 0, aliases, body.model)
    return await answer(
        request, streams, view.stream, lambda finals: view.response(finals[0]), body.stream
    )


class _ResponsesView:
    def __init__(
        self, state: ServerState, body: ResponsesRequest, prompt: PromptRequest, tools: ToolCallPlan
    ):
        self.state, self.body, self.prompt, self.tools = state, body, prompt, tools
        self.id = new_id("resp")
        self.message_id = new_id("msg")
        self.call_ids: list[str] = []  # the n-th call's id, the same in every event and the end
        self.created = now_s()
        self.sequence = 0

    def response(self, final: RequestOutput | None) -> ResponseObject:
        """The response object: in progress (no output yet), or finished from ``final``."""
        body = self.body
        common = dict(
            id=self.id,
            created_at=self.created,
            model=self.state.served_name(self.body.model),
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            metadata=body.metadata,
            tools=body.tools or [],
            tool_choice=body.tool_choice or ("auto" if body.tools else "none"),
            parallel_tool_calls=body.parallel_tool_calls is not False,
        )
        if final is None:
            return ResponseObject(status="in_progress", output=[], **common)
        completion = final.outputs[0]
        cut = completion.finish_reason == "length"
        status = "incomplete" if cut else "completed"
        num_prompt, num_output = len(self.prompt.prompt_token_ids), len(completion.token_ids)
        return ResponseObject(
            status=status,
            output=self.output_items(completion.text, status),
            usage=ResponseUsage(
                input_tokens=num_prompt,
                output_tokens=num_output,
                total_tokens=num_prompt + num_output,
            ),
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut else None,
            **common,
        )

    def output_items(self, text: str, status: str) -> list[OutputMessage | OutputFunctionCall]:
        """The reply as output items: its text as a message (none when it is only calls), then
        one ``function_call`` item per call (tools.py finds them, as for chat)."""
        content, calls = self.tools.tool_calls(text)
        items: list[OutputMessage | OutputFunctionCall] = []
        if content is not None and (content or not calls):
            items.append(self.message(content, status))
        for index, call in enumerate(calls):
            items.append(self.function_call(index, call.function.name, call.function.arguments))
            items[-1].status = status
        return items

    def message(self, text: str | None, status: str) -> OutputMessage:
        content = [] if text is None else [OutputText(text=text)]
        return OutputMessage(id=self.message_id, status=status, content=content)

    def function_call(self, index: int, name: str, arguments: str) -> OutputFunctionCall:
        while len(self.call_ids) <= index:
            self.call_ids.append(new_tool_call_id())
        call_id = self.call_ids[index]
        return OutputFunctionCall(
            id="fc_" + call_id.removeprefix("call_"),
            call_id=call_id,
            name=name,
            arguments=arguments,
            status="in_progress",
        )

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def live_item(self) -> dict | None:
        """The item whose text streams as it is written: the message of a reply without tools,
        the one call of a named tool_choice. Else (tools "auto"/"required") the reply is parsed
        whole at its end, as chat does, and its items come then."""
        if not self.tools.active:
            return self.message(None, "in_progress").model_dump()
        if self.tools.mode == "named":
            return self.function_call(0, self.tools.named, "").model_dump()
        return None

    def opened(self, item: dict, index: int) -> list[str]:
        added = {**item, "status": "in_progress"}
        if item["type"] == "message":
            added["content"] = []
        events = [self.event("response.output_item.added", output_index=index, item=added)]
        if item["type"] == "message":
            part = OutputText(text="").model_dump()
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(self.event("response.content_part.added", part=part, **where))
        return events

    def delta(self, item: dict, index: int, text: str) -> str:
        if item["type"] == "message":
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            return self.event("response.output_text.delta", delta=text, logprobs=[], **where)
        return self.event(
            "response.function_call_arguments.delta",
            delta=text,
            item_id=item["id"],
            output_index=index,
        )

    def closed(self, item: dict, index: int) -> list[str]:
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            text = part["text"]
            events.append(self.event("response.output_text.done", text=text, logprobs=[], **where))
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

    async def stream(self, streams: EngineStreams) -> AsyncIterator[str]:
        started = self.response(None).model_dump()
        yield self.event("response.created", response=started)
        yield self.event("response.in_progress", response=started)
        live = self.live_item()
        for event in self.opened(live, 0) if live else []:
            yield event
        progress, final = StreamProgress(delta=streams.delta), None
        try:
            async for _, output in streams:
                delta = progress.advance(0, output.outputs[0])
                if live is not None and delta is not None and delta.text:
                    yield self.delta(live, 0, delta.text)
                final = progress.cumulative_output(output)
        except APIError as error:
            yield self.event(
                "error", code=error.code or error.type, message=error.message, param=error.param
            )
            return
        done = self.response(final).model_dump()
        for index, item in enumerate(done["output"]):
            if live is None or index > 0:
                for event in self.opened(item, index):
                    yield event
                text = (
                    item["content"][0]["text"] if item["type"] == "message" else item["arguments"]
                )
                if text:
                    yield self.delta(item, index, text)
            for event in self.closed(item, index):
                yield event
        yield self.event(f"response.{done['status']}", response=done)
