"""Requests written for vLLM's server, sent with the official openai client, get vLLM's answers:
custom chat roles, its seed range, its error phrases, its streamed chunk shapes, and the final
assistant message echoed in front of its continuation."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from pagedserve.server.testing import TINY_MODEL_NAME as MODEL


@pytest.fixture(scope="module")
def oai(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    return AutoTokenizer.from_pretrained(tiny_path)


def test_a_custom_role_reaches_the_chat_template(oai, tokenizer):
    messages = [
        {"role": "my-custom-role", "content": "Stay terse."},
        {"role": "user", "content": "Hello"},
    ]
    chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>my-custom-role\n" in text
    assert chat.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
def test_a_seed_beyond_signed_64_bits_is_refused(oai, seed):
    messages = [{"role": "user", "content": "Hello"}]
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, seed=seed)
    assert refused.value.body["param"] == "seed"
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2, seed=seed)


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 0])
def test_the_ends_of_the_seed_range_are_served(oai, seed):
    completion = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2, seed=seed)
    assert completion.usage.completion_tokens == 2


EMPTY_PROMPT_PHRASE = "Either prompt or prompt_embeds must be provided and non-empty."


@pytest.mark.parametrize("prompt", ["", [], [[]], ["Hi", ""], [[5], []]])
def test_an_empty_prompt_is_refused_in_vllms_words(oai, prompt):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert EMPTY_PROMPT_PHRASE in refused.value.body["message"]
    assert refused.value.body["param"] == "prompt"


def test_an_out_of_vocabulary_token_is_refused_in_vllms_words(oai, client, engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(openai.BadRequestError) as refused:
        oai.completions.create(model=MODEL, prompt=[1, vocab + 7], max_tokens=2)
    assert f"Token id {vocab + 7} is out of vocabulary" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        oai.completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, extra_body={"stop_token_ids": [vocab]}
        )
    assert "out of vocabulary" in refused.value.body["message"]
    detokenized = client.post("/detokenize", json={"tokens": [1, vocab]})
    assert detokenized.status_code == 400
    assert "out of vocabulary" in detokenized.json()["error"]["message"]


TOKEN_ID_KEYS = ("token_ids", "prompt_token_ids")


def _token_id_keys_hold_lists(chunk: dict) -> None:
    """vLLM leaves a token-id key out of a chunk that has none: present means a list."""
    for where in [chunk, *chunk.get("choices", [])]:
        for key in TOKEN_ID_KEYS:
            assert key not in where or isinstance(where[key], list), (key, chunk)


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("return_token_ids", [True, False])
def test_streamed_chunks_leave_out_token_ids_they_do_not_carry(oai, route, return_token_ids):
    """Joined up, the streamed token ids are the non-streamed answer's; no chunk has a null."""
    extra = {"return_token_ids": True} if return_token_ids else {}
    args = dict(model=MODEL, max_tokens=6, temperature=0, extra_body=extra)
    if route == "chat":
        create = oai.chat.completions.create
        args["messages"] = [{"role": "user", "content": "Count to ten"}]
    else:
        create = oai.completions.create
        args["prompt"] = "Count to ten"
    whole = create(**args).to_dict()
    stream = [
        chunk.to_dict()
        for chunk in create(**args, stream=True, stream_options={"include_usage": True})
    ]
    for chunk in stream:
        _token_id_keys_hold_lists(chunk)
    streamed = [t for c in stream for ch in c["choices"] for t in ch.get("token_ids", [])]
    prompt_ids = [c["prompt_token_ids"] for c in stream if "prompt_token_ids" in c]
    prompt_ids += [
        ch["prompt_token_ids"] for c in stream for ch in c["choices"] if "prompt_token_ids" in ch
    ]
    if return_token_ids:
        assert streamed == whole["choices"][0]["token_ids"] and len(streamed) == 6
        whole_prompt = whole.get("prompt_token_ids") or whole["choices"][0]["prompt_token_ids"]
        assert prompt_ids == [whole_prompt]
    else:
        assert streamed == [] and prompt_ids == []


SAYING = "Here is a common saying about apple. An apple a day, keeps"
CONTINUED = [
    {"role": "user", "content": "tell me a common saying"},
    {"role": "assistant", "content": SAYING},
]


def test_echo_puts_the_continued_message_in_front_of_its_continuation(oai):
    """vLLM's test_chat_echo: with echo the reply starts with the final assistant message;
    streamed, the echo comes as the first content delta, and the stream joins up the same."""
    args = dict(model=MODEL, messages=CONTINUED, max_tokens=5, temperature=0)
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    plain = oai.chat.completions.create(**args, extra_body=extra).choices[0].message.content
    echoed = oai.chat.completions.create(**args, extra_body={**extra, "echo": True})
    assert echoed.choices[0].message.content == SAYING + plain
    stream = oai.chat.completions.create(**args, extra_body={**extra, "echo": True}, stream=True)
    deltas = [
        c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content
    ]
    assert deltas[0] == SAYING and "".join(deltas) == SAYING + plain
    user_last = [{"role": "user", "content": "Hi"}]  # echo repeats only the reply's own role
    no_echo = oai.chat.completions.create(
        **{**args, "messages": user_last}, extra_body={"echo": True}
    )
    again = oai.chat.completions.create(**{**args, "messages": user_last})
    assert no_echo.choices[0].message.content == again.choices[0].message.content


def test_tokenize_leaves_the_continued_message_open(client, tokenizer):
    body = {
        "model": MODEL,
        "messages": CONTINUED,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    tokens = client.post("/tokenize", json=body).json()["tokens"]
    text = tokenizer.apply_chat_template(CONTINUED, continue_final_message=True, tokenize=False)
    assert tokens == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(tokens).endswith(SAYING)  # no end-of-turn marker after it
    both = client.post("/tokenize", json={**body, "add_generation_prompt": True})
    assert both.status_code == 400
    assert (
        "Cannot set both `continue_final_message` and `add_generation_prompt`"
        in (both.json()["error"]["message"])
    )
