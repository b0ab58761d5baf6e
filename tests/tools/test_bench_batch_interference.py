"""tools/bench_batch_interference.py runs end to end on a tiny workload against a real server
(the figures themselves are measured on a GPU and kept in docs/benchmarks.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pagedserve.server.testing import live_server

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_batch_interference  # noqa: E402


def test_batch_file_is_seeded_and_within_its_ranges():
    args = bench_batch_interference.parse_args(
        ["--batch-size", "5", "--batch-min-prompt", "3", "--batch-max-prompt", "6"]
        + ["--batch-output", "2", "--vocab-size", "50", "--min-token-id", "4"]
    )
    args.model = "m"
    lines = [json.loads(line) for line in bench_batch_interference.batch_file(args).splitlines()]
    assert [line["custom_id"] for line in lines] == [f"b{i}" for i in range(5)]
    prompts = [line["body"]["prompt"] for line in lines]
    assert all(3 <= len(p) <= 6 and all(4 <= t < 50 for t in p) for p in prompts)
    assert bench_batch_interference.batch_file(args).splitlines() == [
        json.dumps(line).encode() for line in lines
    ]


@pytest.mark.slow
def test_the_benchmark_runs_on_a_tiny_workload(tiny_checkpoint, tmp_path, capsys):
    tiny_path = tiny_checkpoint("llama")
    vocab = json.loads((Path(tiny_path) / "config.json").read_text())["vocab_size"]
    store = str(tmp_path / "store")
    serve = ["--max-model-len", "256", "--scheduling-policy", "priority", "--batch-store", store]
    with live_server(tiny_path, *serve) as server:
        out = tmp_path / "figures.json"
        argv = ["--url", server.url, "--num-requests", "4", "--concurrency", "2"]
        argv += ["--min-prompt", "4", "--max-prompt", "8", "--min-output", "2", "--max-output", "4"]
        argv += ["--batch-size", "200", "--batch-min-prompt", "4", "--batch-max-prompt", "8"]
        argv += ["--batch-output", "16", "--batch-warmup-s", "0.5"]
        argv += ["--vocab-size", str(vocab), "--min-token-id", "3", "--json-out", str(out)]
        assert bench_batch_interference.main(argv) == 0
    printed = capsys.readouterr().out
    assert "TTFT p50 under batch / idle" in printed
    figures = json.loads(out.read_text())
    assert figures["idle"]["completed"] == figures["under_batch"]["completed"] == 4
    assert figures["ttft_p50_ratio"] > 0 and figures["batch"]["id"].startswith("batch_")
