"""POST /v1/responses through the openai client's ``client.responses.create``: the answer is
the chat route's answer to the same conversation (instructions as the system message), cut by
max_output_tokens as "incomplete"; streamed, OpenAI's typed events in order add up to it."""

from __future__ import annotations

import openai
import pytest

from pagedserve.server.testing import TINY_MODEL_NAME as MODEL

HISTORY = [
    {"role": "user", "content": "Name a cache."},
    {"role": "assistant", "content": [{"type": "output_text", "text": "The KV cache."}]},
    {"role": "user", "content": [{"type": "input_text", "text": "Why is it paged?"}]},
]
CHAT_HISTORY = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Name a cache."},
    {"role": "assistant", "content": "The KV cache."},
    {"role": "user", "content": "Why is it paged?"},
]


@pytest.fixture(scope="module")
def oai(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)


def test_text_input_equals_the_chat_answer(oai):
    response = oai.responses.create(
        model=MODEL, input="Hello there", max_output_tokens=6, temperature=0, store=False
    )
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=6,
        temperature=0,
    )
    assert response.object == "response" and response.id.startswith("resp")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.store is False
    assert (response.output[0].type, response.output[0].role) == ("message", "assistant")
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"


def test_messages_and_instructions_are_the_chat_conversation(oai):
    response = oai.responses.create(
        model=MODEL,
        input=HISTORY,
        instructions="Answer briefly.",
        max_output_tokens=5,
        temperature=0.8,
        top_p=0.9,
        extra_body={"ignore_eos": True},
    )
    chat = oai.chat.completions.create(
        model=MODEL, messages=CHAT_HISTORY, max_tokens=5, temperature=0.8, top_p=0.9
    )
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.instructions == "Answer briefly." and response.temperature == 0.8


def test_streamed_events_add_up_to_the_response(oai):
    params = dict(model=MODEL, input="Tell me more", max_output_tokens=8, temperature=0)
    whole = oai.responses.create(**params)
    events = list(oai.responses.create(stream=True, **params))
    kinds = [e.type for e in events]
    final = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    head = ["response.created", "response.in_progress", "response.output_item.added"]
    head.append("response.content_part.added")
    tail = ["response.output_text.done", "response.content_part.done"]
    tail += ["response.output_item.done", final]
    deltas = kinds[len(head) : len(kinds) - len(tail)]
    assert kinds[: len(head)] == head and kinds[len(kinds) - len(tail) :] == tail
    assert deltas and set(deltas) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-4].text == text


def test_refusals_name_the_responses_fields(oai):
    with pytest.raises(openai.BadRequestError) as error:
        oai.responses.create(model=MODEL, input="x", max_output_tokens=0)
    assert error.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as error:
        oai.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    assert error.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as error:
        oai.responses.create(model=MODEL, input=[{"role": "wizard", "content": "x"}])
    assert error.value.body["param"] == "input" and "list of messages" in error.value.message
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="gpt-5", input="x")
