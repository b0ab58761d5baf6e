"""POST /v1/chat/completions: messages -> the tokenizer's chat template -> completions.

With ``--reasoning-parser`` each reply's thinking comes back apart from its answer (reasoning.py),
and with tools its calls are read from the answer (tools.py); both stream as deltas of their own
(``reasoning_content``/``reasoning``, ``tool_calls``) beside ``content``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from pagedserve.engine import RequestOutput, apply_chat_template
from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.field_coverage import check_thinking_budget
from pagedserve.server.logprobs import TokenNamer, chat_logprobs, prompt_logprobs
from pagedserve.server.protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatMessage,
    CompletionTokensDetails,
    DeltaMessage,
    UsageInfo,
)
from pagedserve.server.reasoning import (
    PROMPT_TAIL_TOKENS,
    REASONING_PARSERS,
    ReasoningMode,
    answer_only,
)
from pagedserve.server.reply import ReplyDelta, ReplyPlan, ReplyReader
from pagedserve.server.request_params import (
    build_sampling_params,
    check_caps,
    response_id,
    truncated_prompt,
)
from pagedserve.server.sse import SSE_DONE, answer, error_event, sse
from pagedserve.server.state import ServerState, new_id, now_s
from pagedserve.server.streams import EngineStreams, PromptRequest, StreamProgress
from pagedserve.server.structured import (
    constraint_field,
    structured_output_aliases,
    structured_outputs_of,
)
from pagedserve.server.structured_protocol import DeltaFunctionCall, DeltaToolCall
from pagedserve.server.tools import (
    ToolCallPlan,
    as_tool_calls,
    conversation_with_tools,
    new_tool_call_id,
    plan_tools,
    resolve_tool_parser,
    template_supports_tools,
)
from pagedserve.server.vllm_fields import default_max_tokens

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
        thinking = message.reasoning_content or message.reasoning
        if thinking and message.role == "assistant":
            entry["reasoning_content"] = thinking
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


def template_kwargs_of(body: ChatCompletionRequest) -> dict:
    """What the chat template is given beyond the messages: ``chat_template_kwargs``,
    ``documents``, and ``reasoning_effort`` (which, as in vLLM, also sets ``enable_thinking``
    unless the request set it)."""
    kwargs = dict(body.chat_template_kwargs or {})
    if body.documents is not None:
        kwargs["documents"] = body.documents
    if body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
        kwargs.setdefault("enable_thinking", body.reasoning_effort != "none")
    return kwargs


def reasoning_mode(
    state: ServerState, prompt_ids: list[int], template_kwargs: dict
) -> ReasoningMode | None:
    """The request's reasoning mode under ``--reasoning-parser`` (None without one), read from
    the end of its rendered prompt."""
    name = state.config.reasoning_parser
    if name is None:
        return None
    tail = state.engine.tokenizer.decode(
        prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False
    )
    return REASONING_PARSERS[name].mode(tail, template_kwargs)


def plan_prompt(
    state: ServerState, body: ChatCompletionRequest
) -> tuple[PromptRequest, dict[str, str], ReplyPlan]:
    """The conversation as one engine request with the request's n, the API's names of the
    engine's fields (for the engine's refusals), and how its replies are read."""
    check_caps(state, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    template = state.config.chat_template
    parser = resolve_tool_parser(state.config.tool_call_parser, state.engine.tokenizer, template)
    tools = plan_tools(body, parser)
    constraint = structured_outputs_of(body)
    tool_constraint = tools.constraint()
    if constraint is not None and tool_constraint is not None:
        what = "a strict tool under tool_choice auto" if tools.mode == "auto" else None
        raise bad_request(
            f"{what or 'tool_choice ' + tools.mode} constrains the reply itself: drop the "
            "output constraint",
            "tool_choice",
        )
    add_generation_prompt = body.add_generation_prompt
    kwargs = template_kwargs_of(body)
    if body.continue_final_message:  # the reply continues the last (assistant) message
        if body.messages[-1].role != "assistant":
            raise bad_request(
                "continue_final_message needs an assistant message last", "continue_final_message"
            )
        add_generation_prompt, kwargs["continue_final_message"] = False, True
    prompt_ids = chat_prompt_ids(state, body.messages, add_generation_prompt, kwargs, tools)
    prompt_ids = truncated_prompt(body, prompt_ids)
    mode = reasoning_mode(state, prompt_ids, kwargs)
    max_tokens, param = max_tokens_of(body)
    was_sent = bool({"max_tokens", "max_completion_tokens"} & body.model_fields_set)
    max_model_len = state.engine.scheduler_config.max_model_len
    defaults = state.engine.model_config.generation_defaults.sampling
    max_tokens = default_max_tokens(  # generation_config's max_new_tokens, else all the room
        max_tokens, was_sent, len(prompt_ids), max_model_len, defaults.get("max_tokens")
    )
    check_thinking_budget(body.thinking_token_budget, max_tokens, "thinking_token_budget")
    aliases = {**CHAT_ALIASES, "max_tokens": param, **structured_output_aliases(body)}
    blamed = "tool_choice" if tool_constraint is not None else constraint_field(body)
    if mode is not None and mode is not ReasoningMode.CLOSED and blamed:
        aliases["structured_outputs.structural_tag"] = blamed
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = build_sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=logprobs,
        aliases=aliases,
        defaults=defaults,
        prompt_logprobs=body.prompt_logprobs,
        structured_outputs=answer_only(tool_constraint or constraint, mode, blamed or ""),
        keep_special_tokens=not tools.skip_special_tokens,
    )
    plan = ReplyPlan(tools, mode, body.include_reasoning)
    return PromptRequest(0, prompt_ids, params), aliases, plan


async def create_chat_completion(
    request: Request, state: ServerState, body: ChatCompletionRequest
) -> Response:
    state.check_admitting()
    prompt, aliases, plan = plan_prompt(state, body)
    streams = EngineStreams(state, new_id("chatcmpl"), [prompt], body.priority, aliases, body.model)
    view = _ChatView(state, body, response_id("chatcmpl", body), prompt.prompt_token_ids, plan)
    return await answer(
        request, streams, view.stream, lambda finals: view.response(finals[0]), body.stream
    )


class _ChatView:
    """Turns engine outputs into OpenAI chat bodies and SSE chunks."""

    def __init__(self, state, body, request_id, prompt_token_ids: list[int], plan: ReplyPlan):
        self.state, self.body, self.id, self.plan = state, body, request_id, plan
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

    def usage(self, completion_tokens: int, completions=()) -> UsageInfo:
        """The usage; with a reasoning parser, the thinking tokens among the completion's."""
        details = None
        if self.plan.reasoning is not None:
            thinking = sum(
                self.plan.reasoning_tokens(c.token_ids, self.tokenizer.decode) for c in completions
            )
            details = CompletionTokensDetails(reasoning_tokens=thinking)
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=self.num_prompt_tokens + completion_tokens,
            completion_tokens_details=details,
        )

    def _logprobs(self, token_ids, logprobs):
        if not self.body.logprobs:
            return None
        return chat_logprobs(self.name, token_ids, logprobs, self.k)

    def response(self, final: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for completion in sorted(final.outputs, key=lambda c: c.index):
            reply = self.plan.whole(completion.text)
            message = AssistantMessage(
                content=reply.content,
                reasoning_content=reply.reasoning,
                reasoning=reply.reasoning,
                tool_calls=as_tool_calls(reply.calls),
            )
            choices.append(
                ChatCompletionChoice(
                    index=completion.index,
                    message=message,
                    logprobs=self._logprobs(completion.token_ids, completion.logprobs),
                    finish_reason=self._finish_reason(completion.finish_reason, bool(reply.calls)),
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
            usage=self.usage(tokens, final.outputs),
            **self._prompt_extras(final),
        )

    def _finish_reason(self, finish_reason: str | None, has_calls: bool) -> str | None:
        """ "tool_calls" for a reply that ended (not cut by max_tokens) with calls in it."""
        if finish_reason == "stop" and (has_calls or self.plan.tools.mode == "named"):
            return "tool_calls"
        return finish_reason

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
        return self.usage(progress.completion_tokens) if self.body.continuous_usage else None

    async def stream(self, streams: EngineStreams) -> AsyncIterator[str]:
        """The role chunks (the first carries the prompt's extras) when the engine's first
        output arrives, then a chunk per new delta of each choice: its thinking, content and
        tool calls as the choice's ``ReplyReader`` settles them."""
        progress = StreamProgress(delta=streams.delta)
        choices: dict[int, _StreamedChoice] = {}
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
                    choice = choices.setdefault(
                        completion.index, _StreamedChoice(self.plan.reader())
                    )
                    choice.completion = completion
                    parsed = choice.reader.feed(delta.text)
                    if completion.finish_reason is not None:
                        parsed += choice.reader.finish()
                    chunk = self._delta_choice(choice, completion, delta, parsed)
                    if chunk is not None:
                        yield self._chunk([chunk], self._running_usage(progress))
            if self.body.include_usage_in_stream:
                finals = [choice.completion for choice in choices.values()]
                yield self._chunk([], self.usage(progress.completion_tokens, finals))
        except APIError as error:
            yield error_event(error)
        yield SSE_DONE

    def _delta_choice(self, choice, completion, delta, parsed: ReplyDelta):
        """One choice's chunk (None when it has nothing to say: text held back by a parser)."""
        message = DeltaMessage()
        thinking = self.plan.shown_reasoning(parsed.reasoning)
        if thinking:
            message.reasoning_content = message.reasoning = thinking
        if parsed.content:
            message.content = parsed.content
        if parsed.calls:
            message.tool_calls = [choice.tool_call(call) for call in parsed.calls]
        finished = completion.finish_reason is not None
        logprobs = self._logprobs(delta.token_ids, delta.logprobs)
        token_ids = self._token_ids(delta.token_ids)
        if not (thinking or parsed.content or parsed.calls or finished or logprobs or token_ids):
            return None
        return ChatCompletionStreamChoice(
            index=completion.index,
            delta=message,
            logprobs=logprobs,
            finish_reason=self._finish_reason(completion.finish_reason, choice.num_calls > 0),
            stop_reason=completion.stop_reason,
            token_ids=token_ids,
        )

    def _role_chunks(self, output: RequestOutput, progress: StreamProgress) -> list[str]:
        chunks = []
        for index in range(self.body.n):
            role = ChatCompletionStreamChoice(
                index=index, delta=DeltaMessage(role="assistant", content="")
            )
            extras = self._prompt_extras(output) if index == 0 else {}
            chunks.append(self._chunk([role], self._running_usage(progress), **extras))
        return chunks


class _StreamedChoice:
    """One streamed choice: its reply reader and the ids of the calls it has sent."""

    def __init__(self, reader: ReplyReader) -> None:
        self.reader = reader
        self.call_ids: dict[int, str] = {}
        self.completion = None  # the choice's whole completion so far

    @property
    def num_calls(self) -> int:
        return len(self.call_ids)

    def tool_call(self, call) -> DeltaToolCall:
        """A call's delta as OpenAI streams one: its first carries the id, type and name."""
        delta = DeltaToolCall(
            index=call.index, function=DeltaFunctionCall(arguments=call.arguments)
        )
        if call.name is not None:
            self.call_ids[call.index] = new_tool_call_id()
            delta.id, delta.type = self.call_ids[call.index], "function"
            delta.function.name = call.name
        return delta
