"""What the engine returns (RequestOutput and CompletionOutput, shaped like vLLM's; a pooling
request's PoolingRequestOutput), and what the model runner returns to the engine each step
(ModelRunnerOutput).

A DELTA stream makes one of each per running request per step, so they are slotted dataclasses:
no per-object ``__dict__``, so they are cheaper to make and to read (vLLM keeps its output objects
as lean, for the same reason).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagedserve.engine.spec_decode.verify import VerifyCounts


class Logprob(float):
    """A token's log-probability, a float, that also carries the token's rank in its position's
    distribution (1: the likeliest; the number of tokens at least as likely, itself included),
    as vLLM's ``Logprob`` does: ``.logprob`` and ``.rank`` read as vLLM's, and code that takes
    a logprob as a number keeps working."""

    __slots__ = ("rank",)

    def __new__(cls, logprob: float, rank: int) -> Logprob:
        value = float.__new__(cls, logprob)
        value.rank = rank
        return value

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self):  # slots and a float subclass: pickle (Ray, the cluster) by value
        return Logprob, (float(self), self.rank)


Logprobs = dict[int, Logprob]  # {token id: logprob}: the top N of a position, then the actual one


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (a request with n > 1 has n of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_delta(self, delta: CompletionOutput) -> None:
        """Append a later DELTA output of this sequence: its text, token ids and logprobs
        (this output's lists are extended in place); the rest is the newer one's."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (time.monotonic seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        return (
            None
            if self.first_scheduled_time is None
            else self.first_scheduled_time - self.arrival_time
        )

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """One request's news from a step: cumulative, a delta, or the final output, as its
    ``SamplingParams.output_kind`` asks (sampling_params.RequestOutputKind)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # a KV connector's word to the caller, on the finished output (a prefill's transfer handle)
    kv_transfer_params: dict | None = None

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request into this one (vLLM's ``RequestOutput.add``).

        ``aggregate``: the outputs are deltas, so text, token ids and logprobs are appended;
        else each completion is replaced by its newer snapshot. A consumer that falls behind
        collapses what is queued into one output this way (AsyncLLM's stream). This output's
        lists must be its own (a delta's are fresh slices), since they are extended in place.
        """
        self.finished |= next_output.finished
        self.metrics = next_output.metrics
        self.num_cached_tokens = next_output.num_cached_tokens
        if next_output.prompt_logprobs is not None:
            self.prompt_logprobs = next_output.prompt_logprobs
        if next_output.kv_transfer_params is not None:
            self.kv_transfer_params = next_output.kv_transfer_params
        by_index = {completion.index: i for i, completion in enumerate(self.outputs)}
        for completion in next_output.outputs:
            i = by_index.get(completion.index)
            if i is None:
                by_index[completion.index] = len(self.outputs)
                self.outputs.append(completion)
            elif not aggregate:
                self.outputs[i] = completion
            else:
                self.outputs[i].add_delta(completion)


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step computed, by request id: the one contract between the runner and the
    engine, which never learns in which row of the logits a request sat.

    ``sampled_token_ids``: each sequence that reached its last known token, its new token (an
    int), or under speculative decoding its new tokens (a list: the accepted proposals, then the
    target's own token); an ``n > 1`` request's first step adds its forks, under their own ids. ``logprobs``: for the
    sequences that report them, one entry per sampled token. ``prompt_logprobs``: per request
    that asked, (first position, entries) for the prompt positions computed this step; the
    entry at position p scores prompt token p + 1. ``beam_logprobs``: a beam's raw
    log-probabilities ``[V]`` (beams are not sampled: their group steps them all at once).
    ``spec_decode``: the step's verification counts, when it verified proposals.
    ``pooler_output``: each pooling request whose last prompt chunk ran this step, its output
    (a float32 vector on the host: an embedding, or class scores), before the request's own
    options (dimensions, activation) are applied.
    """

    sampled_token_ids: dict[str, int | list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] = field(default_factory=dict)
    beam_logprobs: dict[str, torch.Tensor] = field(default_factory=dict)
    spec_decode: VerifyCounts | None = None
    pooler_output: dict[str, torch.Tensor] = field(default_factory=dict)
    # a KV connector's asynchronous loads that ended: request id -> tokens its blocks now hold
    finished_kv_loads: dict[str, int] | None = None


@dataclass(slots=True)
class PoolingOutput:
    """A pooling request's result (vLLM's): ``data``, a float32 tensor (an embedding or
    class probabilities); None when the request was aborted."""

    data: torch.Tensor | None

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def probs(self) -> list[float]:
        return self.data.tolist()

    @property
    def score(self) -> float:
        """A relevance score: the output's one value."""
        return float(self.data.reshape(-1)[0])


@dataclass(slots=True)
class PoolingRequestOutput:
    """The one output of a pooling request (vLLM's ``PoolingRequestOutput``; ``LLM.embed``,
    ``LLM.classify`` and ``LLM.score`` read ``outputs.embedding``, ``.probs``, ``.score``)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None

    @property
    def aborted(self) -> bool:
        return self.outputs.data is None
