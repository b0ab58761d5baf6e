"""POST /v1/chat/completions: messages -> the tokenizer's chat template -> completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.engine import RequestOutput, apply_chat_template
from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.logprobs import chat_logprobs
from pagedserve.server.protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
)
from pagedserve.server.request_params import build_sampling_params, check_caps
from pagedserve.server.sse import (
    SSE_DONE,
    ClientDisconnected,
    EngineStreamingResponse,
    error_event,
    sse,
    unless_disconnected,
)
from pagedserve.server.state import ServerState, new_id, now_s
from pagedserve.server.streams import EngineStreams, PromptRequest, StreamProgress, final_outputs
from pagedserve.server.structured import structured_output_aliases, structured_outputs_of
from pagedserve.server.structured_protocol import DeltaFunctionCall, DeltaToolCall
from pagedserve.server.tools import (
    ToolCallPlan,
    conversation_with_tools,
    new_tool_call_id,
    plan_tools,
    template_supports_tools,
)

# The engine's names -> the chat API's, so a 400 names the field the client sent.
CHAT_ALIASES = {"logprobs": "top_logprobs", "prompt": "messages"}


def chat_prompt_ids(
    state: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    template_kwargs: dict | None = None,
    tools: ToolCallPlan | None = None,
) -> list[int]:
    """Prompt token ids through the chat template (the model's, or ``--chat-template``), the
    tools rendered (tools.py); template errors are 400s."""
    conversation = []
    for message in messages:
        entry = {"role": message.role, "content": message.text()}
        for key in ("name", "tool_call_id"):
            if getattr(message, key):
                entry[key] = getattr(message, key)
        if message.tool_calls:
            entry["tool_calls"] = [c.model_dump() for c in message.tool_calls]
        conversation.append(entry)
    template = state.config.chat_template
    kwargs = dict(template_kwargs or {})
    if template:
        kwargs["chat_template"] = template
    if tools is not None:
        native = template_supports_tools(state.engine.tokenizer, template)
        conversation, extra = conversation_with_tools(conversation, tools, native)
        kwargs.update(extra)
    try:
        return apply_chat_template(
            state.engine.tokenizer, conversation, add_generation_prompt, **kwargs
        )
    except ValueError as e:
        raise bad_request(str(e), "messages") from e
    except Exception as e:  # jinja2's TemplateError (raise_exception in a template), TypeError
        raise bad_request(f"the chat template rejected the messages: {e}", "messages") from e


def max_tokens_of(body: ChatCompletionRequest) -> tuple[int | None, str]:
    """``max_completion_tokens`` (OpenAI's new name) or ``max_tokens``, and which was used."""
    new, old = body.max_completion_tokens, body.max_tokens
    if new is not None and old is not None and new != old:
        raise bad_request(
            "max_tokens and max_completion_tokens disagree; give one of them",
            "max_completion_tokens",
        )
    return (new, "max_completion_tokens") if new is not None else (old, "max_tokens")


def plan_prompt(
    state: ServerState, body: ChatCompletionRequest
) -> tuple[PromptRequest, dict[str, str]]:
    """The conversation as one engine request with the request's n, and the API's names of the
    engine's fields (for the engine's refusals)."""
    check_caps(state, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    tools = plan_tools(body, state.config.tool_call_parser)
    constraint = structured_outputs_of(body)
    if constraint is not None and tools.constraint() is not None:
        raise bad_request(
            f"tool_choice {tools.mode} constrains the reply itself: drop the output constraint",
            "tool_choice",
        )
    add_generation_prompt = body.add_generation_prompt
    kwargs = dict(body.chat_template_kwargs or {})
    if body.continue_final_message:  # the reply continues the last (assistant) message
        if body.messages[-1].role != "assistant":
            raise bad_request(
                "continue_final_message needs an assistant message last", "continue_final_message"
            )
        add_generation_prompt, kwargs["continue_final_message"] = False, True
    prompt_ids = chat_prompt_ids(state, body.messages, add_generation_prompt, kwargs, tools)
    if body.truncate_prompt_tokens is not None:  # vLLM's: keep the last k tokens
        prompt_ids = prompt_ids[-body.truncate_prompt_tokens :]
    max_tokens, param = max_tokens_of(body)
    aliases = {**CHAT_ALIASES, "max_tokens": param, **structured_output_aliases(body)}
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = build_sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=logprobs,
        aliases=aliases,
        structured_outputs=tools.constraint() or constraint,
    )
    return PromptRequest(0, prompt_ids, params), aliases, tools


async def create_chat_completion(
    request: Request, state: ServerState, body: ChatCompletionRequest
) -> Response:
    state.check_admitting()
    prompt, aliases, tools = plan_prompt(state, body)
    request_id = new_id("chatcmpl")
    streams = EngineStreams(state, request_id, [prompt], body.priority, aliases)
    view = _ChatView(state, body, request_id, len(prompt.prompt_token_ids), tools)
    try:
        await unless_disconnected(request, streams.admitted())
        if body.stream:
            return EngineStreamingResponse(view.stream(streams), streams)
        finals = await unless_disconnected(request, final_outputs(streams))
    except ClientDisconnected:
        streams.cancel()
        return Response(status_code=499)
    return JSONResponse(view.response(finals[0]).model_dump())


class _ChatView:
    """Turns engine outputs into OpenAI chat bodies and SSE chunks."""

    def __init__(self, state, body, request_id, num_prompt_tokens: int, tools) -> None:
        self.state, self.body, self.id, self.tools = state, body, request_id, tools
        self.num_prompt_tokens = num_prompt_tokens
        self.created = now_s()
        self.tokenizer = state.engine.tokenizer
        self.k = body.top_logprobs or 0

    def usage(self, completion_tokens: int) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=self.num_prompt_tokens + completion_tokens,
        )

    def _logprobs(self, token_ids, logprobs):
        if not self.body.logprobs:
            return None
        return chat_logprobs(self.tokenizer, token_ids, logprobs, self.k)

    def response(self, final: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for completion in sorted(final.outputs, key=lambda c: c.index):
            content, calls = self.tools.tool_calls(completion.text)
            choices.append(
                ChatCompletionChoice(
                    index=completion.index,
                    message=AssistantMessage(content=content, tool_calls=calls),
                    logprobs=self._logprobs(completion.token_ids, completion.logprobs),
                    finish_reason=tool_calls_finish_reason(completion.finish_reason, bool(calls)),
                    stop_reason=completion.stop_reason,
                )
            )
        tokens = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.state.model_name,
            choices=choices,
            usage=self.usage(tokens),
        )

    def _chunk(self, choices: list[ChatCompletionStreamChoice], usage=None) -> str:
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.state.model_name,
            choices=choices,
            usage=usage,
        )
        return sse(chunk.model_dump_json())

    async def stream(self, streams: EngineStreams) -> AsyncIterator[str]:
        progress = StreamProgress()
        named_started: set[int] = set()
        try:
            for index in range(self.body.n):
                role = DeltaMessage(role="assistant", content="")
                yield self._chunk([ChatCompletionStreamChoice(index=index, delta=role)])
            async for _, output in streams:
                for completion in output.outputs:
                    delta = progress.advance(completion.index, completion)
                    if delta is None:
                        continue
                    if self.tools.mode == "named":  # the arguments stream as they are written
                        first = completion.index not in named_started
                        named_started.add(completion.index)
                        yield self._chunk([named_call_choice(self.tools, completion, delta, first)])
                        continue
                    if self.tools.active:  # the reply is parsed whole, at its end
                        if completion.finish_reason is not None:
                            yield self._chunk([tool_call_choice(self.tools, completion)])
                        continue
                    choice = ChatCompletionStreamChoice(
                        index=completion.index,
                        delta=DeltaMessage(content=delta.text) if delta.text else DeltaMessage(),
                        logprobs=self._logprobs(delta.token_ids, delta.logprobs),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                    yield self._chunk([choice])
            if self.body.include_usage_in_stream:
                yield self._chunk([], self.usage(progress.completion_tokens))
        except APIError as error:
            yield error_event(error)
        yield SSE_DONE


def named_call_choice(tools: ToolCallPlan, completion, delta, first: bool):
    """A chunk of a named tool call, as OpenAI streams one: the first carries the call's id and
    name, every chunk the arguments' new text."""
    call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta.text))
    if first:
        call.id, call.type, call.function.name = new_tool_call_id(), "function", tools.named
    return ChatCompletionStreamChoice(
        index=completion.index,
        delta=DeltaMessage(tool_calls=[call]),
        finish_reason=tool_calls_finish_reason(completion.finish_reason, True),
        stop_reason=completion.stop_reason,
    )


def tool_call_choice(tools: ToolCallPlan, completion) -> ChatCompletionStreamChoice:
    """The last chunk of a choice whose reply is read for tool calls: its content, or one
    ``tool_calls`` delta per call (id, name and the whole arguments)."""
    content, calls = tools.tool_calls(completion.text)
    deltas = [
        DeltaToolCall(
            index=i,
            id=call.id,
            type="function",
            function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
        )
        for i, call in enumerate(calls)
    ]
    return ChatCompletionStreamChoice(
        index=completion.index,
        delta=DeltaMessage(content=content, tool_calls=deltas or None),
        finish_reason=tool_calls_finish_reason(completion.finish_reason, bool(calls)),
        stop_reason=completion.stop_reason,
    )


def tool_calls_finish_reason(finish_reason: str | None, has_calls: bool) -> str | None:
    """ "tool_calls" for a reply that ended (not cut by max_tokens) with calls in it."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason
