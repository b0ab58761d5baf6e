"""From a validated request body to SamplingParams: the server's own caps, then the engine's.

The server checks only what is its own: the model name it serves, and the caps of its
ServerConfig (``n``, the number and length of stop strings, ``logit_bias`` entries), which bound
the work one request may ask for. Everything else has one owner, and its refusal names the field
at fault: SamplingParams checks the sampling ranges (here, while it is built), the engine checks
the request against the model (token ids in the vocabulary, the prompt and ``max_tokens`` within
``max_model_len``) when the request is submitted. ``aliases`` turns the engine's field names into
the API's where they differ, so that a 400 names the field the client sent.
"""

from __future__ import annotations

from pagedserve.engine import RequestOutputKind, SamplingParams
from pagedserve.engine.structured_output import StructuredOutputsParams
from pagedserve.server.errors import bad_request, from_invalid_request
from pagedserve.server.field_coverage import refuse_unsupported
from pagedserve.server.protocol import SamplingRequest
from pagedserve.server.state import ServerState, model_not_found, new_id
from pagedserve.server.vllm_fields import (
    check_stream_options,
    extra_sampling_kwargs,
    whole_vocabulary,
)

MAX_LOGIT_BIAS_ENTRIES = 1024


def check_model(state: ServerState, name: str | None) -> None:
    """A request may name the served model, one of its LoRA adapters, or no model at all."""
    if name is not None and name != state.model_name and name not in state.lora_modules:
        raise model_not_found(name, [state.model_name, *state.lora_modules])


def check_caps(state: ServerState, body: SamplingRequest) -> None:
    """The served model's name, and the server's caps on what one request may ask for (and
    ``prompt_logprobs: -1`` resolved to the vocabulary's size)."""
    cfg = state.config
    check_model(state, body.model)
    refuse_unsupported(body)
    check_stream_options(body)
    whole_vocabulary(body, "prompt_logprobs", state.engine.model_config.vocab_size)
    if not 1 <= body.n <= cfg.max_n:
        raise bad_request(f"n must be in [1, {cfg.max_n}], got {body.n}", "n")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > cfg.max_stop:
        raise bad_request(f"at most {cfg.max_stop} stop strings, got {len(stops)}", "stop")
    if any(len(s) > cfg.max_stop_length for s in stops):
        raise bad_request(f"stop strings must be at most {cfg.max_stop_length} characters", "stop")
    if len(body.stop_token_ids or []) > cfg.max_stop:
        raise bad_request(f"at most {cfg.max_stop} stop token ids", "stop_token_ids")


def parse_logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as string keys; SamplingParams and the engine check the values."""
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(
            f"logit_bias has more than {MAX_LOGIT_BIAS_ENTRIES} entries", "logit_bias"
        )
    parsed = {}
    for key, value in bias.items():
        try:
            parsed[int(key)] = value
        except ValueError:
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
    return parsed


def truncated_prompt(body: SamplingRequest, prompt_ids: list[int], num_images: int = 0):
    """vLLM's ``truncate_prompt_tokens``: keep the last k tokens (``truncation_side`` "left",
    the default) or the first k ("right"). Refused for a prompt with images: a cut inside an
    image's rows would leave half an image."""
    k = body.truncate_prompt_tokens
    if k is None:
        return prompt_ids
    if num_images:
        raise bad_request(
            "truncate_prompt_tokens cannot cut a prompt with images (a cut inside an image's "
            "rows would leave half an image)",
            "truncate_prompt_tokens",
        )
    return prompt_ids[:k] if body.truncation_side == "right" else prompt_ids[-k:]


def response_id(prefix: str, body: SamplingRequest) -> str:
    """The response's id: vLLM's ``<prefix>-<request_id>`` when the client gave one (the
    engine's own request ids stay unique: streams.py adds the prompt index)."""
    return f"{prefix}-{body.request_id}" if body.request_id else new_id(prefix)


def output_kind_of(body: SamplingRequest) -> RequestOutputKind:
    """What the route needs of the engine's outputs (as vLLM's server asks): a stream sends
    deltas (DELTA), a plain response only reads the final output (FINAL_ONLY). A streamed beam
    search sends its beams only at the end but starts its stream at the first output, so it
    takes cumulative ones (beams reorder: they have no deltas)."""
    if not body.stream:
        return RequestOutputKind.FINAL_ONLY
    if body.use_beam_search:
        return RequestOutputKind.CUMULATIVE
    return RequestOutputKind.DELTA


def build_sampling_params(
    body: SamplingRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    aliases: dict[str, str],
    defaults: dict | None = None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
    keep_special_tokens: bool = False,
    thinking: dict | None = None,
) -> SamplingParams:
    """The SamplingParams of each prompt's engine request (with the request's ``n``).

    A field the request leaves out takes ``defaults`` (the model's generation_config, as the
    engine's ``model_config.generation_defaults.sampling``), else SamplingParams' default.
    ``max_tokens=None`` with no default asks for as many tokens as ``max_model_len`` leaves.
    ``structured_outputs``: the request's constraint (structured.py reads it from the body).
    ``keep_special_tokens``: the reply must keep them (a tool parser's markers are special).
    ``thinking``: the thinking budget's fields (reasoning.thinking_budget).
    """
    defaults = defaults or {}

    def given(value, default, name=None):
        return defaults.get(name, default) if value is None else value

    kwargs = {
        "temperature": given(body.temperature, 1.0, "temperature"),
        "best_of": getattr(body, "best_of", None),  # completions only: the beam width
        **extra_sampling_kwargs(body, prompt_logprobs),
        **(thinking or {}),
    }
    try:
        return SamplingParams(
            n=body.n,
            top_p=given(body.top_p, 1.0, "top_p"),
            top_k=given(body.top_k, 0, "top_k"),
            min_p=given(body.min_p, 0.0, "min_p"),
            presence_penalty=given(body.presence_penalty, 0.0),
            frequency_penalty=given(body.frequency_penalty, 0.0),
            repetition_penalty=given(body.repetition_penalty, 1.0, "repetition_penalty"),
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos,
            max_tokens=given(max_tokens, None, "max_tokens"),
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            logit_bias=parse_logit_bias(body.logit_bias),
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words,
            skip_special_tokens=body.skip_special_tokens and not keep_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            structured_outputs=structured_outputs,
            output_kind=output_kind_of(body),
            **kwargs,
        )
    except ValueError as e:  # InvalidRequestError, naming the field
        raise from_invalid_request(e, aliases) from e
