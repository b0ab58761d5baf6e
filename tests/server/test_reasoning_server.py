"""``--reasoning-parser qwen3`` through the server, on the tiny model under a template that
behaves as Qwen3's (``enable_thinking: false`` writes an empty thinking block into the prompt).

The tiny model's random weights never write ``</think>``, so with thinking on its whole reply is
thinking: ``reasoning_content`` is exactly the text the same prompt gets from /v1/completions,
and every token counts as a thinking token; with thinking off it is all ``content``. Streamed
deltas add up to the whole reply; /v1/responses returns the thinking as a reasoning item; an
output constraint holds the answer (with thinking off, the reply is the answer at once)."""

from __future__ import annotations

import json

import openai
import pytest
from starlette.testclient import TestClient

from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL

QWEN3_LIKE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}"
    "\n</think>\n\n{% endif %}{{ m.content or '' }}<|im_end|>\n{% endfor %}"
    "{%- for d in documents or [] %}<|im_start|>system\n{{ d.title }}: {{ d.text }}<|im_end|>\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def client(roomy_engine, tmp_path_factory):
    config = ServerConfig(
        reasoning_parser="qwen3",
        chat_template=QWEN3_LIKE,
        responses_store=str(tmp_path_factory.mktemp("store") / "r.sqlite3"),
    )
    return TestClient(build_app(roomy_engine, config, MODEL), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def oai(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)


def raw_reply(client, tokenizer, extra: dict | None = None, max_tokens: int = 12) -> str:
    """What the model writes for the conversation, read without any parser (the prompt from
    transformers' own rendering of the template)."""
    kwargs = (extra or {}).get("chat_template_kwargs", {})
    ids = tokenizer.apply_chat_template(
        MESSAGES, chat_template=QWEN3_LIKE, add_generation_prompt=True, tokenize=True, **kwargs
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    completion = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0},
    ).json()
    return completion["choices"][0]["text"]


@pytest.fixture(scope="module")
def tokenizer(roomy_engine):
    return roomy_engine.tokenizer


def test_the_reply_is_thinking_and_counted_so(oai, client, tokenizer):
    chat = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    message = chat.choices[0].message
    assert message.content is None
    assert message.model_extra["reasoning_content"] == raw_reply(client, tokenizer).strip()
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"]
    assert chat.usage.completion_tokens_details.reasoning_tokens == chat.usage.completion_tokens


def test_enable_thinking_false_makes_it_all_answer(oai, client, tokenizer):
    chat = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, extra_body=OFF
    )
    message = chat.choices[0].message
    assert message.content == raw_reply(client, tokenizer, OFF)
    assert "reasoning_content" not in (message.model_extra or {})
    assert chat.usage.completion_tokens_details.reasoning_tokens == 0
    effort = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, reasoning_effort="none"
    )
    assert effort.choices[0].message.content == message.content


def test_streamed_thinking_adds_up_to_the_whole(oai):
    params = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    whole = oai.chat.completions.create(**params).choices[0].message.model_extra
    chunks = list(
        oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **params)
    )
    usage = chunks[-1].usage
    assert usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens == 12
    deltas = [c.choices[0].delta.model_extra for c in chunks if c.choices]
    thinking = [d["reasoning_content"] for d in deltas if d.get("reasoning_content")]
    assert thinking and "".join(thinking) == whole["reasoning_content"]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_include_reasoning_false_drops_the_thinking(oai):
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        extra_body={"include_reasoning": False},
    )
    assert chat.choices[0].message.content is None
    assert "reasoning_content" not in (chat.choices[0].message.model_extra or {})


