"""--api-key: every route but /health and /metrics needs the key, whatever the path's spelling; and the
pure helpers of the gate (path normalisation, bearer parsing) and of the CLI (sizes)."""

from __future__ import annotations

import argparse

import pytest
from starlette.testclient import TestClient

from pagedserve.server.app import build_app
from pagedserve.server.cli import parse_size
from pagedserve.server.config import ServerConfig
from pagedserve.server.middleware import bearer_token, normalize_path
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL_NAME

KEY = "sk-test-0123456789"
BASE = "http://testserver"  # full URLs: httpx would read "//v1/models" as a host "v1"


@pytest.fixture(scope="module")
def keyed_client(engine):
    app = build_app(engine, ServerConfig(api_key=KEY), MODEL_NAME)
    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("/v1/models", "/v1/models"),
        ("//v1//models/", "/v1/models"),
        ("/v1/./models", "/v1/models"),
        ("/health/../v1/models", "/v1/models"),
        ("/../../v1/models", "/v1/models"),
        ("/v1/%6Dodels", "/v1/models"),
        ("/v1%2Fmodels", "/v1/models"),
        ("/v1%252Fmodels", "/v1/models"),  # double-encoded
        ("/health%2F..%2Fv1%2Fmodels", "/v1/models"),
        ("\\v1\\models", "/v1/models"),
        ("/", "/"),
        ("", "/"),
    ],
)
def test_normalize_path(raw, expected):
    assert normalize_path(raw) == expected


def test_bearer_token():
    def scope(value):
        return {"headers": [(b"authorization", value)]}

    assert bearer_token(scope(b"Bearer abc")) == b"abc"
    assert bearer_token(scope(b"bearer   abc ")) == b"abc"
    assert bearer_token(scope(b"Basic abc")) is None
    assert bearer_token({"headers": []}) is None


@pytest.mark.parametrize(
    "text,size",
    [
        ("1073741824", 2**30),
        ("2GiB", 2 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5 GiB", 3 * 2**29),
        ("64kib", 65536),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "two gigs", "-1GiB", "0", "5XB"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


PROTECTED = [
    ("GET", "/v1/models"),
    ("GET", "//v1/models"),
    ("GET", "/v1/%6Dodels"),
    ("GET", "/health/../v1/models"),
    ("GET", "/health/%2E%2E/v1/models"),
    ("GET", "/version"),
    ("GET", "/HEALTH"),
    ("GET", "/no/such/route"),
    ("POST", "/v1/completions"),
    ("POST", "//v1//chat/completions"),
    ("POST", "/tokenize"),
]


@pytest.mark.parametrize("method,path", PROTECTED)
@pytest.mark.parametrize(
    "auth", [None, "Bearer wrong-key", "Bearer " + KEY[:-1], "Basic " + KEY, KEY]
)
def test_protected_routes_need_the_key(keyed_client, method, path, auth):
    headers = {"authorization": auth} if auth else {}
    response = keyed_client.request(method, BASE + path, headers=headers, json={"prompt": "x"})
    assert response.status_code == 401, (path, response.text)
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("path", ["/metrics", "/./metrics", "/metrics/", "//metrics"])
def test_metrics_are_open_unless_configured(keyed_client, engine, path):
    """As vLLM's: the key guards the API, Prometheus scrapes without it; a flag guards it."""
    response = keyed_client.get(BASE + path)
    assert response.status_code == 200 and "pagedserve:num_requests_running" in response.text
    config = ServerConfig(api_key=KEY, metrics_require_api_key=True)
    guarded = TestClient(build_app(engine, config, MODEL_NAME))
    assert guarded.get(BASE + path).status_code == 401
    good = {"authorization": f"Bearer {KEY}"}
    assert guarded.get(BASE + path, headers=good).status_code == 200


def test_health_is_open_and_the_key_opens_the_rest(keyed_client):
    assert keyed_client.get("/health").status_code == 200
    good = {"authorization": f"Bearer {KEY}"}
    for path in ("/v1/models", "//v1/models", "/v1/%6Dodels", "/health/../v1/models"):
        response = keyed_client.get(BASE + path, headers=good)
        assert response.status_code == 200, path
        assert response.json()["data"][0]["id"] == MODEL_NAME
    response = keyed_client.post(
        "/v1/completions", headers=good, json={"prompt": "Hello", "max_tokens": 2}
    )
    assert response.status_code == 200
    assert keyed_client.get("/no/such/route", headers=good).status_code == 404
