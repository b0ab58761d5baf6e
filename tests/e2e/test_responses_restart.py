"""Stored responses survive a restart: a real ``pagedserve serve`` stores a response in its
SQLite file and is stopped; a second server on the same file finds it by GET and continues it
with ``previous_response_id`` (the prompt is the whole conversation: as many tokens as the
chat route's prompt for it)."""

from __future__ import annotations

import openai
import pytest

from pagedserve.server.testing import live_server

pytestmark = pytest.mark.slow  # two real servers, one after the other: ~20 s

NAME = "tiny"


def test_previous_response_id_works_across_a_restart(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama", max_position_embeddings=1024)
    store = tmp_path / "responses.sqlite3"
    args = ("--served-model-name", NAME, "--max-model-len", "1024", "--responses-store", str(store))
    with live_server(path, *args) as first:
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="x", max_retries=0)
        earlier = client.responses.create(
            model=NAME, input="Why are caches paged?", max_output_tokens=5, temperature=0
        )
    assert store.exists()
    with live_server(path, *args) as second:
        client = openai.OpenAI(base_url=second.url + "/v1", api_key="x", max_retries=0)
        assert client.responses.retrieve(earlier.id).output_text == earlier.output_text
        later = client.responses.create(
            model=NAME,
            input="And blocks?",
            previous_response_id=earlier.id,
            max_output_tokens=5,
            temperature=0,
        )
        chat = client.chat.completions.create(
            model=NAME,
            messages=[
                {"role": "user", "content": "Why are caches paged?"},
                {"role": "assistant", "content": earlier.output_text},
                {"role": "user", "content": "And blocks?"},
            ],
            max_tokens=5,
            temperature=0,
        )
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve("resp-unknown")
    assert later.usage.input_tokens == chat.usage.prompt_tokens
    assert later.output_text == chat.choices[0].message.content
