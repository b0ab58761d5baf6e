"""POST /v1/completions: a prompt (text or token ids, or a short list of either) -> completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.engine import RequestOutput
from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.logprobs import completion_logprobs
from pagedserve.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
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


def prompts_of(state: ServerState, body: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """``(text or None, token ids)`` per prompt, tokenized as ``LLM.generate`` does."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise bad_request("the prompt is empty: give at least one token", "prompt")
    limit = state.config.max_prompts
    if len(prompt) > limit:
        raise bad_request(f"at most {limit} prompts per request, got {len(prompt)}", "prompt")
    tokenizer = state.engine.tokenizer
    prompts = []
    for item in prompt:
        if isinstance(item, str):
            if not item:
                raise bad_request("the prompt is empty: give at least one token", "prompt")
            prompts.append((item, tokenizer.encode(item)))
        else:
            prompts.append((None, list(item)))
    return prompts


def plan_prompts(state: ServerState, body: CompletionRequest) -> list[PromptRequest]:
    """The server's own checks, then one engine request per prompt (the engine checks each
    prompt against the model when it is submitted)."""
    check_caps(state, body)
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of must equal n (best-of sampling is not supported)", "best_of")
    if body.echo and body.logprobs is not None:
        raise bad_request(
            "echo together with logprobs needs prompt logprobs, which are not supported", "echo"
        )
    prompts = prompts_of(state, body)
    if body.truncate_prompt_tokens is not None:  # vLLM's: keep the last k tokens of each
        prompts = [(text, ids[-body.truncate_prompt_tokens :]) for text, ids in prompts]
    params = build_sampling_params(
        body,
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        aliases={},
        structured_outputs=structured_outputs_of(body),
    )
    return [PromptRequest(p, ids, params, text) for p, (text, ids) in enumerate(prompts)]


async def create_completion(
    request: Request, state: ServerState, body: CompletionRequest
) -> Response:
    state.check_admitting()
    prompts = plan_prompts(state, body)
    request_id = new_id("cmpl")
    aliases = structured_output_aliases(body)
    streams = EngineStreams(state, request_id, prompts, body.priority, aliases)
    view = _CompletionView(state, body, request_id, prompts)
    try:
        await unless_disconnected(request, streams.admitted())
        if body.stream:
            return EngineStreamingResponse(view.stream(streams), streams)
        finals = await unless_disconnected(request, final_outputs(streams))
    except ClientDisconnected:
        streams.cancel()
        return Response(status_code=499)
    return JSONResponse(view.response(finals).model_dump())


class _CompletionView:
    """Turns engine outputs into OpenAI completion bodies and SSE chunks.

    Choice ``j`` of prompt ``p`` is index ``p * n + j``.
    """

    def __init__(self, state, body, request_id, prompts: list[PromptRequest]) -> None:
        self.state, self.body, self.id, self.prompts = state, body, request_id, prompts
        self.created = now_s()
        self.tokenizer = state.engine.tokenizer

    def index(self, prompt_index: int, completion) -> int:
        return prompt_index * self.body.n + completion.index

    def echo_text(self, prompt_index: int) -> str:
        if not self.body.echo:
            return ""
        prompt = self.prompts[prompt_index]
        if prompt.prompt_text is not None:
            return prompt.prompt_text
        return self.tokenizer.decode(prompt.prompt_token_ids)

    def usage(self, completion_tokens: int) -> UsageInfo:
        prompt = sum(len(p.prompt_token_ids) for p in self.prompts)
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion_tokens,
            total_tokens=prompt + completion_tokens,
        )

    def _logprobs(self, token_ids, logprobs, offset):
        if self.body.logprobs is None:
            return None
        return completion_logprobs(self.tokenizer, token_ids, logprobs, self.body.logprobs, offset)

    def _body(self, choices: list[CompletionChoice], usage: UsageInfo | None = None):
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.state.model_name,
            choices=choices,
            usage=usage,
        )

    def response(self, finals: dict[int, RequestOutput]) -> CompletionResponse:
        choices, tokens = [], 0
        for p, output in sorted(finals.items()):
            prefix = self.echo_text(p)
            for completion in output.outputs:
                tokens += len(completion.token_ids)
                choices.append(
                    CompletionChoice(
                        index=self.index(p, completion),
                        text=prefix + completion.text,
                        logprobs=self._logprobs(
                            completion.token_ids, completion.logprobs, len(prefix)
                        ),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                )
        choices.sort(key=lambda c: c.index)
        return self._body(choices, self.usage(tokens))

    async def stream(self, streams: EngineStreams) -> AsyncIterator[str]:
        progress = StreamProgress()
        try:
            for p in range(len(self.prompts)):
                prefix = self.echo_text(p)
                for j in range(self.body.n if prefix else 0):
                    echo = CompletionChoice(index=p * self.body.n + j, text=prefix)
                    yield sse(self._body([echo]).model_dump_json())
            async for p, output in streams:
                for completion in output.outputs:
                    index = self.index(p, completion)
                    delta = progress.advance(index, completion)
                    if delta is None:
                        continue
                    chunk = CompletionChoice(
                        index=index,
                        text=delta.text,
                        logprobs=self._logprobs(delta.token_ids, delta.logprobs, delta.text_offset),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                    yield sse(self._body([chunk]).model_dump_json())
            if self.body.include_usage_in_stream:
                usage = self.usage(progress.completion_tokens)
                yield sse(self._body([], usage).model_dump_json())
        except APIError as error:
            yield error_event(error)
        yield SSE_DONE
