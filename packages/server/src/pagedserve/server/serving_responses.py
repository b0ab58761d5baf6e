"""POST /v1/responses: OpenAI's Responses API over the chat path; GET and DELETE of stored ones.

The input (a string, or items) and ``instructions`` (a system message first) become a chat
conversation (an ``input_image`` part is chat's ``image_url`` part); planning, the chat template, the caps and the engine are the chat route's. The
reply comes back as output items (responses_output.py): its thinking as a ``reasoning`` item
(with ``--reasoning-parser``), its text as a message with one ``output_text`` part, its tool
calls as ``function_call`` items. A response cut by ``max_output_tokens`` is ``incomplete``.
Streamed, it is OpenAI's typed events, each an SSE ``event:`` line and its JSON: response.created,
response.in_progress, each item's events as the reply writes it, then response.completed (or
.incomplete).

Function tools are the chat route's (tools.py): the flat Responses tools and tool_choice become
chat's, ``function_call`` / ``function_call_output`` input items become assistant tool_calls and
``tool`` messages.

Stored responses (responses_store.py): unless ``store`` is false, a finished response is kept
with its conversation (the input, without ``instructions``, then the output as chat messages).
``previous_response_id`` puts that conversation before the new input, so a follow-up sends only
its new turn; its prompt then starts with the whole earlier prompt and reply, whose KV blocks the
prefix cache still holds, so only the new turn is computed (``pagedserve:prefix_cache_hits``
counts them). ``instructions`` are not carried over, as in OpenAI's API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.engine import RequestOutput
from pagedserve.server.chat_prompt import plan_prompt
from pagedserve.server.errors import APIError, bad_request, from_validation_error
from pagedserve.server.field_coverage import refuse_unsupported
from pagedserve.server.media import check_detail
from pagedserve.server.protocol import ChatCompletionRequest, ChatMessage
from pagedserve.server.protocol_content import ImageURL, ImageURLContentPart, TextContentPart
from pagedserve.server.protocol_responses import (
    FunctionCallInput,
    FunctionCallOutputInput,
    FunctionToolChoice,
    IncompleteDetails,
    InputImagePart,
    InputMessage,
    InputTokensDetails,
    OutputTokensDetails,
    ReasoningInput,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from pagedserve.server.reply import ReplyPlan
from pagedserve.server.responses_output import OutputItems
from pagedserve.server.responses_store import StoredResponse
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

# The chat route's names -> the Responses API's, so that a 400 names the field sent.
RESPONSES_ALIASES = {"max_tokens": "max_output_tokens", "messages": "input"}


def input_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """The request's own input as chat messages (no instructions, no earlier conversation)."""
    if isinstance(body.input, str):
        return [ChatMessage(role="user", content=body.input)]
    return chat_messages(body.input)


def as_chat_request(
    body: ResponsesRequest, history: list[ChatMessage] | None = None
) -> ChatCompletionRequest:
    """The same conversation as a chat request: ``instructions`` as the system message, the
    stored ``history`` of ``previous_response_id``, then the input."""
    messages = []
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
    messages += [*(history or []), *input_messages(body)]
    if not any(m.role != "system" for m in messages):
        raise bad_request("input holds no message to answer", "input")
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
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
    }
    sent = {
        k: v for k, v in fields.items() if k in ("model", "messages", "stream") or v is not None
    }
    try:
        return ChatCompletionRequest(**sent)
    except ValidationError as error:  # what the input holds that chat cannot take
        raise from_validation_error(error) from error


def chat_messages(items: list) -> list[ChatMessage]:
    """Input items as chat messages: ``function_call`` items join the assistant turn before
    them (its text, or the calls before them: one turn's ``tool_calls``), a
    ``function_call_output`` is a ``tool`` message, a ``reasoning`` item's text is the thinking
    of the assistant turn after it."""
    messages: list[ChatMessage] = []
    thinking: str | None = None
    for index, item in enumerate(items):
        if isinstance(item, ReasoningInput):
            if item.encrypted_content:
                raise bad_request(
                    "encrypted reasoning is another service's: send its text, or leave it out",
                    f"input.{index}.encrypted_content",
                )
            thinking = (thinking or "") + item.text()
            continue
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
            messages.append(chat_message(item, index))
        if thinking is not None and messages[-1].role == "assistant":
            messages[-1].reasoning_content, thinking = thinking, None
    return messages


