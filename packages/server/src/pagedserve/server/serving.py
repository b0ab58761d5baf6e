"""What both generation endpoints share: validation against the model and the caps, building
SamplingParams, one engine request per prompt, concurrent consumption, and disconnect handling.

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
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import StreamingResponse

from pagedserve.engine import RequestOutput, SamplingParams
from pagedserve.server.config import ServerConfig
from pagedserve.server.errors import APIError, bad_request, from_engine_error, from_value_error
from pagedserve.server.protocol import SamplingRequest

MAX_LOGIT_BIAS_ENTRIES = 1024


class ClientDisconnected(Exception):
    """The client went away before its response was ready; its requests have been aborted."""


@dataclass
class ServerState:
    """Shared by the routes and the launcher: in-flight engine requests, and the drain flag."""

    engine: object
    config: ServerConfig
    model_name: str
    created: int = 0
    draining: bool = False
    in_flight: dict[str, None] = field(default_factory=dict)  # engine request ids

    def check_admitting(self) -> None:
        if self.draining:
            raise APIError(
                "the server is shutting down and admits no new requests",
                503,
                code="shutting_down",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )

    async def abort_all(self) -> None:
        for request_id in list(self.in_flight):
            await self.engine.abort(request_id)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


# ---- validation --------------------------------------------------------------------------------


def check_prompt(state: ServerState, token_ids: list[int], param: str) -> None:
    """A prompt must be non-empty, inside the vocabulary, and leave room for one new token."""
    model = state.engine.model_config
    if not token_ids:
        raise bad_request("the prompt is empty: give at least one token", param)
    vocab = model.vocab_size
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param)
    max_len = state.engine.scheduler_config.max_model_len
    if len(token_ids) >= max_len:
        raise bad_request(
            f"this model's maximum context length is {max_len} tokens; the prompt has "
            f"{len(token_ids)}, leaving no room for a completion",
            param,
        )


def resolve_max_tokens(
    state: ServerState, requested: int | None, prompt_len: int, param: str
) -> int:
    """``requested``, checked to fit; None means as many as fit after the prompt."""
    max_len = state.engine.scheduler_config.max_model_len
    room = max_len - prompt_len
    if requested is None:
        return room
    if requested < 1:
        raise bad_request(f"{param} must be at least 1, got {requested}", param)
    if requested > room:
        raise bad_request(
            f"this model's maximum context length is {max_len} tokens; you asked for "
            f"{prompt_len + requested} ({prompt_len} in the prompt, {requested} in the completion)",
            param,
        )
    return requested


def check_model(state: ServerState, name: str | None) -> None:
    """A request may name the served model, or no model at all."""
    if name is not None and name != state.model_name:
        raise APIError(
            f"the model {name!r} does not exist; this server serves {state.model_name!r}",
            404,
            param="model",
            code="model_not_found",
        )


def check_common(state: ServerState, body: SamplingRequest) -> None:
    """The server's caps and the vocabulary checks that SamplingParams cannot do."""
    cfg = state.config
    check_model(state, body.model)
    if not 1 <= body.n <= cfg.max_n:
        raise bad_request(f"n must be in [1, {cfg.max_n}], got {body.n}", "n")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > cfg.max_stop:
        raise bad_request(f"at most {cfg.max_stop} stop strings, got {len(stops)}", "stop")
    if any(len(s) > cfg.max_stop_length for s in stops):
        raise bad_request(f"stop strings must be at most {cfg.max_stop_length} characters", "stop")
    vocab = state.engine.model_config.vocab_size
    stop_ids = body.stop_token_ids or []
    if len(stop_ids) > cfg.max_stop:
        raise bad_request(f"at most {cfg.max_stop} stop token ids", "stop_token_ids")
    if any(not 0 <= t < vocab for t in stop_ids):
        raise bad_request(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")


def parse_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI sends token ids as string keys; each must be a token of this model."""
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(
            f"logit_bias has more than {MAX_LOGIT_BIAS_ENTRIES} entries", "logit_bias"
        )
    parsed = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(
                f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})",
                "logit_bias",
            )
        if not -100.0 <= value <= 100.0:
            raise bad_request(
                f"logit_bias values must be in [-100, 100], got {value}", "logit_bias"
            )
        parsed[token] = value
    return parsed


def build_sampling_params(
    state: ServerState,
    body: SamplingRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    aliases: dict[str, str],
) -> SamplingParams:
    """The SamplingParams of each prompt's engine request (with the request's ``n``)."""

    def given(value, default):
        return default if value is None else value

    try:
        return SamplingParams(
            n=body.n,
            temperature=given(body.temperature, 1.0),
            top_p=given(body.top_p, 1.0),
            top_k=given(body.top_k, 0),
            min_p=given(body.min_p, 0.0),
            presence_penalty=given(body.presence_penalty, 0.0),
            frequency_penalty=given(body.frequency_penalty, 0.0),
            repetition_penalty=given(body.repetition_penalty, 1.0),
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            logit_bias=parse_logit_bias(body.logit_bias, state.engine.model_config.vocab_size),
            skip_special_tokens=body.skip_special_tokens,
        )
    except ValueError as e:
        raise from_value_error(e, aliases) from e


# ---- running prompts -----------------------------------------------------------------------------


@dataclass
class PromptRequest:
    """One engine request: prompt ``index`` of the HTTP request, with all its ``n`` choices."""

    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None


class EngineStreams:
    """Runs one engine request per prompt concurrently; iterate for ``(prompt index, output)``.

    Outputs are cumulative, so a slow consumer skips intermediate ones harmlessly. ``admitted``
    waits until every prompt was accepted by the engine (its first output arrived) and raises the
    first refusal as an APIError, so a streaming response can still answer with a 4xx/503.
    """

    def __init__(
        self, state: ServerState, request_id: str, prompts: list[PromptRequest], priority: int
    ):
        self.state = state
        self.prompts = prompts
        self._queue: asyncio.Queue = asyncio.Queue()
        self._first: list[asyncio.Future] = []
        self._pumps: list[asyncio.Task] = []
        loop = asyncio.get_running_loop()
        for prompt in prompts:
            engine_id = f"{request_id}-{prompt.index}"
            state.in_flight[engine_id] = None  # at once, so a drain never misses a request
            first = loop.create_future()
            self._first.append(first)
            generator = state.engine.generate(
                prompt.prompt_token_ids, prompt.params, engine_id, prompt.prompt_text, priority
            )
            pump = asyncio.create_task(self._pump(prompt.index, generator, first))
            # Out of in_flight only once the pump is done (its abort, if any, is submitted).
            pump.add_done_callback(lambda _, key=engine_id: state.in_flight.pop(key, None))
            self._pumps.append(pump)

    async def _pump(self, index: int, generator, first: asyncio.Future) -> None:
        try:
            async for output in generator:
                if not first.done():
                    first.set_result(None)
                self._queue.put_nowait((index, output))
        except Exception as error:  # a refusal, or the engine died: the consumer raises it
            if not first.done():
                first.set_exception(error)
                first.exception()  # retrieved: the consumer reads it through ``admitted``
            self._queue.put_nowait((index, error))
        finally:
            await generator.aclose()

    async def admitted(self) -> None:
        for first in self._first:
            try:
                await asyncio.shield(first)
            except Exception as error:
                self.cancel()
                raise from_engine_error(error, self.state.config.retry_after_s) from error

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self.prompts)
        try:
            while remaining:
                index, item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise from_engine_error(item, self.state.config.retry_after_s) from item
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
    """What has been streamed of each choice: turns cumulative outputs into deltas.

    The engine's cumulative text only grows (it holds back what a stop string may still cut), so
    a delta is the text past what was sent.
    """

    chars: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    def advance(self, index: int, completion) -> Delta | None:
        """The delta of choice ``index`` (None when there is nothing new to send)."""
        if index in self.finished:
            return None
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


async def until_disconnected(request: Request) -> None:
    """Returns when the client hangs up (call only after the body has been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work):
    """Await ``work`` (a coroutine); if the client disconnects first, cancel it and raise."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    raise ClientDisconnected()


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_event(error: APIError) -> str:
    return sse(json.dumps(error.body()))


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that aborts its engine requests however the response ends.

    When the client goes away while a chunk is being *sent* (not while the body iterator waits
    for the engine), Starlette stops without closing the body iterator, so the ``finally`` in
    ``EngineStreams.__aiter__`` would only run when the garbage collector gets to it; until then
    the requests would go on computing for nobody. Cancelling here, after the response, in every
    case (done, disconnected, failed), frees their blocks at once.
    """

    def __init__(self, content: AsyncIterator[str], streams: EngineStreams) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.streams.cancel()
