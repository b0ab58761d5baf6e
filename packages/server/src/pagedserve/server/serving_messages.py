"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

A Messages request becomes the chat request it means (``as_chat_request``): ``system`` first,
each message's text blocks joined, ``tool_use`` blocks as the assistant turn's ``tool_calls``,
``tool_result`` blocks as ``tool`` messages (before the user's text, as Anthropic orders them),
``thinking`` blocks as the assistant turn's thinking for a template that shows it; a last
``assistant`` message is a prefill, which the reply continues. ``tools`` and ``tool_choice``
("auto", "any" = required, "tool" = a named function, "none") are the chat route's tools;
``thinking`` ``enabled``/``disabled`` sets the template's ``enable_thinking`` (a
``budget_tokens`` below ``max_tokens`` waits for the engine: field_coverage.py), ``display:
"omitted"`` drops the thinking from the reply. From there, planning, the chat template, the caps
and the engine are the chat route's.

The reply comes back as content blocks: its thinking (with ``--reasoning-parser``) as a
``thinking`` block, its text as a ``text`` block, each tool call as a ``tool_use`` block, in the
order the reply writes them; ``stop_reason`` is ``end_turn``, ``max_tokens``, ``stop_sequence``
(with the ``stop_sequence`` matched) or ``tool_use``. Streamed, it is Anthropic's events:
``message_start``, per block ``content_block_start``, its deltas (``thinking_delta``,
``text_delta``, ``input_json_delta``) and ``content_block_stop``, then ``message_delta`` (the
stop reason and the output tokens) and ``message_stop``. Errors take Anthropic's shape
(errors.py), a failure mid-stream an ``error`` event.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.engine import RequestOutput
from pagedserve.server.chat_prompt import (
    chat_prompt_ids,
    plan_prompt,
    template_kwargs_of,
    template_options,
)
from pagedserve.server.errors import APIError, bad_request, from_validation_error
from pagedserve.server.field_coverage import refuse_unsupported
from pagedserve.server.protocol import ChatCompletionRequest, ChatMessage
from pagedserve.server.protocol_messages import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    MessagesUsage,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from pagedserve.server.reply import ReplyDelta, ReplyPlan
from pagedserve.server.request_params import check_model
from pagedserve.server.sse import answer
from pagedserve.server.state import ServerState, new_id
from pagedserve.server.streams import EngineStreams, PromptRequest, StreamProgress
from pagedserve.server.structured_protocol import (
    ChatCompletionTool,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
)
from pagedserve.server.tools import plan_tools, resolve_tool_parser

# The chat route's names -> the Messages API's, so that a 400 names the field sent.
MESSAGES_ALIASES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}


def chat_messages(body: CountTokensRequest) -> list[ChatMessage]:
    """``system`` and the messages as the chat conversation (see the module docstring)."""
    messages = []
    if body.system:
        system = body.system
        text = system if isinstance(system, str) else "".join(b.text for b in system)
        messages.append(ChatMessage(role="system", content=text))
    for i, message in enumerate(body.messages):
        blocks = message.content
        if isinstance(blocks, str):
            messages.append(ChatMessage(role=message.role, content=blocks))
            continue
        texts, calls, results, thinking = [], [], [], []
        for j, block in enumerate(blocks):
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock) and message.role == "assistant":
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(
                    ToolCall(
                        id=block.id, function=FunctionCall(name=block.name, arguments=arguments)
                    )
                )
            elif isinstance(block, ToolResultBlock) and message.role == "user":
                text = block.text()
                results.append(
                    ChatMessage(
                        role="tool",
                        tool_call_id=block.tool_use_id,
                        content=f"Error: {text}" if block.is_error else text,
                    )
                )
            elif isinstance(block, ThinkingBlock) and message.role == "assistant":
                thinking.append(block.thinking)
            else:
                raise bad_request(
                    f"messages.{i}.content.{j}: a {block.type} block is not served in a "
                    f"{message.role} message (pagedserve reads text, tool_use, tool_result and "
                    "thinking blocks)",
                    f"messages.{i}.content.{j}",
                )
        messages += results
        if texts or calls or not results:
            turn = ChatMessage(role=message.role, content="".join(texts), tool_calls=calls or None)
            turn.reasoning_content = "".join(thinking) or None
            messages.append(turn)
    return messages


