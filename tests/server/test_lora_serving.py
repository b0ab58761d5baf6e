"""LoRA over HTTP: adapters listed under /v1/models with their parent, routed by "model", loaded
and unloaded while streams run (every output equal to transformers + peft for its adapter, no
block leaked), and every bad adapter a clear 4xx at load time while serving goes on."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
from starlette.testclient import TestClient

from pagedserve.models.testing import make_peft_adapter, peft_greedy
from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.testing import blocks_held, make_engine, wait_engine_idle

BASE_NAME = "tiny"
PROMPT = [1, 17, 33, 250, 99, 7]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def loras(tiny_path, tmp_path_factory):
    specs = {"attn": (8, ["q_proj", "v_proj", "o_proj"]), "mlp": (16, ["gate_proj", "down_proj"])}
    specs["big"] = (32, ["q_proj"])
    return {
        name: str(make_peft_adapter(tiny_path, tmp_path_factory.mktemp(name), targets, r, seed=i))
        for i, (name, (r, targets)) in enumerate(specs.items(), start=1)
    }


@pytest.fixture(scope="module")
def lora_app(tiny_path, loras):
    engine = make_engine(
        tiny_path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16
    )
    config = ServerConfig(lora_modules=(f"attn={loras['attn']}",))
    app = build_app(engine, config, BASE_NAME)
    with TestClient(app, raise_server_exceptions=False) as client:  # the lifespan loads "attn"
        yield app, client, engine


def completion(name: str | None, stream: bool = False) -> dict:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    body |= {"return_token_ids": True, "stream": stream}
    return body if name is None else body | {"model": name}


def test_models_lists_the_base_and_its_adapters(lora_app, loras):
    _, client, _ = lora_app
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert set(cards) == {BASE_NAME, "attn"}
    assert cards["attn"]["parent"] == BASE_NAME and cards["attn"]["root"] == loras["attn"]
    assert cards[BASE_NAME]["parent"] is None
    assert client.get("/v1/models/attn").json()["parent"] == BASE_NAME


def test_the_model_name_routes_to_the_adapter(lora_app, tiny_path, loras):
    _, client, _ = lora_app
    tokens = client.post("/v1/completions", json=completion("attn")).json()
    base = client.post("/v1/completions", json=completion(BASE_NAME)).json()
    assert tokens["choices"][0]["token_ids"] == peft_greedy(tiny_path, loras["attn"], PROMPT, 6)
    assert tokens["model"] == "attn" and base["model"] == BASE_NAME
    assert base["choices"][0]["token_ids"] == peft_greedy(tiny_path, None, PROMPT, MAX_TOKENS)
    missing = client.post("/v1/completions", json=completion("nope"))
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"


def _stream_tokens(lines: list[str]) -> list[int]:
    tokens = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                tokens += choice.get("token_ids") or []
    return tokens


@pytest.mark.anyio
async def test_hot_swap_under_load(lora_app, tiny_path, loras):
    """Streams of the base and "attn" run while "mlp" is loaded, routed to, and "attn" is
    unloaded under its own running streams: every stream ends with its adapter's tokens."""
    app, _, engine = lora_app
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as http:

        async def stream(name):
            async with http.stream("POST", "/v1/completions", json=completion(name, True)) as r:
                assert r.status_code == 200, await r.aread()
                return name, _stream_tokens([line async for line in r.aiter_lines()])

        early = [asyncio.create_task(stream(n)) for n in ("attn", BASE_NAME, "attn")]
        await asyncio.sleep(0)
        loaded = await http.post(
            "/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": loras["mlp"]}
        )
        assert loaded.status_code == 200, loaded.text
        late = [asyncio.create_task(stream(n)) for n in ("mlp", BASE_NAME, "mlp")]
        unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "attn"})
        assert unloaded.status_code == 200, unloaded.text
        results = await asyncio.gather(*early, *late)
        after = await http.post("/v1/completions", json=completion("attn"))
        assert after.status_code == 404  # unlisted at once
    adapters = {"attn": loras["attn"], "mlp": loras["mlp"], BASE_NAME: None}
    for name, tokens in results:
        assert tokens == peft_greedy(tiny_path, adapters[name], PROMPT, MAX_TOKENS), name
    wait_engine_idle(engine)
    assert blocks_held(engine) == 0
    manager = engine.engine.lora_manager
    assert 1 not in manager.resident and [r.lora_name for r in manager.registered.values()] == [
        "mlp"
    ]


def _broken_copy(src: str, dst, edit) -> str:
    shutil.copytree(src, dst)
    edit(dst)
    return str(dst)


def test_bad_adapters_are_refused_at_load_and_serving_goes_on(lora_app, loras, tmp_path):
    from safetensors.torch import load_file, save_file

    _, client, _ = lora_app

    def config_edit(**changes):
        def edit(path):
            config = json.loads((path / "adapter_config.json").read_text())
            (path / "adapter_config.json").write_text(json.dumps(config | changes))

        return edit

    def wrong_shape(path):
        tensors = load_file(path / "adapter_model.safetensors")
        key = next(k for k in tensors if "lora_A" in k)
        tensors[key] = tensors[key][:, :-4].contiguous()
        save_file(tensors, path / "adapter_model.safetensors")

    def corrupt(path):
        (path / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10)

    cases = {
        "rank": (loras["big"], lambda p: None, "exceeds max_lora_rank 16"),
        "targets": (loras["mlp"], config_edit(target_modules=["c_fc"]), "not in this model"),
        "shape": (loras["mlp"], wrong_shape, "do not fit the base model"),
        "corrupt": (loras["mlp"], corrupt, "not a readable safetensors file"),
        "missing": (str(tmp_path / "nowhere"), None, "does not exist"),
    }
    for name, (src, edit, message) in cases.items():
        path = src if edit is None else _broken_copy(src, tmp_path / name, edit)
        r = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        assert r.status_code == 400, (name, r.text)
        assert message in r.json()["error"]["message"], (name, r.text)
    names = {c["id"] for c in client.get("/v1/models").json()["data"]}
    assert not names & set(cases)
    dup = {"lora_name": "dup", "lora_path": loras["mlp"]}
    assert client.post("/v1/load_lora_adapter", json=dup).status_code == 200
    for body in (dup, {"lora_name": BASE_NAME, "lora_path": loras["mlp"]}):
        taken = client.post("/v1/load_lora_adapter", json=body)
        assert taken.status_code == 400 and taken.json()["error"]["code"] == "lora_name_taken"
    gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "never"})
    assert gone.status_code == 404
    assert client.post("/v1/completions", json=completion(BASE_NAME)).status_code == 200


def test_metrics_show_the_lora_adapters(lora_app):
    _, client, _ = lora_app
    text = client.get("/metrics").text
    assert 'pagedserve:lora_requests_info{max_lora="2"' in text


def test_lora_modules_take_name_path_and_vllms_json():
    from pagedserve.server.cli import build_parser

    config = ServerConfig(lora_modules=('{"name": "sql", "path": "/a/sql"}', " chat = /a/chat "))
    assert config.lora_modules == ("sql=/a/sql", "chat=/a/chat")
    with pytest.raises(ValueError, match="name=path"):
        ServerConfig(lora_modules=("no-path",))
    args = build_parser().parse_args(
        ["serve", "m", "--enable-lora", "--lora-modules", "a=/x", "b=/y"]
    )
    assert args.lora_modules == ["a=/x", "b=/y"] and args.enable_lora
