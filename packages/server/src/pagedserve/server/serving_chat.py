"""POST /v1/chat/completions: messages -> the tokenizer's chat template -> completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

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
from pagedserve.server.vllm_fields import default_max_tokens

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
    was_sent = bool({"max_tokens", "max_completion_tokens"} & body.model_fields_set)
    max_model_len = state.engine.scheduler_config.max_model_len
    max_tokens = default_max_tokens(max_tokens, was_sent, len(prompt_ids), max_model_len, None)
    aliases = {**CHAT_ALIASES, "max_tokens": param}
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = build_sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=logprobs,
        aliases=aliases,
        prompt_logprobs=body.prompt_logprobs,
    )
    return PromptRequest(0, prompt_ids, params), aliases


async def create_chat_completion(
    request: Request, state: ServerState, body: ChatCompletionRequest
) -> Response:
    state.check_admitting()
    prompt, aliases = plan_prompt(state, body)
    request_id = new_id("chatcmpl")
    streams = EngineStreams(state, request_id, [prompt], body.priority, aliases)
    view = _ChatView(state, body, request_id, prompt.prompt_token_ids)
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

    def __init__(self, state, body, request_id, prompt_token_ids: list[int]) -> None:
        self.state, self.body, self.id = state, body, request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.created = now_s()
        self.tokenizer = state.engine.tokenizer
        self.name = TokenNamer(self.tokenizer, body.return_tokens_as_token_ids)
        self.k = body.top_logprobs or 0

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
        choices = [
            ChatCompletionChoice(
                index=completion.index,
                message=AssistantMessage(content=completion.text),
                logprobs=self._logprobs(completion.token_ids, completion.logprobs),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
                token_ids=self._token_ids(completion.token_ids),
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
            **self._prompt_extras(final),
        )

    def _chunk(self, choices: list[ChatCompletionStreamChoice], usage=None, **extras) -> str:
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.state.model_name,
            choices=choices,
            usage=usage,
            **extras,
        )
        return sse(chunk.model_dump_json())

    def _running_usage(self, progress: StreamProgress) -> UsageInfo | None:
        return self.usage(progress.completion_tokens) if self.body.continuous_usage else None

    async def stream(self, streams: EngineStreams) -> AsyncIterator[str]:
        """The role chunks (the first carries the prompt's extras) when the engine's first
        output arrives, then a chunk per new delta of each choice."""
        progress = StreamProgress()
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
                    choice = ChatCompletionStreamChoice(
                        index=completion.index,
                        delta=DeltaMessage(content=delta.text) if delta.text else DeltaMessage(),
                        logprobs=self._logprobs(delta.token_ids, delta.logprobs),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        token_ids=self._token_ids(delta.token_ids),
                    )
                    yield self._chunk([choice], self._running_usage(progress))
            if self.body.include_usage_in_stream:
                yield self._chunk([], self.usage(progress.completion_tokens))
        except APIError as error:
            yield error_event(error)
        yield SSE_DONE

    def _role_chunks(self, output: RequestOutput, progress: StreamProgress) -> list[str]:
        chunks = []
        for index in range(self.body.n):
            role = ChatCompletionStreamChoice(
                index=index, delta=DeltaMessage(role="assistant", content="")
            )
            extras = self._prompt_extras(output) if index == 0 else {}
            chunks.append(self._chunk([role], self._running_usage(progress), **extras))
        return chunks
