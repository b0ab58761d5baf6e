"""POST /v1/completions: a prompt (text or token ids, or a short list of either) -> completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from pagedserve.engine import RequestOutput
from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.logprobs import TokenNamer, completion_logprobs, prompt_logprobs
from pagedserve.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    UsageInfo,
)
from pagedserve.server.reasoning import ReasoningMode, thinking_budget
from pagedserve.server.request_params import (
    build_sampling_params,
    check_caps,
    response_id,
    truncated_prompt,
)
from pagedserve.server.sse import (
    SSE_DONE,
    answer,
    error_event,
    sse,
)
from pagedserve.server.state import ServerState, new_id, now_s
from pagedserve.server.streams import EngineStreams, PromptRequest, StreamProgress
from pagedserve.server.structured import structured_output_aliases, structured_outputs_of
from pagedserve.server.vllm_fields import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    default_max_tokens,
    stream_usage,
    tokens_as_token_ids,
)

# vLLM's words for it (clients match them), after ours
EMPTY_PROMPT = (
    "the prompt is empty: give at least one token "
    "(Either prompt or prompt_embeds must be provided and non-empty.)"
)


def prompts_of(state: ServerState, body: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """``(text or None, token ids)`` per prompt, tokenized as ``LLM.generate`` does."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt or any(not item for item in prompt):
        raise bad_request(EMPTY_PROMPT, "prompt")
    limit = state.config.max_prompts
    if len(prompt) > limit:
        raise bad_request(f"at most {limit} prompts per request, got {len(prompt)}", "prompt")
    tokenizer = state.engine.tokenizer
    prompts = []
    for item in prompt:
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=body.add_special_tokens)
            prompts.append((item, ids))
        else:
            prompts.append((None, list(item)))
    return prompts


def plan_prompts(state: ServerState, body: CompletionRequest) -> list[PromptRequest]:
    """The server's own checks, then one engine request per prompt (the engine checks each
    prompt against the model when it is submitted). ``echo`` with ``logprobs`` asks the engine
    for the prompt's logprobs too, as vLLM does."""
    check_caps(state, body)
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n and not body.use_beam_search:
        raise bad_request("best_of must equal n (best-of sampling is not supported)", "best_of")
    num_prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        num_prompt_logprobs = max(num_prompt_logprobs or 0, body.logprobs)
    max_model_len = state.engine.scheduler_config.max_model_len
    was_sent = "max_tokens" in body.model_fields_set
    defaults = state.engine.model_config.generation_defaults.sampling
    default = defaults.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)  # generation_config's first
    prompts = [(text, truncated_prompt(body, ids)) for text, ids in prompts_of(state, body)]
    tokenizer, parser = state.engine.tokenizer, state.config.reasoning_parser
    # a completion's prompt is the caller's own text: it thinks where it opened the tag
    mode = None if parser is None else ReasoningMode.OPTIONAL
    thinking = thinking_budget(
        tokenizer, parser, mode, body.thinking_token_budget, "thinking_token_budget"
    )
    plans = []
    for p, (text, ids) in enumerate(prompts):
        max_tokens = default_max_tokens(body.max_tokens, was_sent, len(ids), max_model_len, default)
        params = build_sampling_params(
            body,
            max_tokens=max_tokens,
            logprobs=body.logprobs,
            aliases={},
            prompt_logprobs=num_prompt_logprobs,
            defaults=defaults,
            structured_outputs=structured_outputs_of(body),
            thinking=thinking,
        )
        plans.append(PromptRequest(p, ids, params, text))
    return plans


async def create_completion(
    request: Request, state: ServerState, body: CompletionRequest
) -> Response:
    state.check_admitting()
    prompts = plan_prompts(state, body)
    aliases = structured_output_aliases(body)
    streams = EngineStreams(state, new_id("cmpl"), prompts, body.priority, aliases, body.model)
    view = _CompletionView(state, body, response_id("cmpl", body), prompts)
    return await answer(request, streams, view.stream, view.response, body.stream)


