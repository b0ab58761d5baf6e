"""No silent fields: every field of every request model (nested ones included) is handled by
its route or refused with a 400 naming it; every field vLLM documents on its completion and chat
requests is declared (so none is accepted and ignored unseen); each refused field is refused
through the server, and accepted when sent with no effect."""

from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel

from pagedserve.server.field_coverage import (
    HANDLED,
    REQUEST_MODELS,
    reachable_models,
    refused_fields,
    uncovered_fields,
)
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.server.protocol_responses import ResponsesRequest
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL

# vLLM's request fields (its CompletionRequest and ChatCompletionRequest, as documented, with
# the older names it still accepted until recently).
VLLM_COMMON = """model frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop
stream stream_options temperature top_p user use_beam_search top_k min_p repetition_penalty
watermarking length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens
skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side
allowed_token_ids prompt_logprobs logprob_token_ids bad_words add_special_tokens
response_format structured_outputs priority request_id session_id return_tokens_as_token_ids
return_token_ids routed_experts_prompt_start return_token_offsets return_mm_kwargs cache_salt
kv_transfer_params ec_transfer_params vllm_xargs repetition_detection thinking_token_budget
stream_interval logits_processors guided_json guided_regex guided_choice guided_grammar
guided_decoding_backend guided_whitespace_pattern""".split()
VLLM_COMPLETION = [*VLLM_COMMON, "prompt", "echo", "suffix", "best_of", "prompt_embeds"]
VLLM_CHAT = [
    *VLLM_COMMON,
    *"""messages max_completion_tools top_logprobs tools tool_choice reasoning_effort
    include_reasoning parallel_tool_calls echo add_generation_prompt continue_final_message
    documents chat_template chat_template_kwargs media_io_kwargs mm_processor_kwargs
    return_prompt_text""".replace("max_completion_tools", "max_completion_tokens").split(),
]


def test_every_field_of_every_request_model_is_handled_or_refused():
    models = reachable_models(REQUEST_MODELS)
    assert {m.__name__ for m in models} <= set(HANDLED), "a request model without an account"
    for model in models:
        assert uncovered_fields(model) == [], model.__name__
        refused = set(refused_fields(model))
        assert not refused & HANDLED[model.__name__], model.__name__
        assert HANDLED[model.__name__] <= set(model.model_fields), f"stale: {model.__name__}"


def test_a_new_field_without_an_account_is_caught():
    grown = type(
        "ChatCompletionRequest",
        (ChatCompletionRequest,),
        {"__annotations__": {"new_knob": int}, "new_knob": 0},
    )
    assert uncovered_fields(grown) == ["new_knob"]


@pytest.mark.parametrize(
    "model, names",
    [(CompletionRequest, VLLM_COMPLETION), (ChatCompletionRequest, VLLM_CHAT)],
    ids=["completions", "chat"],
)
def test_every_vllm_field_is_declared(model: type[BaseModel], names):
    assert sorted(set(names) - set(model.model_fields)) == []


# A value with an effect for each refused field.
SENT = {
    "bad_words": ["cache"],
    "allowed_token_ids": [5, 6],
    "logits_processors": ["my_module.MyProcessor"],
    "logprob_token_ids": [5],
    "extra_args": {"k": 1},
    "vllm_xargs": {"k": 1},
    "repetition_detection": {"max_pattern_size": 4, "min_count": 3},
    "watermarking": True,
    "stream_interval": 4,
    "cache_salt": "salt",
    "ec_transfer_params": {"x": 1},
    "routed_experts_prompt_start": 3,
    "return_token_offsets": True,
    "return_mm_kwargs": False,
    "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " *",
    "prompt_embeds": "AAAA",
    "chat_template": "{{ messages }}",
    "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"x": 1},
    "return_prompt_text": True,
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "audio": {"voice": "alloy"},
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "add_special_tokens": True,
    "modalities": ["text", "audio"],
    "store": True,
    "background": True,
    "include": ["reasoning.encrypted_content"],
}
BASES = {
    CompletionRequest: ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1}),
    ChatCompletionRequest: (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    ),
    ResponsesRequest: ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 1}),
}
CASES = [(m, name) for m in BASES for name in refused_fields(m)]


def test_every_refused_field_has_a_case():
    assert {name for _, name in CASES} <= set(SENT)


@pytest.mark.parametrize("model, name", CASES, ids=[f"{m.__name__}-{n}" for m, n in CASES])
def test_a_refused_field_is_a_400_naming_it(client, model, name):
    path, body = BASES[model]
    response = client.post(path, json={**body, name: SENT[name]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == name and name in response.json()["error"]["message"]


def test_a_refused_field_sent_with_no_effect_is_accepted(client):
    path, body = BASES[CompletionRequest]
    sent = {"bad_words": [], "allowed_token_ids": None, "logits_processors": [], "echo": False}
    assert client.post(path, json={**body, **sent}).status_code == 200
    path, body = BASES[ChatCompletionRequest]
    assert client.post(path, json={**body, "add_special_tokens": False}).status_code == 200


@pytest.fixture(scope="module")
def oai(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)


def test_a_thinking_budget_needs_a_reasoning_parser(oai):
    """Without --reasoning-parser the server does not know where a thinking ends: a budget is a
    400 naming the field; -1 (no budget) is accepted."""
    for budget in (4, 100):
        with pytest.raises(openai.BadRequestError) as error:
            oai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=8,
                extra_body={"thinking_token_budget": budget},
            )
        assert error.value.body["param"] == "thinking_token_budget"
        assert "--reasoning-parser" in error.value.body["message"]
    oai.completions.create(
        model=MODEL, prompt="Hi", max_tokens=8, extra_body={"thinking_token_budget": -1}
    )


def test_truncation_side_right_keeps_the_first_tokens(oai, engine):
    ids = engine.tokenizer.encode("Paged attention reads keys and values through a table")
    kept = oai.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=4,
        temperature=0,
        extra_body={"truncate_prompt_tokens": 5, "truncation_side": "right"},
    )
    first = oai.completions.create(model=MODEL, prompt=ids[:5], max_tokens=4, temperature=0)
    last = oai.completions.create(model=MODEL, prompt=ids[-5:], max_tokens=4, temperature=0)
    assert kept.usage.prompt_tokens == 5 and kept.choices[0].text == first.choices[0].text
    left = oai.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=4,
        temperature=0,
        extra_body={"truncate_prompt_tokens": 5},
    )
    assert left.choices[0].text == last.choices[0].text


def test_request_id_names_the_response(oai):
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=1,
        extra_body={"request_id": "trace-42"},
    )
    completion = oai.completions.create(
        model=MODEL, prompt="Hi", max_tokens=1, extra_body={"request_id": "trace-42"}
    )
    assert chat.id == "chatcmpl-trace-42" and completion.id == "cmpl-trace-42"


def test_add_special_tokens_shapes_a_completion_prompt(client, engine):
    body = {"model": MODEL, "prompt": "Hi there", "max_tokens": 1}
    plain = client.post("/v1/completions", json={**body, "add_special_tokens": False}).json()
    expected = len(engine.tokenizer.encode("Hi there", add_special_tokens=False))
    assert plain["usage"]["prompt_tokens"] == expected
