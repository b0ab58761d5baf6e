"""vLLM's request fields beyond OpenAI's, shared by /v1/completions and /v1/chat/completions.

Kept apart from protocol.py so the request models there take them with one base class. What the
routes do with them is vllm_fields.py's and request_params.py's; which are refused, and why,
field_coverage.py's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RefusedVLLMFields(_Model):
    """vLLM's request fields that pagedserve does not implement yet: declared so that a request
    sending one is refused with a 400 naming it (field_coverage.py says why each is), never
    accepted and ignored."""

    bad_words: list[StrictStr] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    logits_processors: list[Any] | None = None
    logprob_token_ids: list[StrictInt] | None = None
    extra_args: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    watermarking: bool | None = None
    stream_interval: StrictInt | None = None
    cache_salt: StrictStr | None = None
    ec_transfer_params: dict[str, Any] | None = None
    routed_experts_prompt_start: StrictInt = 0
    return_token_offsets: bool | None = None
    return_mm_kwargs: bool = True
    guided_decoding_backend: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None


class VLLMSamplingFields(RefusedVLLMFields):
    """vLLM's request fields beyond OpenAI's, shared by both generation routes (the server's
    handling of them is in vllm_fields.py)."""

    prompt_logprobs: StrictInt | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False
    return_token_ids: bool = False
    # None: the server's --return-tokens-as-token-ids decides
    return_tokens_as_token_ids: bool | None = None
    spaces_between_special_tokens: bool = True
    truncation_side: Literal["left", "right"] | None = None
    request_id: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    session_id: StrictStr | None = None
    # vLLM's thinking budget; honoured only where it cannot bind (field_coverage.py)
    thinking_token_budget: StrictInt | None = None
    # vLLM's disaggregated prefill/decode: the words to the engine's KV connector (a
    # prefill's do_remote_decode, a decode's transfer handle); the answer carries its own
    kv_transfer_params: dict[str, Any] | None = None
