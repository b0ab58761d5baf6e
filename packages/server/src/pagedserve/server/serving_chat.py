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

# The engine's names -> the chat API's, so a 400 names the field the client sent.
CHAT_ALIASES = {"logprobs": "top_logprobs", "prompt": "messages"}


def chat_prompt_ids(
    state: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Prompt token ids through the model's own chat template; template errors are 400s."""
    conversation = []
    for message in messages:
        entry = {"role": message.role, "content": message.text()}
        if message.name:
            entry["name"] = message.name
        conversation.append(entry)
    try:
        return apply_chat_template(
            state.engine.tokenizer, conversation, add_generation_prompt, **(template_kwargs or {})
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
    if body.tools:
        raise bad_request("tools are not supported", "tools")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    prompt_ids = chat_prompt_ids(
        state, body.messages, body.add_generation_prompt, body.chat_template_kwargs
    )
    max_tokens, param = max_tokens_of(body)
    aliases = {**CHAT_ALIASES, "max_tokens": param}
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = build_sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=logprobs,
        aliases=aliases,
        defaults=state.engine.model_config.generation_defaults.sampling,
    )
    return PromptRequest(0, prompt_ids, params), aliases


async def create_chat_completion(
    request: Request, state: ServerState, body: ChatCompletionRequest
) -> Response:
    state.check_admitting()
    prompt, aliases = plan_prompt(state, body)
    request_id = new_id("chatcmpl")
    streams = EngineStreams(state, request_id, [prompt], body.priority, aliases)
    view = _ChatView(state, body, request_id, len(prompt.prompt_token_ids))
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

    def __init__(self, state, body, request_id, num_prompt_tokens: int) -> None:
        self.state, self.body, self.id = state, body, request_id
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
        choices = [
            ChatCompletionChoice(
                index=completion.index,
                message=AssistantMessage(content=completion.text),
                logprobs=self._logprobs(completion.token_ids, completion.logprobs),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
            for completion in sorted(final.outputs, key=lambda c: c.index)
        ]
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
        try:
            for index in range(self.body.n):
                role = DeltaMessage(role="assistant", content="")
                yield self._chunk([ChatCompletionStreamChoice(index=index, delta=role)])
            async for _, output in streams:
                for completion in output.outputs:
                    delta = progress.advance(completion.index, completion)
                    if delta is None:
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
