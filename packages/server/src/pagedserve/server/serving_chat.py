"""POST /v1/chat/completions: messages -> the tokenizer's chat template -> completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from pagedserve.engine import RequestOutput, apply_chat_template
from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.logprobs import TokenNamer, chat_logprobs, prompt_logprobs
from pagedserve.server.protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatMessage,
    DeltaMessage,
    TokenizeChatRequest,
    UsageInfo,
)
from pagedserve.server.request_params import build_sampling_params, check_caps
from pagedserve.server.sse import (
    SSE_DONE,
    answer,
    error_event,
    sse,
)
from pagedserve.server.state import ServerState, new_id, now_s
from pagedserve.server.streams import EngineStreams, PromptRequest, StreamProgress
from pagedserve.server.structured import structured_output_aliases, structured_outputs_of
from pagedserve.server.structured_protocol import DeltaFunctionCall, DeltaToolCall
from pagedserve.server.tools import (
    ToolCallPlan,
    conversation_with_tools,
    new_tool_call_id,
    plan_tools,
    template_supports_tools,
)
from pagedserve.server.vllm_fields import (
    default_max_tokens,
    stream_usage,
    tokens_as_token_ids,
    whole_vocabulary,
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


def template_options(body: ChatCompletionRequest | TokenizeChatRequest) -> tuple[bool, dict]:
    """``(add_generation_prompt, chat template kwargs)`` of a chat or /tokenize body.

    ``continue_final_message``: the reply continues the last (assistant) message, left open (no
    end-of-turn marker), so no generation prompt follows it unless the body asks for both, which
    vLLM refuses with the phrase kept here."""
    kwargs = dict(body.chat_template_kwargs or {})
    if not body.continue_final_message:
        return body.add_generation_prompt, kwargs
    if body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
        raise bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    if body.messages[-1].role != "assistant":
        raise bad_request(
            "continue_final_message needs an assistant message last", "continue_final_message"
        )
    kwargs["continue_final_message"] = True
    return False, kwargs


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
) -> tuple[PromptRequest, dict[str, str], ToolCallPlan]:
    """The conversation as one engine request with the request's n, and the API's names of the
    engine's fields (for the engine's refusals)."""
    check_caps(state, body)
    whole_vocabulary(body, "top_logprobs", state.engine.model_config.vocab_size)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    tools = plan_tools(body, state.config.tool_call_parser)
    constraint = structured_outputs_of(body)
    if constraint is not None and tools.constraint() is not None:
        what = "a strict tool under tool_choice auto" if tools.mode == "auto" else None
        raise bad_request(
            f"{what or 'tool_choice ' + tools.mode} constrains the reply itself: drop the "
            "output constraint",
            "tool_choice",
        )
    add_generation_prompt, kwargs = template_options(body)
    prompt_ids = chat_prompt_ids(state, body.messages, add_generation_prompt, kwargs, tools)
    if body.truncate_prompt_tokens is not None:  # vLLM's: keep the last k tokens
        prompt_ids = prompt_ids[-body.truncate_prompt_tokens :]
    max_tokens, param = max_tokens_of(body)
    was_sent = bool({"max_tokens", "max_completion_tokens"} & body.model_fields_set)
    max_model_len = state.engine.scheduler_config.max_model_len
    defaults = state.engine.model_config.generation_defaults.sampling
    max_tokens = default_max_tokens(  # generation_config's max_new_tokens, else all the room
        max_tokens, was_sent, len(prompt_ids), max_model_len, defaults.get("max_tokens")
    )
    aliases = {**CHAT_ALIASES, "max_tokens": param, **structured_output_aliases(body)}
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = build_sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=logprobs,
        aliases=aliases,
        defaults=defaults,
        prompt_logprobs=body.prompt_logprobs,
        structured_outputs=tools.constraint() or constraint,
    )
    return PromptRequest(0, prompt_ids, params), aliases, tools


async def create_chat_completion(
    request: Request, state: ServerState, body: ChatCompletionRequest
) -> Response:
    state.check_admitting()
    prompt, aliases, tools = plan_prompt(state, body)
    request_id = new_id("chatcmpl")
    streams = EngineStreams(state, request_id, [prompt], body.priority, aliases, body.model)
    view = ChatView(state, body, request_id, prompt.prompt_token_ids, tools)
    return await answer(
        request, streams, view.stream, lambda finals: view.response(finals[0]), body.stream
    )


class ChatView:
    """Turns engine outputs into OpenAI chat bodies and SSE chunks."""

    def __init__(self, state, body, request_id, prompt_token_ids: list[int], tools) -> None:
        self.state, self.body, self.id, self.tools = state, body, request_id, tools
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.created = now_s()
        self.tokenizer = state.engine.tokenizer
        self.name = TokenNamer(self.tokenizer, tokens_as_token_ids(body, state.config))
        self.include_usage, self.continuous_usage = stream_usage(body, state.config)
        self.k = body.top_logprobs or 0
        self.echo = echoed_text(body)

    def _prompt_extras(self, output: RequestOutput) -> dict:
        """vLLM's prompt fields (response level): ``prompt_logprobs``, ``prompt_token_ids``."""
        extras = {}
        if self.body.prompt_logprobs is not None:
            extras["prompt_logprobs"] = prompt_logprobs(
                self.name, output.prompt_logprobs, self.body.prompt_logprobs
            )
        if self.body.return_token_ids:
            extras["prompt_token_ids"] = self.prompt_token_ids
        return extras

    def _token_ids(self, token_ids: list[int]) -> list[int] | None:
        return token_ids if self.body.return_token_ids else None

    def usage(self, completion_tokens: int) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=self.num_prompt_tokens + completion_tokens,
        )

    def _logprobs(self, token_ids, logprobs):
        if not self.body.logprobs:
            return None
        return chat_logprobs(self.name, token_ids, logprobs, self.k)

    def response(self, final: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for completion in sorted(final.outputs, key=lambda c: c.index):
            content, calls = self.tools.tool_calls(completion.text)
            if self.echo:
                content = self.echo + (content or "")
            choices.append(
                ChatCompletionChoice(
                    index=completion.index,
                    message=AssistantMessage(content=content, tool_calls=calls),
                    logprobs=self._logprobs(completion.token_ids, completion.logprobs),
                    finish_reason=tool_calls_finish_reason(completion.finish_reason, bool(calls)),
                    stop_reason=completion.stop_reason,
                    token_ids=self._token_ids(completion.token_ids),
                )
            )
        tokens = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.state.served_name(self.body.model),
            choices=choices,
            usage=self.usage(tokens),
            **self._prompt_extras(final),
        )

    def _chunk(self, choices: list[ChatCompletionStreamChoice], usage=None, **extras) -> str:
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.state.served_name(self.body.model),
            choices=choices,
            usage=usage,
            **extras,
        )
        return sse(chunk.model_dump_json())

    def _running_usage(self, progress: StreamProgress) -> UsageInfo | None:
        return self.usage(progress.completion_tokens) if self.continuous_usage else None

    async def stream(self, streams: EngineStreams) -> AsyncIterator[str]:
        """The role chunks (the first carries the prompt's extras) when the engine's first
        output arrives, then a chunk per new delta of each choice."""
        progress = StreamProgress(delta=streams.delta)
        named_started: set[int] = set()
        started = False
        try:
            async for _, output in streams:
                if self.body.use_beam_search and not output.finished:
                    continue  # beams reorder as they go: only the final ones are text to send
                if not started:
                    started = True
                    for chunk in self._role_chunks(output, progress):
                        yield chunk
                for completion in output.outputs:
                    delta = progress.advance(completion.index, completion)
                    if delta is None:
                        continue
                    completion = progress.cumulative(completion.index, completion)
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
                        token_ids=self._token_ids(delta.token_ids),
                    )
                    yield self._chunk([choice], self._running_usage(progress))
            if self.include_usage:
                yield self._chunk([], self.usage(progress.completion_tokens))
        except APIError as error:
            yield error_event(error)
        yield SSE_DONE

    def _role_chunks(self, output: RequestOutput, progress: StreamProgress) -> list[str]:
        """The role of each choice (the first chunk carries the prompt's extras), then the
        echoed last message of each, with ``echo``."""
        chunks = []
        for index in range(self.body.n):
            role = ChatCompletionStreamChoice(
                index=index, delta=DeltaMessage(role="assistant", content="")
            )
            extras = self._prompt_extras(output) if index == 0 else {}
            chunks.append(self._chunk([role], self._running_usage(progress), **extras))
        if self.echo:
            for index in range(self.body.n):
                echoed = ChatCompletionStreamChoice(
                    index=index, delta=DeltaMessage(content=self.echo)
                )
                chunks.append(self._chunk([echoed], self._running_usage(progress)))
        return chunks


def echoed_text(body: ChatCompletionRequest) -> str:
    """What vLLM's ``echo`` puts in front of each reply: the last message's text when it is the
    assistant's own (the reply's role), as with ``continue_final_message``; else nothing."""
    last = body.messages[-1]
    return last.text() if body.echo and last.role == "assistant" else ""


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