def chat_tools(body: CountTokensRequest) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as the chat request's fields."""
    fields: dict[str, Any] = {}
    if body.tools:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.type not in (None, "custom"):
                raise bad_request(
                    f"tools.{i} is a {tool.type} server tool; pagedserve serves client tools "
                    "(name, description, input_schema)",
                    f"tools.{i}",
                )
            function = FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.input_schema
            )
            tools.append(ChatCompletionTool(function=function))
        fields["tools"] = tools
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type tool needs a name", "tool_choice.name")
            fields["tool_choice"] = NamedToolChoice(function=NamedFunction(name=choice.name))
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def thinking_kwargs(body: CountTokensRequest) -> dict[str, Any]:
    """What ``thinking`` means for the chat template (and the reply, for ``display``)."""
    thinking = body.thinking
    if thinking is None or thinking.type in ("adaptive", "between_tools"):
        return {}  # the model's own default
    return {"enable_thinking": thinking.type == "enabled"}


def as_chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    messages = chat_messages(body)
    fields: dict[str, Any] = {"model": body.model, "messages": messages, **chat_tools(body)}
    fields["chat_template_kwargs"] = thinking_kwargs(body)
    if body.thinking is not None and body.thinking.display == "omitted":
        fields["include_reasoning"] = False
    if body.thinking is not None and body.thinking.type == "enabled":
        fields["thinking_token_budget"] = body.thinking.budget_tokens
    if messages[-1].role == "assistant":  # a prefill: the reply continues it
        fields.update(add_generation_prompt=False, continue_final_message=True)
    if isinstance(body, MessagesRequest):
        fields.update(
            max_tokens=body.max_tokens,
            stop=body.stop_sequences,
            stream=body.stream,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
        )
        config = body.output_config
        if config is not None and config.effort is not None:
            fields["reasoning_effort"] = config.effort
        if config is not None and config.format is not None:
            schema = {"name": "output", "schema": config.format.json_schema}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    try:
        return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as error:  # what the messages hold that chat cannot take
        raise from_validation_error(error) from error


def renamed(error: APIError) -> APIError:
    if error.param in MESSAGES_ALIASES:
        new = MESSAGES_ALIASES[error.param]
        error.message = error.message.replace(error.param, new, 1)
        error.param = new
    return error


async def create_message(request: Request, state: ServerState, body: MessagesRequest) -> Response:
    state.check_admitting()
    refuse_unsupported(body)
    try:
        prompt, aliases, plan = await plan_prompt(state, as_chat_request(body))
    except APIError as error:
        raise renamed(error) from error
    aliases = {**aliases, **MESSAGES_ALIASES, "max_tokens": "max_tokens", "prompt": "messages"}
    view = _MessagesView(state, body, prompt, plan)
    streams = EngineStreams(state, view.id, [prompt], 0, aliases, body.model)
    return await answer(request, streams, view.stream, view.response, body.stream)


async def count_tokens(request: Request, state: ServerState, body: CountTokensRequest) -> Response:
    """The prompt's tokens, rendered as /v1/messages would render it (tools included)."""
    check_model(state, body.model)
    chat = as_chat_request(body)
    template = state.config.chat_template
    parser = resolve_tool_parser(state.config.tool_call_parser, state.engine.tokenizer, template)
    tools = plan_tools(chat, parser)
    add_generation_prompt, kwargs = template_options(chat, template_kwargs_of(chat))
    ids = await chat_prompt_ids(state, chat.messages, add_generation_prompt, kwargs, tools)
    return JSONResponse(CountTokensResponse(input_tokens=len(ids)).model_dump())


class _MessagesView:
    def __init__(
        self, state: ServerState, body: MessagesRequest, prompt: PromptRequest, plan: ReplyPlan
    ) -> None:
        self.state, self.body, self.prompt, self.plan = state, body, prompt, plan
        self.id = new_id("msg")
        self.blocks = ContentBlocks()

    def _message(self, stop_reason=None, stop_sequence=None, output_tokens=0, cached=0):
        return MessageResponse(
            id=self.id,
            content=self.blocks.content(),
            model=self.state.served_name(self.body.model),
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=MessagesUsage(
                input_tokens=len(self.prompt.prompt_token_ids),
                output_tokens=output_tokens,
                cache_read_input_tokens=cached,
            ),
        )

    def _read(self, reader, text: str, finished: bool) -> list[str]:
        delta = reader.feed(text)
        if finished:
            delta += reader.finish()
        delta.reasoning = self.plan.shown_reasoning(delta.reasoning)
        events = self.blocks.feed(delta)
        return events + (self.blocks.close() if finished else [])

    def _stop(self, completion) -> tuple[str | None, str | None]:
        """Anthropic's ``stop_reason`` and ``stop_sequence`` for the finished completion."""
        if completion.finish_reason == "length":
            return "max_tokens", None
        if self.blocks.num_calls or self.plan.tools.mode == "named":
            return "tool_use", None
        if isinstance(completion.stop_reason, str):
            return "stop_sequence", completion.stop_reason
        return "end_turn", None

    def response(self, finals: dict[int, RequestOutput]) -> MessageResponse:
        final = finals[0]
        completion = final.outputs[0]
        self._read(self.plan.reader(), completion.text, finished=True)
        reason, sequence = self._stop(completion)
        return self._message(reason, sequence, len(completion.token_ids), final.num_cached_tokens)

    async def stream(self, streams: EngineStreams) -> AsyncIterator[str]:
        blocks = self.blocks
        yield blocks.event("message_start", message=self._message().model_dump())
        progress, reader = StreamProgress(delta=streams.delta), self.plan.reader()
        completion = None
        try:
            async for _, output in streams:
                delta = progress.advance(0, output.outputs[0])
                if delta is None:
                    continue
                completion = progress.cumulative(0, output.outputs[0])
                for event in self._read(reader, delta.text, delta.finished):
                    yield event
        except APIError as error:
            yield blocks.event("error", error=error.anthropic_body()["error"])
            return
        reason, sequence = self._stop(completion)
        stop = {"stop_reason": reason, "stop_sequence": sequence}
        usage = {"output_tokens": len(completion.token_ids)}
        yield blocks.event("message_delta", delta=stop, usage=usage)
        yield blocks.event("message_stop")


class ContentBlocks:
    """A reply's content blocks, built from its deltas, with Anthropic's stream events."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # the reply's call index -> its block

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    @staticmethod
    def event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    def feed(self, delta: ReplyDelta) -> list[str]:
        events: list[str] = []
        if delta.reasoning:
            events += self._text("thinking", delta.reasoning)
        if delta.content:
            events += self._text("text", delta.content)
        for call in delta.calls:
            if call.name is not None:
                block = {"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}"}
                block.update(name=call.name, input={}, arguments="")
                self._calls[call.index] = block
                events += self._opened(block)
            block = self._calls[call.index]
            if call.arguments:
                block["arguments"] += call.arguments
                json_delta = {"type": "input_json_delta", "partial_json": call.arguments}
                events.append(self._delta(block, json_delta))
        return events

    def close(self) -> list[str]:
        return self._closed()

    def content(self) -> list[dict[str, Any]]:
        """The blocks as Anthropic returns them: a call's input as the object its arguments
        are (arguments cut short by max_tokens stay text, as written)."""
        content = []
        for block in self.blocks:
            if block["type"] != "tool_use":
                content.append(block)
                continue
            try:
                arguments = json.loads(block["arguments"] or "{}")
            except json.JSONDecodeError:
                arguments = None
            if isinstance(arguments, dict):
                content.append(
                    {k: v for k, v in block.items() if k != "arguments"} | {"input": arguments}
                )
            else:
                content.append({"type": "text", "text": block["arguments"]})
        return content

    def _text(self, kind: str, text: str) -> list[str]:
        field = "thinking" if kind == "thinking" else "text"
        events = []
        if self._open is None or self._open["type"] != kind:
            block = {"type": kind, field: ""}
            if kind == "thinking":
                block["signature"] = ""  # pagedserve's thinking is not signed
            events += self._opened(block)
        assert self._open is not None
        self._open[field] += text
        events.append(self._delta(self._open, {"type": f"{field}_delta", field: text}))
        return events

    def _opened(self, block: dict[str, Any]) -> list[str]:
        events = self._closed()
        self.blocks.append(block)
        self._open = block
        shown = {k: v for k, v in block.items() if k != "arguments"}
        events.append(
            self.event("content_block_start", index=len(self.blocks) - 1, content_block=shown)
        )
        return events

    def _closed(self) -> list[str]:
        block, self._open = self._open, None
        if block is None:
            return []
        return [self.event("content_block_stop", index=self.blocks.index(block))]

    def _delta(self, block: dict[str, Any], delta: dict[str, Any]) -> str:
        return self.event("content_block_delta", index=self.blocks.index(block), delta=delta)
