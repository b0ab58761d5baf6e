"""vLLM's request fields beyond OpenAI's, as the two generation routes handle them.

- ``max_tokens`` defaults as vLLM's: 16 for /v1/completions, the room ``max_model_len`` leaves
  after the prompt for chat (and for an explicit ``null``). A default is capped by that room,
  so a request is never refused for a ``max_tokens`` it did not send.
- ``prompt_logprobs`` (and ``echo`` with ``logprobs``, which needs the prompt's logprobs), and
  chat's ``top_logprobs``: ``-1`` asks for the whole vocabulary, as vLLM allows (within the
  engine's ``--max-logprobs``, which must then be -1 or the vocabulary's size);
  beam search (``use_beam_search``: ``n`` beams, or ``best_of``; ``length_penalty``,
  ``early_stopping``), which takes no temperature, so an unsent one is 0 here;
- ``stream_options`` only with ``stream: true`` (OpenAI and vLLM refuse it otherwise).

``return_token_ids`` and ``return_tokens_as_token_ids`` shape the responses (the views, and
logprobs.py); the latter, and the usage a stream reports, default to the server's flags of the
same names (``--return-tokens-as-token-ids``, ``--enable-force-include-usage``), as vLLM's.
"""

from __future__ import annotations

from pagedserve.server.config import ServerConfig
from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import SamplingRequest

COMPLETION_DEFAULT_MAX_TOKENS = 16


def check_stream_options(body: SamplingRequest) -> None:
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def whole_vocabulary(body, name: str, vocab_size: int) -> None:
    """Field ``name`` of ``body`` (a number of logprobs) with vLLM's ``-1`` read as the whole
    vocabulary, in place; any other negative number is refused in vLLM's words."""
    value = getattr(body, name)
    if value == -1:
        setattr(body, name, vocab_size)
    elif value is not None and value < 0:
        raise bad_request(f"`{name}` must be a positive value or -1.", name)


def stream_usage(body: SamplingRequest, config: ServerConfig) -> tuple[bool, bool]:
    """(a usage chunk ends the stream, every chunk carries the usage so far) of a request.

    ``stream_options.include_usage`` asks for the first, ``continuous_usage_stats`` with it for
    the second; ``--enable-force-include-usage`` gives every stream the first, as vLLM's."""
    options = body.stream_options
    include = bool(body.stream) and (
        config.enable_force_include_usage or bool(options and options.include_usage)
    )
    return include, include and bool(options and options.continuous_usage_stats)


def tokens_as_token_ids(body: SamplingRequest, config: ServerConfig) -> bool:
    """Whether logprobs name tokens ``token_id:N``: the request's field, else the server's."""
    if body.return_tokens_as_token_ids is None:
        return config.return_tokens_as_token_ids
    return body.return_tokens_as_token_ids


def default_max_tokens(
    sent: int | None,
    was_sent: bool,
    num_prompt_tokens: int,
    max_model_len: int,
    default: int | None,
) -> int | None:
    """``max_tokens`` for one prompt: what was sent, else ``default`` (None: all the room)
    capped by the room the prompt leaves. None (no room at all) lets the engine refuse the
    prompt, naming it."""
    if sent is not None:
        return sent
    room = max_model_len - num_prompt_tokens
    if room < 1:
        return None
    if was_sent or default is None:  # an explicit null, or chat: the whole room
        return room
    return min(default, room)


def extra_sampling_kwargs(body: SamplingRequest, prompt_logprobs: int | None) -> dict:
    """SamplingParams fields from vLLM's request fields (beam search and prompt logprobs)."""
    kwargs: dict = {"prompt_logprobs": prompt_logprobs}
    if body.kv_transfer_params is not None:  # vLLM's way to the engine's KV connector
        kwargs["extra_args"] = {"kv_transfer_params": body.kv_transfer_params}
    if body.use_beam_search:
        kwargs.update(
            use_beam_search=True,
            length_penalty=body.length_penalty,
            early_stopping=body.early_stopping,
            temperature=0.0 if body.temperature is None else body.temperature,
        )
    return kwargs
