"""AsyncLLM satisfies EngineClient, member by member, and the server asks for nothing else."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from pagedserve.engine import AsyncLLM, EngineArgs, EngineClient

SERVER_SRC = Path(__file__).parents[2] / "packages/server/src/pagedserve/server"
METHODS = [
    "generate", "encode", "abort", "check_health", "get_stats", "shutdown", "add_lora",
    "remove_lora",
]  # fmt: skip
ATTRIBUTES = [
    "tokenizer",
    "model_config",
    "scheduler_config",
    "lora_enabled",
    "image_placeholder",
    "max_image_tokens",
    "args",
]


def test_protocol_members_are_the_ones_listed_here():
    body = vars(EngineClient)
    members = set(body["__annotations__"]) | {
        name for name, value in body.items() if inspect.isfunction(value) and name[0] != "_"
    }
    assert members == set(METHODS) | set(ATTRIBUTES)


@pytest.mark.parametrize("name", METHODS)
def test_async_llm_methods_have_the_protocol_signatures(name):
    ours, theirs = getattr(EngineClient, name), getattr(AsyncLLM, name)
    assert inspect.signature(theirs) == inspect.signature(ours)
    assert inspect.iscoroutinefunction(theirs) == inspect.iscoroutinefunction(ours)


def test_an_async_llm_is_an_engine_client(tiny_checkpoint):
    llm = AsyncLLM(EngineArgs(model=tiny_checkpoint("llama"), num_gpu_blocks_override=16))
    assert isinstance(llm, EngineClient)

    class NoAbort:
        tokenizer = model_config = scheduler_config = None
        generate = check_health = get_stats = shutdown = staticmethod(lambda: None)

    assert not isinstance(NoAbort(), EngineClient)


def test_the_server_uses_only_engine_client_members():
    """Every ``<x>.engine.<member>`` and ``engine.<member>`` the server reads is in the Protocol
    (server/testing.py, the test helper that reaches into the engine thread, excepted)."""
    used: set[str] = set()
    for path in SERVER_SRC.glob("*.py"):
        if path.name == "testing.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "engine") or (
                isinstance(owner, ast.Attribute) and owner.attr == "engine"
            ):
                used.add(node.attr)
    assert used, "the scan found no engine access: the server moved?"
    assert used <= set(METHODS) | set(ATTRIBUTES)
