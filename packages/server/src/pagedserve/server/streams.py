"""Engine streams and their progress: one engine request per prompt, consumed concurrently, and
what of each choice has been sent.

A request over ``P`` prompts becomes ``P`` engine requests (ids ``<id>-<prompt index>``), each
with the request's ``n``: the engine forks the ``n`` choices of a prompt after its prefill, over
shared blocks. Choice ``j`` of prompt ``p`` is index ``p * n + j`` in the response, as OpenAI
orders them.

Each engine stream is consumed by its own asyncio task (a *pump*). Cancelling a pump closes its
``AsyncLLM.generate`` iterator, which aborts the request and frees its blocks; cancelling is
synchronous, so it also works from inside an anyio cancel scope (Starlette's streaming response
cancels the body iterator when the client goes away, and no ``await`` may run after that).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagedserve.engine import CompletionOutput, RequestOutput, RequestOutputKind, SamplingParams
from pagedserve.server.errors import APIError, from_engine_error
from pagedserve.server.state import ServerState


@dataclass
class PromptRequest:
    """One engine request: prompt ``index`` of the HTTP request, with all its ``n`` choices."""

    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None
    # the prompt's images, ``{"image": [PIL images]}`` in prompt order (None: a text prompt)
    multi_modal_data: dict | None = None


class EngineStreams:
    """Runs one engine request per prompt concurrently; iterate for ``(prompt index, output)``.

    A streaming request's outputs are deltas (``RequestOutputKind.DELTA``, which
    ``StreamProgress`` joins up), a non-streaming one's only its final output (FINAL_ONLY), a
    streamed beam search's cumulative snapshots. ``admitted``
    waits until every prompt was accepted by the engine (its first output arrived) and raises the
    first refusal as an APIError, so a streaming response can still answer with a 4xx/503; the
    engine's field names in a refusal become the API's through ``aliases``.
    """

    def __init__(
        self,
        state: ServerState,
        request_id: str,
        prompts: list[PromptRequest],
        priority: int,
        aliases: dict[str, str] | None = None,
        model: str | None = None,
    ):
        self.state = state
        self.prompts = prompts
        self.delta = all(p.params.output_kind is RequestOutputKind.DELTA for p in prompts)
        self.aliases = aliases or {}
        self._queue: asyncio.Queue = asyncio.Queue()
        self._first: list[asyncio.Future] = []
        self._pumps: list[asyncio.Task] = []
        loop = asyncio.get_running_loop()
        lora = state.lora_request_for(model)  # the adapter, if ``model`` names one
        extra = {} if lora is None else {"lora_request": lora}
        tracer, served_name = state.tracer, state.served_name(model)
        for prompt in prompts:
            engine_id = f"{request_id}-{prompt.index}"
            state.in_flight[engine_id] = None  # at once, so a drain never misses a request
            first = loop.create_future()
            self._first.append(first)
            # the images only where there are some: a text prompt's call is the same for any
            # EngineClient, whether or not it takes images
            media = prompt.multi_modal_data
            kwargs = extra if media is None else {**extra, "multi_modal_data": media}
            generator = state.engine.generate(
                prompt.prompt_token_ids,
                prompt.params,
                engine_id,
                prompt.prompt_text,
                priority,
                **kwargs,
            )
            trace = None
            if tracer is not None:  # --otlp-traces-endpoint: one span per engine request
                num_prompt_tokens = len(prompt.prompt_token_ids)
                trace = tracer.start(engine_id, prompt.params, served_name, num_prompt_tokens)
            pump = asyncio.create_task(self._pump(prompt, generator, first, trace))
            # Out of in_flight only once the pump is done (its abort, if any, is submitted).
            pump.add_done_callback(lambda _, key=engine_id: state.in_flight.pop(key, None))
            self._pumps.append(pump)

    async def _pump(self, prompt: PromptRequest, generator, first: asyncio.Future, trace) -> None:
        try:
            async for output in generator:
                if trace is not None:
                    trace.observe(output)
                if not first.done():
                    first.set_result(None)
                    if self.state.observe_request_params is not None:
                        self.state.observe_request_params(prompt.params)
                self._queue.put_nowait((prompt.index, output))
        except Exception as error:  # a refusal, or the engine died: the consumer raises it
            if not first.done():
                first.set_exception(error)
                first.exception()  # retrieved: the consumer reads it through ``admitted``
            self._queue.put_nowait((prompt.index, error))
        finally:
            await generator.aclose()

    async def admitted(self) -> None:
        for first in self._first:
            try:
                await asyncio.shield(first)
            except Exception as error:
                self.cancel()
                retry_after_s = self.state.config.retry_after_s
                raise from_engine_error(error, retry_after_s, self.aliases) from error

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self.prompts)
        try:
            while remaining:
                index, item = await self._queue.get()
                if isinstance(item, BaseException):
                    retry_after_s = self.state.config.retry_after_s
                    raise from_engine_error(item, retry_after_s, self.aliases) from item
                if any(c.finish_reason == "abort" for c in item.outputs):
                    raise aborted_error(self.state)
                if item.finished:
                    remaining -= 1
                yield index, item
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Abort every prompt still running (synchronous: safe in a cancelled scope)."""
        for pump in self._pumps:
            if not pump.done():
                pump.cancel()


