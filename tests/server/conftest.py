"""Fixtures for the server tests: one tiny-model engine and app per module, in-process clients."""

from __future__ import annotations

import asyncio
import time

import pytest
from starlette.testclient import TestClient

from pagedserve.engine import AsyncLLM, EngineArgs
from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig

MODEL_NAME = "tiny-llama"


@pytest.fixture
def anyio_backend():
    return "asyncio"


def make_engine(path: str, **overrides) -> AsyncLLM:
    args = dict(model=path, max_model_len=256, num_gpu_blocks_override=128, max_num_seqs=16)
    args.update(overrides)
    return AsyncLLM(EngineArgs(**args))


def wait_engine_idle(engine: AsyncLLM, timeout: float = 10.0) -> None:
    """Wait until the engine thread has applied every abort (the cut requests are gone)."""
    deadline = time.monotonic() + timeout
    while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)


def blocks_held(engine: AsyncLLM) -> int:
    """KV blocks held by some sequence (cached-but-free prefix blocks count as free)."""
    manager = engine.engine.kv_cache_manager
    return manager.num_blocks - manager.num_free_blocks


@pytest.fixture(scope="module")
def tiny_path(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def engine(tiny_path):
    engine = make_engine(tiny_path)
    yield engine
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def app(engine):
    return build_app(engine, ServerConfig(), MODEL_NAME)


@pytest.fixture(scope="module")
def client(app):
    """A synchronous client on the app (no lifespan: the engine fixture owns shutdown)."""
    return TestClient(app, raise_server_exceptions=False)
