"""POST /v1/chat/completions/batch: vLLM's batched chat, several conversations in one body.

The body is a chat request whose ``messages`` is a list of conversations; every other field
applies to each of them. The answer is one chat completion whose choice ``i`` answers
conversation ``i`` (its usage the sum over them). Each conversation is planned exactly as
/v1/chat/completions plans one (the same checks, template and defaults), and all of them run
concurrently as one engine request each. As vLLM's, the route answers in one body: no stream,
no tool calls, no beam search, one choice per conversation, and no prompt logprobs (vLLM's batch
answer has no place for them; it computes them for nothing, pagedserve refuses them), nor
kv_transfer_params (a disaggregated prefill's handle is one prompt's).
"""

from __future__ import annotations

import dataclasses

from starlette.requests import Request
from starlette.responses import Response

from pagedserve.engine import RequestOutput
from pagedserve.server.chat_prompt import plan_prompt
from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionTokensDetails,
    UsageInfo,
)
from pagedserve.server.request_params import response_id
from pagedserve.server.serving_chat import ChatView
from pagedserve.server.sse import answer
from pagedserve.server.state import ServerState, new_id
from pagedserve.server.streams import EngineStreams

ROUTE = "/v1/chat/completions/batch"


def check_batch(state: ServerState, body: BatchChatCompletionRequest) -> None:
    """What the batch route does not do, refused by name before any work."""
    for name, used in (
        ("stream", body.stream),
        ("tools", bool(body.tools)),
        ("use_beam_search", body.use_beam_search),
        ("prompt_logprobs", body.prompt_logprobs is not None),
        ("kv_transfer_params", body.kv_transfer_params is not None),  # one handle per prompt
    ):
        if used:
            raise bad_request(f"{name} is not supported on {ROUTE}", name)
    if body.n != 1:
        raise bad_request(f"n must be 1 on {ROUTE}: choice i answers conversation i", "n")
    limit = state.config.max_prompts
    if len(body.messages) > limit:
        raise bad_request(
            f"at most {limit} conversations per request, got {len(body.messages)}", "messages"
        )


def conversation_request(body: BatchChatCompletionRequest, messages: list) -> ChatCompletionRequest:
    """Conversation ``messages`` as a chat request with the batch's other fields (and the same
    fields counted as sent, for the defaults that depend on it)."""
    values = {name: getattr(body, name) for name in ChatCompletionRequest.model_fields}
    values["messages"] = messages
    return ChatCompletionRequest.model_construct(_fields_set=body.model_fields_set, **values)


async def create_batch_chat_completion(
    request: Request, state: ServerState, body: BatchChatCompletionRequest
) -> Response:
    state.check_admitting()
    check_batch(state, body)
    conversations = [conversation_request(body, messages) for messages in body.messages]
    plans = [await plan_prompt(state, conversation) for conversation in conversations]
    prompts = [dataclasses.replace(p, index=i) for i, (p, _, _) in enumerate(plans)]
    aliases = plans[0][1]
    streams = EngineStreams(state, new_id("chatcmpl"), prompts, body.priority, aliases, body.model)
    answer_id = response_id("chatcmpl", body)
    views = [
        ChatView(state, conversation, answer_id, prompt.prompt_token_ids, plan)
        for conversation, prompt, (_, _, plan) in zip(conversations, prompts, plans, strict=True)
    ]

    def response(finals: dict[int, RequestOutput]) -> ChatCompletionResponse:
        answers = [view.response(finals[i]) for i, view in enumerate(views)]
        choices = [a.choices[0].model_copy(update={"index": i}) for i, a in enumerate(answers)]
        usage = summed_usage([a.usage for a in answers])
        first = answers[0]
        return ChatCompletionResponse(
            id=first.id, created=first.created, model=first.model, choices=choices, usage=usage
        )

    return await answer(request, streams, views[0].stream, response, stream=False)


def summed_usage(usages: list[UsageInfo]) -> UsageInfo:
    """The batch's usage: the conversations' summed (their thinking tokens too, when a
    reasoning parser counts them)."""
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    details = [u.completion_tokens_details for u in usages if u.completion_tokens_details]
    thinking = (
        CompletionTokensDetails(reasoning_tokens=sum(d.reasoning_tokens for d in details))
        if details
        else None
    )
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        completion_tokens_details=thinking,
    )
