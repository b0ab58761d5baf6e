"""POST /v1/chat/completions: messages -> the tokenizer's chat template (chat_prompt.py) ->
completions.

With ``--reasoning-parser`` each reply's thinking comes back apart from its answer (reasoning.py),
and with tools its calls are read from the answer (tools.py); both stream as deltas of their own
(``reasoning_content``/``reasoning``, ``tool_calls``) beside ``content``. With ``echo`` (vLLM's)
the reply's content starts with the last message, when that message is the assistant's own.

``ChatView`` also answers each conversation of /v1/chat/completions/batch (serving_chat_batch.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from pagedserve.engine import RequestOutput
from pagedserve.server.chat_prompt import plan_prompt
from pagedserve.server.errors import APIError
from pagedserve.server.logprobs import TokenNamer, chat_logprobs, prompt_logprobs
from pagedserve.server.protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    CompletionTokensDetails,
    DeltaMessage,
    UsageInfo,
)
from pagedserve.server.reply import ReplyDelta, ReplyPlan, ReplyReader
from pagedserve.server.request_params import response_id
from pagedserve.server.sse import SSE_DONE, answer, error_event, sse
from pagedserve.server.state import ServerState, new_id, now_s
from pagedserve.server.streams import EngineStreams, StreamProgress
from pagedserve.server.structured_protocol import DeltaFunctionCall, DeltaToolCall
from pagedserve.server.tools import as_tool_calls, new_tool_call_id
from pagedserve.server.vllm_fields import stream_usage, tokens_as_token_ids


async def create_chat_completion(
    request: Request, state: ServerState, body: ChatCompletionRequest
) -> Response:
    state.check_admitting()
    prompt, aliases, plan = await plan_prompt(state, body)
    streams = EngineStreams(state, new_id("chatcmpl"), [prompt], body.priority, aliases, body.model)
    view = ChatView(state, body, response_id("chatcmpl", body), prompt.prompt_token_ids, plan)
    return await answer(
        request, streams, view.stream, lambda finals: view.response(finals[0]), body.stream
    )


class ChatView:
    """Turns engine outputs into OpenAI chat bodies and SSE chunks."""

    def __init__(self, state, body, request_id, prompt_token_ids: list[int], plan: ReplyPlan):
        self.state, self.body, self.id, self.plan = state, body, request_id, plan
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

    def usage(self, completion_tokens: int, completions=None) -> UsageInfo:
        """The usage; with a reasoning parser and the finished ``completions``, the thinking
        tokens among the completion's (a running usage, mid-stream, leaves them out)."""
        details = None
        if self.plan.reasoning is not None and completions is not None:
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

    def _take_prompt(self, output: RequestOutput) -> None:
        """The prompt as the engine ran it: an image's placeholders expanded to its rows (the
        usage counts them, as vLLM's does)."""
        if output.prompt_token_ids:
            self.prompt_token_ids = list(output.prompt_token_ids)
            self.num_prompt_tokens = len(self.prompt_token_ids)

    def response(self, final: RequestOutput) -> ChatCompletionResponse:
        self._take_prompt(final)
        choices = []
        for completion in sorted(final.outputs, key=lambda c: c.index):
            reply = self.plan.whole(completion.text)
            content = self.echo + (reply.content or "") if self.echo else reply.content
            message = AssistantMessage(
                content=content,
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
            kv_transfer_params=final.kv_transfer_params,
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
        return self.usage(progress.completion_tokens) if self.continuous_usage else None

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
                    self._take_prompt(output)
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
            if self.include_usage:
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