@dataclass
class Delta:
    """What one choice added since the last chunk."""

    text: str
    token_ids: list[int]
    logprobs: list[dict] | None
    text_offset: int  # characters of this choice already streamed
    finished: bool


@dataclass
class StreamProgress:
    """What has been streamed of each choice: turns the engine's outputs into chunks.

    The engine's cumulative text only grows (it holds back what a stop string may still cut), so
    a delta is the text past what was sent. With ``delta`` (the engine sends DELTA outputs)
    each choice's deltas are first joined into its whole completion so far (``whole``), so a
    chunk is cut exactly as from a cumulative output (a step whose text is held back sends
    nothing; its tokens go with the next chunk).
    """

    chars: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    delta: bool = False
    whole: dict[int, CompletionOutput] = field(default_factory=dict)

    def advance(self, index: int, completion) -> Delta | None:
        """The delta of choice ``index`` (None when there is nothing new to send)."""
        if index in self.finished:
            return None
        if self.delta:
            completion = self._joined(index, completion)
        sent_chars, sent_tokens = self.chars.get(index, 0), self.tokens.get(index, 0)
        finished = completion.finish_reason is not None
        text = completion.text[sent_chars:]
        if not text and not finished:
            return None
        self.chars[index] = len(completion.text)
        self.tokens[index] = len(completion.token_ids)
        if finished:
            self.finished.add(index)
        logprobs = completion.logprobs[sent_tokens:] if completion.logprobs is not None else None
        return Delta(text, completion.token_ids[sent_tokens:], logprobs, sent_chars, finished)

    def _joined(self, index: int, delta: CompletionOutput) -> CompletionOutput:
        whole = self.whole.get(index)
        if whole is None:  # a copy: the engine's lists are not extended here
            whole = self.whole[index] = dataclasses.replace(
                delta,
                token_ids=list(delta.token_ids),
                logprobs=None if delta.logprobs is None else list(delta.logprobs),
            )
        else:
            whole.add_delta(delta)
        return whole

    def cumulative(self, index: int, completion: CompletionOutput) -> CompletionOutput:
        """Choice ``index``'s whole completion so far, once ``advance`` has seen ``completion``."""
        return self.whole.get(index, completion) if self.delta else completion

    def cumulative_output(self, output: RequestOutput) -> RequestOutput:
        """``output`` with each completion replaced by its whole (its indices are its own)."""
        if not self.delta:
            return output
        outputs = [self.cumulative(c.index, c) for c in output.outputs]
        return dataclasses.replace(output, outputs=outputs)

    @property
    def completion_tokens(self) -> int:
        return sum(self.tokens.values())


async def final_outputs(streams: EngineStreams) -> dict[int, RequestOutput]:
    """Each prompt's finished output (a request aborted by the drain raises a 503)."""
    finals: dict[int, RequestOutput] = {}
    async for index, output in streams:
        if output.finished:
            finals[index] = output
    return finals


def aborted_error(state: ServerState) -> APIError:
    return APIError(
        "the request was aborted: the server is shutting down",
        503,
        code="aborted",
        headers={"Retry-After": str(state.config.retry_after_s)},
    )
