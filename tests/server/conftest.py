"""Fixtures for the server tests: one tiny-model engine and app per module, in-process clients."""

from __future__ import annotations

import asyncio

import pytest
from starlette.testclient import TestClient

from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL_NAME
from pagedserve.server.testing import make_engine


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def tiny_path(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def engine(tiny_path):
    engine = make_engine(tiny_path)
    yield engine
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def roomy_engine(tiny_checkpoint):
    """Room for the tool-listing system prompt (the tiny tokenizer spends many tokens on it):
    a module that calls tools overrides ``engine`` with this one."""
    path = tiny_checkpoint("llama", max_position_embeddings=1024)
    engine = make_engine(path, max_model_len=1024, num_gpu_blocks_override=512)
    yield engine
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def app(engine, tmp_path_factory):
    """The app, its stored responses in a file of the test's own (not $PAGEDSERVE_HOME's)."""
    store = tmp_path_factory.mktemp("store") / "responses.sqlite3"
    return build_app(engine, ServerConfig(responses_store=str(store)), MODEL_NAME)


@pytest.fixture(scope="module")
def client(app):
    """A synchronous client on the app (no lifespan: the engine fixture owns shutdown)."""
    return TestClient(app, raise_server_exceptions=False)