def chat_message(item: InputMessage, index: int) -> ChatMessage:
    """Input message ``index`` as a chat message: its text parts joined (as chat joins them),
    or, when it holds images, chat's text and ``image_url`` parts in the same order, so that
    a 400 about part ``j`` names ``input.<index>.content.<j>``."""
    if isinstance(item.content, str) or not any(
        isinstance(part, InputImagePart) for part in item.content
    ):
        return ChatMessage(role=item.role, content=item.text())
    parts: list[TextContentPart | ImageURLContentPart] = []
    for j, part in enumerate(item.content):
        if not isinstance(part, InputImagePart):
            parts.append(TextContentPart(type="text", text=part.text))
            continue
        where = f"input.{index}.content.{j}"
        if part.file_id is not None:
            raise bad_request(
                f"{where}.file_id: images are read from image_url (a data: URL), not from files",
                f"{where}.file_id",
            )
        if part.image_url is None:
            raise bad_request(f"{where}: an input_image needs an image_url", where)
        check_detail(part.detail, f"{where}.detail")
        url = ImageURL(url=part.image_url, detail=part.detail)
        parts.append(ImageURLContentPart(type="image_url", image_url=url))
    return ChatMessage(role=item.role, content=parts).sent_as(f"input.{index}")


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


def will_store(state: ServerState, body: ResponsesRequest) -> bool:
    """``store`` defaults to true where the server has a store (false where it has none)."""
    if body.store and state.responses_store is None:
        raise bad_request("store: this server keeps no responses (--responses-store off)", "store")
    return body.store is not False and state.responses_store is not None


async def history_of(state: ServerState, body: ResponsesRequest) -> list[ChatMessage]:
    """The conversation ``previous_response_id`` ends (a 404 when no stored response has it)."""
    if body.previous_response_id is None:
        return []
    stored = await stored_response(state, body.previous_response_id, "previous_response_id")
    return [ChatMessage.model_validate(message) for message in stored.conversation]


async def stored_response(state: ServerState, response_id: str, param: str | None = None):
    store = state.responses_store
    stored = None if store is None else await store.get(response_id)
    if stored is None:
        raise APIError(f"Response with id {response_id!r} not found.", 404, param=param)
    return stored


async def create_response(request: Request, state: ServerState, body: ResponsesRequest):
    state.check_admitting()
    refuse_unsupported(body)
    store = will_store(state, body)
    history = await history_of(state, body)
    try:
        prompt, aliases, plan = await plan_prompt(state, as_chat_request(body, history))
    except APIError as error:
        raise renamed(error) from error
    aliases = {**aliases, **RESPONSES_ALIASES, "prompt": "input", "multi_modal_data": "input"}
    view = _ResponsesView(state, body, prompt, plan, [*history, *input_messages(body)], store)
    streams = EngineStreams(state, view.id, [prompt], 0, aliases, body.model)
    return await answer(request, streams, view.stream, view.final_response, body.stream)


async def retrieve_response(request: Request, state: ServerState) -> Response:
    stored = await stored_response(state, request.path_params["response_id"])
    return JSONResponse(stored.response)


async def delete_response(request: Request, state: ServerState) -> Response:
    response_id = request.path_params["response_id"]
    store = state.responses_store
    if store is None or not await store.delete(response_id):
        raise APIError(f"Response with id {response_id!r} not found.", 404)
    return JSONResponse(ResponseDeleted(id=response_id).model_dump())


