"""tools/bench_memory.py on a small workload: every layout serves every request, and the figures
obey bounds derived independently of the simulation."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_memory.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_memory", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_paged_wastes_less_than_a_block_per_sequence_and_fits_more(bench, capsys):
    argv = "--num-requests 60 --max-prompt 200 --max-tokens 200 --max-model-len 512"
    argv += " --kv-cache-memory 2MiB --bytes-per-token 256 --block-size 16"
    traces = bench.main(argv.split())
    slots = (2 << 20) // 256
    paged = traces["paged"]
    held, stored = paged.peak_waste()
    running_at_peak = paged.running[paged.held.index(held)]
    assert held - stored <= 16 * running_at_peak  # at most one partly filled block each
    assert held <= slots
    static = traces["contiguous, max_model_len"]
    assert max(static.running) == slots // 512  # one max_model_len row per sequence
    exact = traces["contiguous, prompt + max_tokens"]
    assert max(paged.running) > max(exact.running) > max(static.running)
    for trace in traces.values():
        assert trace.running[-1] == 0 and trace.held[-1] == 0  # all served, all freed
    assert "waste at peak" in capsys.readouterr().out
