"""Pooling requests in the engine: how one is admitted, and the one output it makes.

A pooling request (``LLMEngine.add_request`` with ``PoolingParams``) is one prefill-only
sequence: the scheduler batches and chunks its prompt as any other (``Request.pooling``) and
finishes it at the step that computes its last prompt token; the runner's pooled output for it
arrives in that step's ``ModelRunnerOutput.pooler_output``, and the output processor turns it
into the request's one ``PoolingRequestOutput``. Nothing is detokenized, nothing sampled.

A causal model that pools more than the last row (MEAN or CLS from a sentence-transformers
config) needs every prompt row computed, so such a request bypasses the prefix cache (a salt of
its own, as prompt logprobs do); last-token pooling may start from a cached prefix, since the
last prompt token is always computed.
"""

from __future__ import annotations

import secrets

from pagedserve.engine.errors import InvalidRequestError, RequestRejectedError
from pagedserve.engine.input_batch import PoolingState
from pagedserve.engine.outputs import PoolingOutput, PoolingRequestOutput, RequestMetrics
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.validation import check_token_ids
from pagedserve.models import ModelConfig, Pooler, PoolingType
from pagedserve.scheduler import Request, Scheduler


class PoolingGroup:
    """A pooling request as the engine keeps it (the output processor's group): its one
    sequence, and its result once the runner has pooled it."""

    pending_forks: dict = {}  # noqa: RUF012 - never forks; read-only, shared
    has_new_output = True  # a pooling request is only touched when it finishes

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: PoolingParams, metrics: RequestMetrics) -> None:  # fmt: skip
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.metrics = metrics
        self.sequences: list[Request] = []
        self.aborted = False
        self.result = None

    def num_output_tokens(self, output) -> int:
        return 0

    def make_output(self) -> PoolingRequestOutput:
        sequence = self.sequences[0]
        return PoolingRequestOutput(
            request_id=self.request_id,
            outputs=PoolingOutput(None if self.aborted else self.result),
            prompt_token_ids=self.prompt_token_ids,
            finished=self.aborted or sequence.is_finished,
            num_cached_tokens=max(sequence.num_cached_tokens, 0),
            metrics=self.metrics,
        )


def check_pooling_request(model_config: ModelConfig, params) -> None:
    """Only a pooling model serves a pooling request, and it serves nothing else."""
    mc = model_config
    if mc.runner_type != "pooling":
        raise InvalidRequestError(
            f"the model {mc.model} generates text; pooling requests (embeddings, scores, "
            "classes) need a pooling model (--runner pooling)",
            "model",
        )
    if not isinstance(params, PoolingParams):
        raise InvalidRequestError(
            f"the model {mc.model} is a pooling model ({mc.pooling_task}): it generates no "
            "text; send PoolingParams (LLM.embed, LLM.classify, LLM.score)",
            "model",
        )


def pooling_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: PoolingParams,
    model_config: ModelConfig,
    pooler: Pooler | None,
    *,
    prompt: str | None,
    arrival_time: float,
    priority: int,
    token_type_ids: list[int] | None,
) -> tuple[Request, PoolingState, PoolingGroup]:
    """The scheduler's request, the runner's state and the engine's group of a pooling
    request, or ``InvalidRequestError`` naming the field at fault."""
    check_pooling_request(model_config, params)
    check_token_ids(prompt_token_ids, None, model_config.vocab_size)
    params.verify(pooler.task, model_config.hidden_size, model_config.matryoshka_dimensions)
    prompt_ids = params.truncated(list(prompt_token_ids), model_config.max_model_len)
    if token_type_ids is not None:
        if len(token_type_ids) != len(prompt_token_ids):
            raise InvalidRequestError(
                f"token_type_ids has {len(token_type_ids)} entries for a prompt of "
                f"{len(prompt_token_ids)} tokens",
                "token_type_ids",
            )
        token_type_ids = token_type_ids[len(token_type_ids) - len(prompt_ids) :]
    whole_prompt = pooler.pooling_type is not PoolingType.LAST and not model_config.is_encoder_only
    request = Request(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        max_tokens=0,
        priority=priority,
        arrival_time=arrival_time,
        cache_salt=secrets.token_hex(8) if whole_prompt else None,
        pooling=True,
    )
    group = PoolingGroup(request_id, prompt, prompt_ids, params, RequestMetrics(arrival_time))
    group.sequences.append(request)
    state = PoolingState(request, params, token_type_ids, group=group)
    request.payload = state
    return request, state, group


def add_to_scheduler(scheduler: Scheduler, request: Request) -> None:
    """Queue a pooling request; the scheduler's refusal as the engine's."""
    try:
        scheduler.add_request(request)
    except RequestRejectedError as e:
        raise InvalidRequestError(str(e), e.param) from e
