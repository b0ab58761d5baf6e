"""GET /openapi.json is a valid OpenAPI 3.1 document covering every route, whose schemas the
server's real answers satisfy; /docs is served from the package's own files (no CDN); CORS
answers a browser's preflight as configured."""

from __future__ import annotations

import re

import jsonschema
import pytest
from openapi_spec_validator import validate
from starlette.routing import Mount, Route
from starlette.testclient import TestClient

from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL


@pytest.fixture(scope="module")
def spec(client) -> dict:
    response = client.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def route_table(app) -> set[tuple[str, str]]:
    table = set()
    for route in app.routes:
        if isinstance(route, Mount):
            continue
        assert isinstance(route, Route)
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)
        table |= {(m.lower(), path) for m in route.methods - {"HEAD"}}
    return table


def test_the_document_is_valid_openapi_and_covers_every_route(spec, app):
    validate(spec)  # raises on any violation of the OpenAPI 3.1 schema
    documented = {(m, path) for path, methods in spec["paths"].items() for m in methods}
    assert documented == route_table(app)


def answer_validator(spec, path: str, method: str, media: str = "application/json"):
    schema = spec["paths"][path][method]["responses"]["200"]["content"][media]["schema"]
    return jsonschema.Draft202012Validator({**schema, "components": spec["components"]})


def test_real_answers_satisfy_the_documented_schemas(spec, client):
    cases = [
        ("post", "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "logprobs": 1, "echo": True}),
        (
            "post",
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 3,
                "logprobs": True,
                "top_logprobs": 1,
                "prompt_logprobs": 1,
                "return_token_ids": True,
            },
        ),
        ("get", "/v1/models", None),
        ("get", f"/v1/models/{MODEL}", None),
        ("post", "/tokenize", {"prompt": "hello", "return_token_strs": True}),
        ("post", "/detokenize", {"tokens": [5, 6]}),
        ("get", "/health", None),
        ("get", "/version", None),
    ]
    for method, url, body in cases:
        response = client.request(method.upper(), url, json=body)
        assert response.status_code == 200, (url, response.text)
        path = "/v1/models/{model_id}" if url.startswith("/v1/models/") else url
        answer_validator(spec, path, method).validate(response.json())
    error = client.post("/v1/completions", json={"prompt": "x", "n": 0})
    schema = spec["paths"]["/v1/completions"]["post"]["responses"]["4XX"]["content"]
    validator = jsonschema.Draft202012Validator(
        {**schema["application/json"]["schema"], "components": spec["components"]}
    )
    validator.validate(error.json())
    # the request schemas accept what the server accepts, and refuse what it refuses
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    request = jsonschema.Draft202012Validator({**body["schema"], "components": spec["components"]})
    assert request.is_valid({"prompt": [1, 2], "max_tokens": 3, "use_beam_search": True})
    assert not request.is_valid({"max_tokens": 3})  # no prompt


@pytest.mark.parametrize("page_path", ["/docs", "/"])
def test_pages_are_served_from_the_package_without_a_cdn(client, page_path):
    page = client.get(page_path)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sources and all(s.startswith("/") and not s.startswith("//") for s in sources)
    for source in (s for s in sources if s.startswith("/static/")):
        asset = client.get(source)
        assert asset.status_code == 200 and asset.text
        assert "http://" not in asset.text and "https://" not in asset.text


def test_docs_and_schema_are_open_under_an_api_key(engine):
    keyed = TestClient(build_app(engine, ServerConfig(api_key="sk-k"), MODEL))
    for path in ("/docs", "/openapi.json", "/static/docs.js", "/", "/static/playground.js"):
        assert keyed.get(path).status_code == 200, path
    assert keyed.get("/v1/models").status_code == 401
    assert keyed.get("/static/../v1/models").status_code == 401  # normalised before the check


def test_cors_preflight_and_simple_requests(engine):
    config = ServerConfig(
        api_key="sk-k",
        allowed_origins=("https://app.example",),
        allowed_methods=("GET", "POST"),
        allowed_headers=("authorization", "content-type"),
    )
    http = TestClient(build_app(engine, config, MODEL))
    preflight = {
        "origin": "https://app.example",
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    ok = http.options("/v1/completions", headers=preflight)
    assert ok.status_code == 200  # answered before the key is asked for
    assert ok.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in ok.headers["access-control-allow-methods"]
    refused = http.options("/v1/completions", headers={**preflight, "origin": "https://evil"})
    assert refused.status_code == 400
    simple = http.get("/v1/models", headers={"origin": "https://app.example"})
    assert simple.status_code == 401
    assert simple.headers["access-control-allow-origin"] == "https://app.example"
    default = TestClient(build_app(engine, ServerConfig(), MODEL))
    answer = default.get("/health", headers={"origin": "https://anywhere"})
    assert answer.headers["access-control-allow-origin"] == "*"  # vLLM's default


def test_security_is_declared_only_where_the_server_enforces_it(spec, client, engine):
    """Without --api-key no route declares a scheme (a fuzzer would report "authentication
    declared but not enforced"); with one, exactly the routes the gate guards declare it, and
    a guarded route really answers 401 without the key."""
    assert "securitySchemes" not in spec["components"] and "security" not in spec
    assert not [
        (p, m) for p, ms in spec["paths"].items() for m, op in ms.items() if "security" in op
    ]
    keyed = TestClient(build_app(engine, ServerConfig(api_key="sk-k"), MODEL))
    document = keyed.get("/openapi.json").json()
    assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            secured = operation.get("security") == [{"bearer": []}]
            if method == "get" and "{" not in path:
                assert (keyed.get(path).status_code == 401) == secured, path


def test_the_document_describes_its_own_answer(spec, client):
    validator = answer_validator(spec, "/openapi.json", "get")
    validator.validate(client.get("/openapi.json").json())
