"""A request as the scheduler sees it: tokens, how many are computed, and when to stop.

There is no prefill phase and no decode phase. A request knows ``num_tokens`` tokens (prompt plus
output so far) of which ``num_computed_tokens`` have keys and values in the cache. Each step the
scheduler gives it some of the rest: a prefill chunk while the prompt is being read, one token
once it is generating.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar, overload

from pagedserve.blockmgr import ImagePlaceholder


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # admitted with blocks whose keys and values a KV connector is still loading: it waits in
    # the queue (others pass it) until they arrive or fail (vLLM's WAITING_FOR_REMOTE_KVS)
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self._value_ in _FINISHED_VALUES

    @property
    def finish_reason(self) -> str | None:
        value = self._value_
        return value if value in _FINISHED_VALUES else None


class TokenIds(Sequence[int]):
    """A request's prompt then output tokens as one read-only sequence, without copying them.

    The scheduler and the block manager read every running request's tokens at every step;
    concatenating the two lists each time would copy whole sequences per step. The view reads
    the request's lists at each access, so one view per request serves its whole life.
    """

    __slots__ = ("_request",)

    def __init__(self, request: Request) -> None:
        self._request = request

    def __len__(self) -> int:
        request = self._request
        return len(request.prompt_token_ids) + len(request.output_token_ids)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index):
        prompt, output = self._request.prompt_token_ids, self._request.output_token_ids
        n = len(prompt)
        if isinstance(index, slice):
            start, stop, step = index.indices(n + len(output))
            if step != 1:
                return list(self)[index]
            if stop <= n:
                return prompt[start:stop]
            if start >= n:
                return output[start - n : stop - n]
            return prompt[start:] + output[: stop - n]
        if index < 0:
            index += n + len(output)
        return prompt[index] if index < n else output[index - n]

    def __iter__(self):
        yield from self._request.prompt_token_ids
        yield from self._request.output_token_ids

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Sequence)
            and len(self) == len(other)
            and all(a == b for a, b in zip(self, other))
        )

    def __repr__(self) -> str:
        return f"TokenIds({list(self)!r})"


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)
# Membership by value (a str, hashed in C): every running request asks several times a step,
# and a member's own hash is Python code (Enum.__hash__).
_FINISHED_VALUES = frozenset(status.value for status in _FINISHED)

PayloadT = TypeVar("PayloadT")


@dataclass(eq=False, slots=True)
class Request(Generic[PayloadT]):
    """One sequence being generated.

    ``stop_token_ids`` already holds the EOS token unless the request ignores EOS. The engine
    keeps what the scheduler does not need (sampling parameters, detokenizer) in ``payload``,
    whose type is the engine's (``Request[SequenceState]``): the scheduler never reads it.
    ``needs_prompt_logits`` is the engine's word to the model runner: while it is set, the
    runner also computes the logits of the prompt positions it runs (prompt logprobs).
    ``spec_token_ids`` are the engine's proposals for the tokens after the last one (speculative
    decoding): the next decode step verifies them with it, and takes them off the request.
    ``waiting_for_grammar`` is another: while it is set (structured outputs, the grammar still
    compiling) the request stays in the waiting queue, and requests behind it may pass.
    ``lora_int_id`` is the LoRA adapter it runs with (0: the base model): part of its blocks'
    prefix hashes, and counted against ``SchedulerConfig.max_loras``.
    ``kv_transfer_params`` are the request's words to a KV connector (vLLM's field: a
    disaggregated prefill's ``do_remote_decode``, or a decode's handle of the blocks to fetch);
    the scheduler only hands them on, and the connector may replace them with what the caller
    gets back when the request finishes (a prefill's transfer handle).
    ``pooling`` marks a prefill-only request (embeddings, scores): it generates nothing
    (``max_tokens`` 0), is batched and chunked as any prompt, and finishes as soon as its last
    prompt token is computed, freeing its blocks in that same step; the runner's pooled
    output is its result.
    ``images`` are where the prompt's images sit (placeholder tokens) and their content hashes:
    hashed into the prefix cache's blocks, and what the encoder cache (encoder_cache.py)
    schedules. The engine's items carry the pixels too, which the scheduler never reads.

    Invariant while running: ``num_computed_tokens < num_tokens`` (there is always a next token
    or prefill chunk to compute). While waiting: ``num_computed_tokens == 0``; the prefix-cache
    lookup at admission decides where computing starts.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    lora_int_id: int = 0
    payload: PayloadT | None = None
    needs_prompt_logits: bool = False
    waiting_for_grammar: bool = False
    pooling: bool = False
    kv_transfer_params: dict | None = None
    images: Sequence[ImagePlaceholder] = ()

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first admission
    arrival_order: int = -1  # set by the scheduler: breaks ties between equal arrival times
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    # prompt then output tokens, as a view (slice it for a list)
    all_token_ids: TokenIds = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.all_token_ids = TokenIds(self)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status._value_ in _FINISHED_VALUES

    @property
    def is_held(self) -> bool:
        """Waiting for something other than room: its grammar to compile, or its keys and
        values to arrive from a KV connector. Requests behind it in the queue may pass it."""
        return self.waiting_for_grammar or self.status is RequestStatus.WAITING_FOR_REMOTE_KVS

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """The stop condition the last output token met, if any (stop strings: the engine)."""
        num_output = len(self.output_token_ids)
        if not num_output:
            return None
        last = self.output_token_ids[-1]
        if last in self.stop_token_ids and num_output >= self.min_tokens:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if num_output >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
