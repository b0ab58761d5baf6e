"""bench_batch_invariant runs both modes on one seeded workload and prints its table: the modes'
seconds, their ratio, the profiled round's split between GEMMs, attention and the rest, and how
many requests' greedy tokens differ (run here on a tiny model for what it prints, not its
figures)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_batch_invariant  # noqa: E402


def test_prints_both_modes_their_ratio_and_the_time_split(tiny_checkpoint, capsys):
    argv = [
        "--model", tiny_checkpoint("llama"), "--num-requests", "6", "--min-prompt", "20",
        "--max-prompt", "40", "--min-output", "2", "--max-output", "5", "--rounds", "1",
        "--max-num-seqs", "4", "--kv-cache-memory", str(8 << 20), "--threads", "1",
    ]  # fmt: skip
    assert bench_batch_invariant.main(argv) == 0
    out = capsys.readouterr().out
    assert "6 requests, prompts 20..40" in out and "4 streams" in out
    lines = out.splitlines()
    off = next(line for line in lines if line.startswith("off") and "GEMM" not in line)
    assert off.split()[3] == "1.00"  # the baseline against itself
    assert any(line.startswith("batch invariant") for line in lines)
    header = next(line for line in lines if line.startswith("profiled round"))
    assert header.split()[-3:] == ["GEMM", "attention", "rest"]
    split = [line for line in lines if line.startswith(("off", "batch invariant"))][-2:]
    assert all(float(value) >= 0 for line in split for value in line.split()[-3:])
    assert "greedy tokens differ between the modes (near-ties): 0" in out
