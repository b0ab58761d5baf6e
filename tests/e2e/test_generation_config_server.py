"""The server takes the model's generation_config defaults for the fields a request leaves out,
and says which are in force on /v1/models."""

from __future__ import annotations

import asyncio
import json
import shutil

import torch
from starlette.testclient import TestClient
from transformers import AutoModelForCausalLM

from pagedserve.models.testing import transformers_greedy
from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.testing import make_engine


def test_server_requests_inherit_generation_config_defaults(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama")
    path = tmp_path / "m"
    shutil.copytree(src, path)
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "temperature": 0.0, "max_new_tokens": 4})
    )
    engine = make_engine(str(path))
    try:
        client = TestClient(build_app(engine, ServerConfig(), "tiny"))
        card = client.get("/v1/models").json()["data"][0]
        assert card["default_sampling_params"] == {"temperature": 0.0, "max_tokens": 4}
        prompt = [5, 6, 7]
        body = {"prompt": prompt, "ignore_eos": True}
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        assert choice["text"] == engine.tokenizer.decode(transformers_greedy(hf, prompt, 4))
        longer = client.post("/v1/completions", json={**body, "max_tokens": 6}).json()
        assert longer["usage"]["completion_tokens"] == 6  # the request's own value wins
    finally:
        asyncio.run(engine.shutdown())