def test_responses_return_the_thinking_as_a_reasoning_item(oai):
    chat = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    params = dict(model=MODEL, input="What is 2 + 2?", max_output_tokens=12, temperature=0)
    response = oai.responses.create(**params)
    (item,) = response.output
    assert item.type == "reasoning" and item.status == "incomplete"
    assert item.content[0].text == chat.choices[0].message.model_extra["reasoning_content"]
    assert response.usage.output_tokens_details.reasoning_tokens == 12
    events = list(oai.responses.create(stream=True, **params))
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[2].item.type == "reasoning"
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == item.content[0].text == events[-1].response.output[0].content[0].text
    assert kinds[-4:] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]


def test_a_thinking_turn_given_back_reaches_the_template(oai):
    """A reasoning item in the input is the assistant turn's thinking: the template shows it,
    so the prompt grows by it."""
    turn = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Sure?"},
    ]
    thought = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text"}]}
    thought["content"][0]["text"] = "Two and two make four."
    plain = oai.responses.create(model=MODEL, input=turn, max_output_tokens=1)
    with_thought = oai.responses.create(
        model=MODEL, input=[turn[0], thought, *turn[1:]], max_output_tokens=1
    )
    assert with_thought.usage.input_tokens > plain.usage.input_tokens


SCHEMA = {"type": "object", "properties": {"n": {"enum": [3, 4, 5]}}, "required": ["n"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}


def test_an_output_constraint_holds_the_answer_not_the_thinking(oai):
    free = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    held = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, response_format=FORMAT
    )
    # the thinking is free text: the model's own, untouched by the JSON grammar
    assert (
        held.choices[0].message.model_extra["reasoning_content"]
        == (free.choices[0].message.model_extra["reasoning_content"])
    )
    answer = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        response_format=FORMAT,
        extra_body=OFF,
    )
    assert json.loads(answer.choices[0].message.content)["n"] in (3, 4, 5)


def test_a_named_tool_call_without_thinking(oai):
    tools = [{"type": "function", "function": {"name": "add", "parameters": SCHEMA}}]
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=40,
        temperature=0,
        extra_body=OFF,
    )
    (call,) = chat.choices[0].message.tool_calls
    assert call.function.name == "add" and isinstance(json.loads(call.function.arguments), dict)


def test_documents_reach_the_template(oai):
    plain = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    grounded = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=1,
        extra_body={"documents": [{"title": "Sums", "text": "2 + 2 = 4"}]},
    )
    assert grounded.usage.prompt_tokens > plain.usage.prompt_tokens


def test_echo_goes_in_front_of_the_answer_not_the_thinking(oai):
    """vLLM's chat ``echo`` under a reasoning parser: the final assistant message starts the
    answer's content; the thinking stays apart."""
    conversation = [*MESSAGES, {"role": "assistant", "content": "Four."}]
    args = dict(model=MODEL, messages=conversation, max_tokens=8, temperature=0)
    plain = oai.chat.completions.create(**args, extra_body=OFF).choices[0].message
    echoed = oai.chat.completions.create(**args, extra_body={**OFF, "echo": True}).choices[0]
    assert echoed.message.content == "Four." + (plain.content or "")
    thinking = oai.chat.completions.create(**args, extra_body={"echo": True}).choices[0].message
    assert thinking.content == "Four." and thinking.model_extra["reasoning_content"]


def test_the_batch_route_reads_each_conversation_for_its_thinking(oai, client):
    """/v1/chat/completions/batch plans each conversation as chat does: each choice's thinking
    comes apart, and the usage counts the thinking tokens of all of them."""
    single = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0
    )
    other = [{"role": "user", "content": "Name a colour."}]
    body = {"model": MODEL, "messages": [MESSAGES, other], "max_tokens": 6, "temperature": 0}
    batch = client.post("/v1/chat/completions/batch", json=body).json()
    first, second = batch["choices"]
    expected = single.choices[0].message.model_extra["reasoning_content"]
    assert first["message"]["reasoning_content"] == expected
    assert second["message"]["reasoning_content"] and second["message"]["content"] is None
    usage = batch["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == usage["completion_tokens"]
    assert usage["completion_tokens"] > single.usage.completion_tokens
