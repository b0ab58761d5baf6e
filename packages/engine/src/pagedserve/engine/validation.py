"""The engine's checks of a request against the model, before it reaches the scheduler.

Each check has one owner: SamplingParams checks its own fields when it is built; these check
what needs the model (token ids inside its vocabulary) and resolve what depends on its context
length (the default ``max_tokens``); the scheduler's admission checks its own limits (an empty
prompt, ``max_model_len``, the KV cache's capacity). Every refusal is an ``InvalidRequestError``
naming the field at fault.
"""

from __future__ import annotations

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.sampling_params import SamplingParams


def check_token_ids(
    prompt_token_ids: list[int], params: SamplingParams | None, vocab_size: int
) -> None:
    """Every token id the request names must be a token of this model (``params`` None: a
    pooling request names only its prompt's). The refusal says "out of vocabulary", as vLLM's
    does: clients match that phrase."""
    bad = next(
        (t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None
    )
    if bad is not None:
        raise InvalidRequestError(
            f"Token id {bad} is out of vocabulary: prompt token ids must be integers in "
            f"[0, {vocab_size})",
            "prompt",
        )
    if params is None:
        return
    for name, ids in (
        ("logit_bias", params.logit_bias or {}),
        ("stop_token_ids", params.stop_token_ids),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("thinking_start_token_ids", params.thinking_start_token_ids or ()),
        ("thinking_end_token_ids", params.thinking_end_token_ids or ()),
    ):
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"{name} token ids must be in [0, {vocab_size}), got {bad}, which is out of "
                "vocabulary",
                name,
            )


def check_logprobs(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """``logprobs`` and ``prompt_logprobs`` within the engine's cap (``max_logprobs``, -1 for
    the whole vocabulary), as vLLM bounds them: each costs a top-k over the vocabulary."""
    cap = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > cap:
            whole = (
                f"; the whole vocabulary ({vocab_size}, what -1 asks for) needs --max-logprobs -1"
                if value >= vocab_size
                else ""
            )
            raise InvalidRequestError(
                f"{name} must be in [0, {cap}] (the server's --max-logprobs), got {value}{whole}",
                name,
            )


def resolve_max_tokens(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> int:
    """``params.max_tokens``, or all the room ``max_model_len`` leaves after the prompt.

    A prompt that leaves no room at all is the scheduler's refusal (it names the prompt).
    """
    if params.max_tokens is not None:
        return params.max_tokens
    room = max_model_len - num_prompt_tokens
    if 0 < room < params.min_tokens:
        raise InvalidRequestError(
            f"min_tokens must be <= max_tokens, got {params.min_tokens} > {room} (the room "
            "max_model_len leaves after the prompt)",
            "min_tokens",
        )
    return room


def check_kv_transfer_params(params: SamplingParams, kv_connector) -> dict | None:
    """The request's ``kv_transfer_params`` (vLLM's ``extra_args``), as the engine's KV
    connector checks them; refused by an engine without a connector that transfers blocks."""
    transfer = params.kv_transfer_params
    if transfer is None:
        return None
    if kv_connector is None:
        raise InvalidRequestError(
            "kv_transfer_params need an engine started with --kv-transfer-config (a "
            "disaggregated prefill or decode engine); this one has none",
            "kv_transfer_params",
        )
    kv_connector.check_transfer_params(transfer)
    return transfer
