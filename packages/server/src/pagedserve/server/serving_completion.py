"""POST /v1/completions: a prompt (text or token ids, or a short list of either) -> completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.logprobs import completion_logprobs
from pagedserve.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from pagedserve.server.serving import (
    SSE_DONE,
    SSE_HEADERS,
    Choice,
    ChoiceStreams,
    ClientDisconnected,
    ServerState,
    aborted_error,
    build_sampling_params,
    check_common,
    check_prompt,
    child_params,
    error_event,
    final_outputs,
    hold_back,
    new_id,
    now_s,
    resolve_max_tokens,
    sse,
    unless_disconnected,
)


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


def plan_choices(state: ServerState, body: CompletionRequest) -> tuple[list, list[Choice]]:
    """Validate everything, then one Choice per (prompt, n) in OpenAI's index order."""
    check_common(state, body)
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of must equal n (best-of sampling is not supported)", "best_of")
    if body.echo and body.logprobs is not None:
        raise bad_request(
            "echo together with logprobs needs prompt logprobs, which are not supported", "echo"
        )
    prompts = prompts_of(state, body)
    choices = []
    for p, (text, ids) in enumerate(prompts):
        check_prompt(state, ids, "prompt")
        max_tokens = resolve_max_tokens(state, body.max_tokens, len(ids), "max_tokens")
        params = build_sampling_params(
            state, body, max_tokens=max_tokens, logprobs=body.logprobs, aliases={}
        )
        for j in range(body.n):
            choices.append(Choice(p * body.n + j, p, ids, child_params(params, j), text))
    return prompts, choices


async def create_completion(
    request: Request, state: ServerState, body: CompletionRequest
) -> Response:
    state.check_admitting()
    prompts, choices = plan_choices(state, body)
    request_id = new_id("cmpl")
    streams = ChoiceStreams(state, request_id, choices, body.priority)
    view = _CompletionView(state, body, request_id, prompts, choices)
    try:
        await unless_disconnected(request, streams.admitted())
        if body.stream:
            return StreamingResponse(
                view.stream(streams), media_type="text/event-stream", headers=SSE_HEADERS
            )
        finals = await unless_disconnected(request, final_outputs(streams))
    except ClientDisconnected:
        streams.cancel()
        return Response(status_code=499)
    return JSONResponse(view.response(finals).model_dump())


class _CompletionView:
    """Turns engine outputs into OpenAI completion bodies and SSE chunks."""

    def __init__(self, state, body, request_id, prompts, choices) -> None:
        self.state, self.body, self.id = state, body, request_id
        self.prompts, self.choices = prompts, choices
        self.created = now_s()
        self.tokenizer = state.engine.tokenizer

    def echo_text(self, choice: Choice) -> str:
        if not self.body.echo:
            return ""
        text, ids = self.prompts[choice.prompt_index]
        return text if text is not None else self.tokenizer.decode(ids)

    def usage(self, token_counts: list[int]) -> UsageInfo:
        prompt = sum(len(ids) for _, ids in self.prompts)
        completion = sum(token_counts)
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
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

    def response(self, finals) -> CompletionResponse:
        out = []
        for choice in self.choices:
            completion = finals[choice.index].outputs[0]
            prefix = self.echo_text(choice)
            out.append(
                CompletionChoice(
                    index=choice.index,
                    text=prefix + completion.text,
                    logprobs=self._logprobs(completion.token_ids, completion.logprobs, len(prefix)),
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
            )
        counts = [len(finals[c.index].outputs[0].token_ids) for c in self.choices]
        return self._body(out, self.usage(counts))

    async def stream(self, streams: ChoiceStreams) -> AsyncIterator[str]:
        sent_chars = {c.index: 0 for c in self.choices}
        sent_tokens = {c.index: 0 for c in self.choices}
        try:
            for choice in self.choices:
                prefix = self.echo_text(choice)
                if prefix:
                    yield sse(
                        self._body(
                            [CompletionChoice(index=choice.index, text=prefix)]
                        ).model_dump_json()
                    )
            async for index, output in streams:
                completion = output.outputs[0]
                if completion.finish_reason == "abort":
                    raise aborted_error(self.state)
                choice = self.choices[index]
                text = hold_back(completion.text, choice.params, output.finished)
                delta = text[sent_chars[index] :]
                if not delta and not output.finished:
                    continue
                new_ids = completion.token_ids[sent_tokens[index] :]
                new_lps = completion.logprobs[sent_tokens[index] :] if completion.logprobs else None
                chunk = CompletionChoice(
                    index=index,
                    text=delta,
                    logprobs=self._logprobs(new_ids, new_lps, sent_chars[index]),
                    finish_reason=completion.finish_reason if output.finished else None,
                    stop_reason=completion.stop_reason if output.finished else None,
                )
                sent_chars[index] = len(text)
                sent_tokens[index] = len(completion.token_ids)
                yield sse(self._body([chunk]).model_dump_json())
            if self.body.include_usage_in_stream:
                yield sse(self._body([], self.usage(list(sent_tokens.values()))).model_dump_json())
        except APIError as error:
            yield error_event(error)
        yield SSE_DONE