class _CompletionView:
    """Turns engine outputs into OpenAI completion bodies and SSE chunks.

    Choice ``j`` of prompt ``p`` is index ``p * n + j``. The prompt's extras (``prompt_logprobs``,
    ``prompt_token_ids``) go on the first chunk of each choice: the echoed prompt's, if any.
    """

    def __init__(self, state, body, request_id, prompts: list[PromptRequest]) -> None:
        self.state, self.body, self.id, self.prompts = state, body, request_id, prompts
        self.created = now_s()
        self.tokenizer = state.engine.tokenizer
        self.name = TokenNamer(self.tokenizer, tokens_as_token_ids(body, state.config))
        self.include_usage, self.continuous_usage = stream_usage(body, state.config)

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
        return completion_logprobs(self.name, token_ids, logprobs, self.body.logprobs, offset)

    def _echo_logprobs(self, p: int, output: RequestOutput) -> CompletionLogprobs | None:
        """The echoed prompt's logprobs (its first token has none), with echo and logprobs."""
        if not self.body.echo:
            return None
        ids = self.prompts[p].prompt_token_ids
        return self._logprobs(ids, output.prompt_logprobs, 0)

    def _prompt_extras(self, p: int, output: RequestOutput) -> dict:
        extras = {}
        if self.body.prompt_logprobs is not None:
            extras["prompt_logprobs"] = prompt_logprobs(
                self.name, output.prompt_logprobs, self.body.prompt_logprobs
            )
        if self.body.return_token_ids:
            extras["prompt_token_ids"] = self.prompts[p].prompt_token_ids
        return extras

    def _body(self, choices: list, usage: UsageInfo | None = None, kind=CompletionResponse):
        """The response (``kind`` CompletionResponse) or a chunk of it (CompletionChunk)."""
        return kind(
            id=self.id,
            created=self.created,
            model=self.state.served_name(self.body.model),
            choices=choices,
            usage=usage,
        )

    def response(self, finals: dict[int, RequestOutput]) -> CompletionResponse:
        choices, tokens = [], 0
        for p, output in sorted(finals.items()):
            prefix = self.echo_text(p)
            for completion in output.outputs:
                tokens += len(completion.token_ids)
                logprobs = _joined(
                    self._echo_logprobs(p, output),
                    self._logprobs(completion.token_ids, completion.logprobs, len(prefix)),
                )
                choices.append(
                    CompletionChoice(
                        index=self.index(p, completion),
                        text=prefix + completion.text,
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        token_ids=completion.token_ids if self.body.return_token_ids else None,
                        **self._prompt_extras(p, output),
                    )
                )
        choices.sort(key=lambda c: c.index)
        response = self._body(choices, self.usage(tokens))
        response.kv_transfer_params = finals[min(finals)].kv_transfer_params  # the first prompt's
        return response

    async def stream(self, streams: EngineStreams) -> AsyncIterator[str]:
        progress = StreamProgress(delta=streams.delta)
        started: set[int] = set()
        try:
            async for p, output in streams:
                if self.body.use_beam_search and not output.finished:
                    continue  # beams reorder as they go: only the final ones are text to send
                if p not in started:
                    started.add(p)
                    for chunk in self._echo_chunks(p, output):
                        yield chunk
                for completion in output.outputs:
                    chunk = self._delta_chunk(p, output, completion, progress)
                    if chunk is not None:
                        yield chunk
            if self.include_usage:
                usage = self.usage(progress.completion_tokens)
                yield sse(self._body([], usage, CompletionChunk).model_dump_json())
        except APIError as error:
            yield error_event(error)
        yield SSE_DONE

    def _echo_chunks(self, p: int, output: RequestOutput) -> list[str]:
        prefix = self.echo_text(p)
        if not prefix:
            return []
        echo_logprobs = self._echo_logprobs(p, output)
        extras = self._prompt_extras(p, output)
        chunks = []
        for j in range(self.body.n):
            choice = CompletionStreamChoice(
                index=p * self.body.n + j, text=prefix, logprobs=echo_logprobs, **extras
            )
            chunks.append(self._chunk(choice, 0))
        return chunks

    def _delta_chunk(self, p: int, output, completion, progress: StreamProgress) -> str | None:
        index = self.index(p, completion)
        first = index not in progress.chars and not self.body.echo
        delta = progress.advance(index, completion)
        if delta is None:
            return None
        offset = len(self.echo_text(p)) + delta.text_offset
        choice = CompletionStreamChoice(
            index=index,
            text=delta.text,
            logprobs=self._logprobs(delta.token_ids, delta.logprobs, offset),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            token_ids=delta.token_ids if self.body.return_token_ids else None,
            **(self._prompt_extras(p, output) if first else {}),
        )
        return self._chunk(choice, progress.completion_tokens)

    def _chunk(self, choice: CompletionStreamChoice, completion_tokens: int) -> str:
        usage = self.usage(completion_tokens) if self.continuous_usage else None
        return sse(self._body([choice], usage, CompletionChunk).model_dump_json())


def _joined(
    prompt: CompletionLogprobs | None, completion: CompletionLogprobs | None
) -> CompletionLogprobs | None:
    """The echoed prompt's logprobs, then the completion's (one parallel list each)."""
    if prompt is None or completion is None:
        return completion
    return CompletionLogprobs(
        tokens=prompt.tokens + completion.tokens,
        token_logprobs=prompt.token_logprobs + completion.token_logprobs,
        top_logprobs=prompt.top_logprobs + completion.top_logprobs,
        text_offset=prompt.text_offset + completion.text_offset,
    )
