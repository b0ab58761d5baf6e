"""schemathesis, bounded, against /openapi.json: requests generated from the document's own
schemas (valid ones and near misses) for every operation, none answered with a server error,
and no request or KV block held afterwards.

The operations are driven through schemathesis's strategies with hypothesis directly (its pytest
plugin does not load under this pytest)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings

from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.openapi import openapi_document
from pagedserve.server.testing import TINY_MODEL_NAME, blocks_held, make_engine, wait_engine_idle

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed")
from schemathesis.checks import not_a_server_error  # noqa: E402

MAX_EXAMPLES = 6  # per operation: ~80 requests in all, a few seconds


@pytest.fixture(scope="module")
def st_engine(tiny_path):
    engine = make_engine(tiny_path, max_model_len=40)  # short answers whatever max_tokens says
    yield engine
    asyncio.run(engine.shutdown())


def test_no_server_error_from_schema_generated_requests(st_engine, tmp_path):
    config = ServerConfig(enable_tokenizer_info_endpoint=True, batch_store=str(tmp_path))
    app = build_app(st_engine, config, TINY_MODEL_NAME)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    document = openapi_document("test")
    # every route of the document but /openapi.json itself, which schemathesis leaves out
    assert len(operations) == sum(len(methods) for methods in document["paths"].values()) - 1
    calls: list[str] = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case):
            response = case.call()
            case.validate_response(response, checks=[not_a_server_error])
            calls.append(case.operation.label)

        check()
    assert set(calls) == {op.label for op in operations}  # each operation was called
    assert len(calls) >= 40  # and those with bodies or parameters many times
    wait_engine_idle(st_engine)
    assert not app.state.server.in_flight and blocks_held(st_engine) == 0