class _ResponsesView:
    def __init__(
        self,
        state: ServerState,
        body: ResponsesRequest,
        prompt: PromptRequest,
        plan: ReplyPlan,
        conversation: list[ChatMessage],
        store: bool,
    ):
        self.state, self.body, self.prompt, self.plan = state, body, prompt, plan
        self.conversation, self.store = conversation, store
        self.id = new_id("resp")
        self.created = now_s()
        self.output = OutputItems()

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
            previous_response_id=body.previous_response_id,
            store=self.store,
            tools=body.tools or [],
            tool_choice=body.tool_choice or ("auto" if body.tools else "none"),
            parallel_tool_calls=body.parallel_tool_calls is not False,
        )
        if final is None:
            return ResponseObject(status="in_progress", output=[], **common)
        completion = final.outputs[0]
        cut = completion.finish_reason == "length"
        # the prompt as the engine ran it: an image's placeholders expanded to its rows
        num_prompt = len(final.prompt_token_ids or self.prompt.prompt_token_ids)
        num_output = len(completion.token_ids)
        thinking = self.plan.reasoning_tokens(
            completion.token_ids, self.state.engine.tokenizer.decode
        )
        return ResponseObject(
            status="incomplete" if cut else "completed",
            output=self.output.items,
            usage=ResponseUsage(
                input_tokens=num_prompt,
                output_tokens=num_output,
                total_tokens=num_prompt + num_output,
                input_tokens_details=InputTokensDetails(cached_tokens=final.num_cached_tokens or 0),
                output_tokens_details=OutputTokensDetails(reasoning_tokens=thinking),
            ),
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut else None,
            **common,
        )

    def _read(self, reader, text: str, final: RequestOutput | None) -> list[str]:
        """The events of the reply's next ``text`` (with ``final``, its end and closing)."""
        delta = reader.feed(text)
        if final is not None:
            delta += reader.finish()
        delta.reasoning = self.plan.shown_reasoning(delta.reasoning)
        events = self.output.feed(delta)
        if final is not None:
            cut = final.outputs[0].finish_reason == "length"
            events += self.output.close("incomplete" if cut else "completed")
        return events

    async def final_response(self, finals: dict[int, RequestOutput]) -> ResponseObject:
        final = finals[0]
        self._read(self.plan.reader(), final.outputs[0].text, final)
        return await self._stored(self.response(final))

    async def _stored(self, response: ResponseObject) -> ResponseObject:
        if self.store:
            conversation = [*self.conversation, *chat_messages_of(self.output.items)]
            dumped = [m.model_dump(exclude_none=True) for m in conversation]
            stored = StoredResponse(response.model_dump(), dumped)
            await self.state.responses_store.put(response.id, stored)
        return response

    async def stream(self, streams: EngineStreams) -> AsyncIterator[str]:
        events = self.output
        started = self.response(None).model_dump()
        yield events.event("response.created", response=started)
        yield events.event("response.in_progress", response=started)
        progress, reader, final = StreamProgress(delta=streams.delta), self.plan.reader(), None
        try:
            async for _, output in streams:
                delta = progress.advance(0, output.outputs[0])
                final = progress.cumulative_output(output) if output.finished else None
                if delta is not None:
                    for event in self._read(reader, delta.text, final):
                        yield event
        except APIError as error:
            yield events.event(
                "error", code=error.code or error.type, message=error.message, param=error.param
            )
            return
        done = (await self._stored(self.response(final))).model_dump()
        yield events.event(f"response.{done['status']}", response=done)


def chat_messages_of(items: list[dict[str, Any]]) -> list[ChatMessage]:
    """A response's output items as the assistant turn they are in chat (for the store)."""
    message = ChatMessage(role="assistant", content=None)
    for item in items:
        if item["type"] == "reasoning":
            message.reasoning_content = item["content"][0]["text"]
        elif item["type"] == "message":
            message.content = item["content"][0]["text"]
        else:
            call = ToolCall(
                id=item["call_id"],
                function=FunctionCall(name=item["name"], arguments=item["arguments"]),
            )
            message.tool_calls = [*(message.tool_calls or []), call]
    return [message]
