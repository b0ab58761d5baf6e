"""Inputs that once gave a 500 or a traceback: a lone UTF-16 surrogate in any prompt is a 400
naming the field; an unexpected failure is a 500 that closes its connection cleanly; the command
line reports a user's mistakes in one line (a missing folder, a device this machine lacks, a
busy port, the last before any model is loaded)."""

from __future__ import annotations

import socket

import httpx
import pytest
import torch

from pagedserve.server import cli
from pagedserve.server.testing import blocks_held, uvicorn_in_thread, wait_engine_idle


def lone(body: str) -> str:
    """``body`` with ``@`` replaced by a JSON string escaping half a surrogate pair."""
    return body.replace("@", '"\\ud800"')


SURROGATE_CASES = [
    ("/v1/completions", lone('{"prompt": @, "max_tokens": 2}'), "prompt"),
    ("/v1/completions", lone('{"prompt": ["ok", @], "max_tokens": 2}'), "prompt.1"),
    ("/v1/completions", lone('{"prompt": @, "stream": true}'), "prompt"),
    ("/v1/completions", lone('{"prompt": "x", "stop": [@]}'), "stop.0"),
    (
        "/v1/chat/completions",
        lone('{"messages": [{"role": "user", "content": @}]}'),
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        lone('{"messages": [{"role": "user", "content": "a"}], "stream": true, "stop": @}'),
        "stop",
    ),
    ("/tokenize", lone('{"prompt": @}'), "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages.0.content"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_CASES)
def test_a_lone_surrogate_is_a_400_naming_its_field(client, engine, path, body, param):
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "surrogate" in error["message"]
    wait_engine_idle(engine)
    assert blocks_held(engine) == 0


def test_a_surrogate_pair_is_text(client):
    """A proper pair (one astral character) is not refused."""
    body = '{"prompt": "\\ud83d\\ude00", "max_tokens": 1}'
    response = client.post("/tokenize", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200 and response.json()["count"] > 0


def test_a_500_closes_its_connection_and_the_next_request_works(app, engine, monkeypatch):
    tokenizer = engine.tokenizer

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    with uvicorn_in_thread(app) as url, httpx.Client(base_url=url) as http:
        assert http.get("/health").status_code == 200  # a pooled keep-alive connection
        monkeypatch.setattr(tokenizer, "encode", broken)
        response = http.post("/tokenize", json={"prompt": "hello"})
        assert response.status_code == 500
        assert response.headers["connection"] == "close"
        assert response.json()["error"]["type"] == "internal_server_error"
        assert "boom" not in response.text  # details go to the log only
        monkeypatch.undo()
        for _ in range(3):  # the pool reconnects: no reset, no RemoteProtocolError
            assert http.post("/tokenize", json={"prompt": "hello"}).status_code == 200


def test_generate_reports_a_missing_folder_in_one_line(capsys):
    assert cli.main(["generate", "--model", "/no/such/model", "hi"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_generate_reports_a_missing_cuda_device(tiny_path, capsys):
    assert cli.main(["generate", "--model", tiny_path, "--device", "cuda", "hi"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "Traceback" not in err


def test_serve_reports_a_busy_port_before_loading_the_model(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # The model folder does not exist either: the port's error coming first shows that it
        # is checked before the model is looked at, let alone loaded.
        assert cli.main(["serve", "/no/such/model", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "does not exist" not in err
