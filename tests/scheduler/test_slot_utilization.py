"""tools/slot_utilization.py: static batching idles 43.7% of its slots on the seeds' example;
the scheduler keeps every slot busy while requests are queued."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "slot_utilization.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("slot_utilization", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_static_batching_of_the_seeds_example(tool):
    first = tool.static_batching(tool.SEED_LENGTHS, 8)
    assert (first.busy_slot_steps, first.offered_slot_steps) == (1800, 8 * 400)
    assert tool.percent(first.overall) == "56.3%"
    assert tool.static_batching(tool.workload(24), 8).while_queued == 1800 / 3200


def test_continuous_batching_fills_every_slot_while_requests_wait(tool):
    lengths = tool.workload(24)
    ours = tool.continuous_batching(lengths, 8)
    assert ours.busy_slot_steps == sum(lengths)  # each token computed exactly once
    assert ours.while_queued >= 0.99
    assert ours.steps < tool.static_batching(lengths, 8).steps
    # No schedule can beat the busiest slot's lower bound: all tokens spread over 8 slots.
    assert ours.steps >= sum(lengths) / 8
